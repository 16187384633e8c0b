"""``strategy="layer-paths"`` at world 2 (gloo): with a cost model under which two layers
go to their owners (one on each rank) and two the replicated way (their inverses
broadcast), the preconditioned gradients and, over several steps with stale factors and
inverses, the parameters equal single-process float64 K-FAC on the global batch, under
FSDP2, DDP and with no wrapper; a state dict taken mid-run resumes the same run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from fsdp_cases import OPTIONS, assert_matches, conv_net, full_params, global_part, shard, train
from parallel_cases import batch
from spdkfac import KFACPreconditioner
from spdkfac.costmodel import AlphaBetaModel, CostModel, PolynomialInverseModel

STEPS = 4
#: Per-call inversions dearer than a broadcast (every replicated factor is communicated),
#: costly preconditioning and a dear all-reduce start-up: ConvNet's conv (owner rank 0)
#: and conv2 (owner rank 1) go to their owners, fc1 and fc2 the replicated way
#: (tests/planning/test_gradient_paths.py checks the plan itself).
MIXED = CostModel(
    inverse=PolynomialInverseModel(c0=1e-4, c2=0.0, c3=3e-7),
    broadcast=AlphaBetaModel(alpha=1e-5, beta=1e-9),
    allreduce=AlphaBetaModel(alpha=2e-4, beta=2e-9),
)
_OPTIONS = {**OPTIONS, "strategy": "layer-paths", "cost_model": MIXED}
_HELD = ({"conv", "fc1", "fc2"}, {"conv2", "fc1", "fc2"})


def _sgd(params: Sequence[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _unwrapped(values: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name.removeprefix("module."): value for name, value in values.items()}


def _models(rank: int, world_size: int) -> dict[str, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "fsdp": shard(conv_net(), mesh),
        "ddp": DistributedDataParallel(conv_net()),
        "plain": conv_net(),
    }


def _paths_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    part = global_part("conv", rank, world_size)
    for layout, model in _models(rank, world_size).items():
        first, final, held = train(model, "conv", STEPS, _sgd, part, **_OPTIONS)
        out[layout] = (_unwrapped(first), _unwrapped(final), set(held))
    return out


def test_mixed_paths_match_single_process_kfac() -> None:
    results = run_distributed(_paths_worker, 2, timeout=180)
    grads, params, _ = train(conv_net(), "conv", STEPS, _sgd, (0, 12), **OPTIONS)
    assert grads and params
    for rank, out in enumerate(results):
        for layout, (first, final, held) in out.items():
            # Owner layers' inverses on their owner only, replicated ones everywhere.
            assert held == _HELD[rank], f"{layout} rank {rank}"
            assert set(first) == set(grads) and set(final) == set(params)
            assert_matches(first, final, (grads, params), f"{layout} rank {rank}")


def _step(model: nn.Module, precond: KFACPreconditioner, optimizer: Any, step: int) -> None:
    begin, end = global_part("conv", torch.distributed.get_rank(), 2)
    optimizer.zero_grad()
    images, labels = batch(step)
    F.cross_entropy(model(images[begin:end]), labels[begin:end]).backward()
    assert precond.step()
    optimizer.step()


def _resume_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(conv_net(), mesh)
    optimizer = _sgd(list(model.parameters()))
    precond = KFACPreconditioner(model, optimizer=optimizer, **_OPTIONS)
    for step in range(2):
        _step(model, precond, optimizer, step)
    saved = precond.state_dict()  # a collective: the owners' layers reach every rank
    precond.remove()
    resumed = KFACPreconditioner(model, optimizer=optimizer, **_OPTIONS)
    resumed.load_state_dict(saved)
    held = {name for name in resumed.layers if resumed.inverses(name)[0] is not None}
    reloaded = resumed.state_dict()
    for step in range(2, STEPS):
        _step(model, resumed, optimizer, step)
    return {"saved": saved, "reloaded": reloaded, "held": held, "final": full_params(model)}


def test_state_dict_round_trip_resumes_the_run() -> None:
    results = run_distributed(_resume_worker, 2, timeout=120)
    _, params, _ = train(conv_net(), "conv", STEPS, _sgd, (0, 12), **OPTIONS)
    for rank, out in enumerate(results):
        assert out["held"] == _HELD[rank]
        saved, reloaded = out["saved"]["layers"], out["reloaded"]["layers"]
        assert set(saved) == {"conv", "conv2", "fc1", "fc2"} == set(reloaded)
        for layer, entries in saved.items():
            for key, value in entries.items():
                if isinstance(value, Tensor):
                    torch.testing.assert_close(reloaded[layer][key], value, rtol=0, atol=0)
        for name, expected in params.items():
            torch.testing.assert_close(out["final"][name], expected, rtol=1e-8, atol=1e-10)
