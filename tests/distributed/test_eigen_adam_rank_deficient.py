"""``"eigen-adam"`` with rank-deficient factors (6 examples for 17 inputs, a softmax head)
across ranks: the factors, reduced in another order, differ from one process's by
rounding, and the null spaces' bases with them; the update does not."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner

BATCH, INPUTS = 6, 16
STRATEGIES = ("spd-kfac", "osawa")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(INPUTS, 8), nn.Tanh(), nn.Linear(8, 5))


def _train(model: nn.Module, rank: int, world_size: int, strategy: str) -> list[Tensor]:
    """Three SGD steps, bases refreshed every second step: each step's update."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(
            model, damping=0.1, kl_clip=None, lr=0.1, inverse_method="eigen-adam",
            inv_update_steps=2, strategy=strategy,
        )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    share, updates = BATCH // world_size, []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(BATCH, INPUTS, generator=generator)
        targets = torch.randint(0, 5, (BATCH,), generator=generator)
        part = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[part]), targets[part]).backward()
        assert precond.step()
        updates += [p.grad.detach().clone() for p in inner.parameters()]
        optimizer.step()
    return updates


def _worker(rank: int, world_size: int) -> list[list[Tensor]]:
    return [
        _train(DistributedDataParallel(_model()), rank, world_size, strategy)
        for strategy in STRATEGIES
    ]


def test_rank_deficient_eigen_adam_across_two_and_three_ranks_equals_one_process() -> None:
    expected = _train(_model(), 0, 1, "spd-kfac")
    for world_size in (2, 3):
        for rank_result in run_distributed(_worker, world_size, timeout=150):
            for strategy, updates in zip(STRATEGIES, rank_result, strict=True):
                for got, want in zip(updates, expected, strict=True):
                    error = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
                    assert error < 1e-4, (world_size, strategy, error)
