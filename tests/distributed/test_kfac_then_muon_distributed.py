"""K-FAC before Muon's orthogonalization across ranks: eigen-Adam then Muon without
momentum (``--optimizer kfac-eigen-adam-muon``) and two-sided K-FAC then Muon
(``kfac-muon --inverse-method cholesky``), under spd-kfac and osawa, at worlds 2 and 3 equal
one process (Muon iterates in bf16: agreement to its rounding)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner

BATCH = 12
#: (strategy, inverse_method, Muon's momentum).
CASES = (
    ("spd-kfac", "eigen-adam", 0.0),
    ("osawa", "eigen-adam", 0.0),
    ("spd-kfac", "cholesky", 0.95),
)


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).double()


def _train(model: nn.Module, rank: int, world: int, case: tuple[str, str, float]) -> list[Tensor]:
    """Three steps, bases refreshed every second: the final parameters."""
    strategy, method, momentum = case
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(
            model, damping=0.1, kl_clip=None, lr=0.05, inverse_method=method,
            inv_update_steps=2, strategy=strategy, skip_layers=["4"],
        )  # fmt: skip
    matrices = [inner[0].weight, inner[2].weight]
    rest = [p for p in inner.parameters() if all(p is not m for m in matrices)]
    muon = torch.optim.Muon(matrices, lr=0.05, momentum=momentum, weight_decay=0.0,
                            adjust_lr_fn="match_rms_adamw")  # fmt: skip
    sgd = torch.optim.SGD(rest, lr=0.05)
    share = BATCH // world
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
        targets = torch.randint(0, 3, (BATCH,), generator=generator)
        part = slice(rank * share, (rank + 1) * share)
        model.zero_grad()
        F.cross_entropy(model(inputs[part]), targets[part]).backward()
        assert precond.step()
        muon.step()
        sgd.step()
    return [p.detach().clone() for p in inner.parameters()]


def _worker(rank: int, world_size: int) -> list[list[Tensor]]:
    return [_train(DistributedDataParallel(_model()), rank, world_size, case) for case in CASES]


@pytest.mark.parametrize("world", [2, 3])
def test_kfac_then_muon_at_worlds_two_and_three_equals_one_process(world: int) -> None:
    expected = [_train(_model(), 0, 1, case) for case in CASES]
    start = [p.detach().clone() for p in _model().parameters()]
    for rank_result in run_distributed(_worker, world, timeout=150):
        for case, got, want in zip(CASES, rank_result, expected, strict=True):
            for mine, theirs, before in zip(got, want, start, strict=True):
                moved = torch.linalg.norm(theirs - before)
                error = float(torch.linalg.norm(mine - theirs) / moved)
                assert error < 0.02, (case, error)
