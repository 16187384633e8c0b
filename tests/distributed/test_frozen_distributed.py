"""Frozen biases and shifts under every strategy at world size 2 (gloo, DDP): each rank's
preconditioned gradients are the explicit float64 K-FAC of the trainable parameters only
on the concatenated batch."""

from __future__ import annotations

import warnings

import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from frozen_cases import (
    BATCH,
    OPTIONS,
    check_against_reference,
    explicit_reference,
    frozen_batch,
    frozen_net,
)
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac", "osawa")


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Tensor | None]]:
    inputs, targets = frozen_batch()
    share = BATCH // world_size
    local = slice(rank * share, (rank + 1) * share)
    out = {}
    for strategy in STRATEGIES:
        model = frozen_net()
        ddp = DistributedDataParallel(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            precond = KFACPreconditioner(ddp, strategy=strategy, **OPTIONS)  # type: ignore[arg-type]
        F.cross_entropy(ddp(inputs[local]), targets[local]).backward()
        assert precond.step()
        out[strategy] = {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        }
        precond.remove()
    return out


def test_every_strategy_preconditions_the_trainable_parameters_only() -> None:
    results = run_distributed(_worker, 2, timeout=180)
    inputs, targets = frozen_batch()
    expected = explicit_reference(frozen_net(), inputs, targets)
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            check_against_reference(out[strategy], expected, f"{strategy} rank {rank}")
