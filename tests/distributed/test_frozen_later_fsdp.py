"""A registered bias frozen after construction under FSDP2 (I7): it reads as a zero
gradient in its block on every rank, under every strategy, as in one process — never a
"mixed torch.Tensor and DTensor" error on the owner and a hang on the others."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from fsdp_cases import conv_net, full_params, shard
from parallel_cases import batch, bounds
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "spd-kfac", "osawa", "layer-paths")
STEPS = 3
OPTIONS = {"damping": 0.05, "kl_clip": 1e-2, "factor_update_steps": 1, "inv_update_steps": 1}


def _train(model: nn.Module, part: tuple[int, int], strategy: str) -> dict[str, Tensor]:
    """Build the preconditioner, then freeze ``fc1.bias`` and train STEPS steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=optimizer, strategy=strategy, **OPTIONS)
    model.fc1.bias.requires_grad_(False)  # type: ignore[union-attr]
    begin, end = part
    for step in range(STEPS):
        optimizer.zero_grad()
        images, labels = batch(step)
        F.cross_entropy(model(images[begin:end]), labels[begin:end]).backward()
        assert precond.step()
        optimizer.step()
    return full_params(model)


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    part = bounds(rank, world_size)
    return {s: _train(shard(conv_net(), mesh), part, s) for s in STRATEGIES}


def test_a_bias_frozen_after_construction_reads_as_zero_under_fsdp2() -> None:
    expected = _train(conv_net(), (0, 12), "spd-kfac")
    results = run_distributed(_worker, 2, timeout=180)
    for rank, by_strategy in enumerate(results):
        for strategy, params in by_strategy.items():
            for name, value in expected.items():
                torch.testing.assert_close(
                    params[name], value, rtol=1e-9, atol=1e-12, msg=f"{rank} {strategy} {name}"
                )
    assert torch.equal(expected["fc1.bias"], conv_net().fc1.bias.detach())  # never moved
