"""Pieces of the data-parallel tests (tests/distributed): the batches of a step, each
rank's share of them, a model with a layer one rank can skip, snapshots of gradients and
parameters."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["GLOBAL_BATCH", "Branchy", "batch", "bounds", "grads", "params"]

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3


def batch(step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch: 12 float64 images of 2x6x6 and labels in 0..2."""
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def bounds(rank: int, world_size: int, uneven: bool = False) -> tuple[int, int]:
    """The slice of a global batch ``rank`` trains on: equal shares, or (``uneven``) 5 and
    7 examples on 2 ranks, 3, 4 and 5 on 3."""
    if not uneven:
        per_rank = GLOBAL_BATCH // world_size
        return rank * per_rank, (rank + 1) * per_rank
    cuts = [0, 5, GLOBAL_BATCH] if world_size == 2 else [0, 3, 7, GLOBAL_BATCH]
    return cuts[rank], cuts[rank + 1]


class Branchy(nn.Module):
    """A trunk, a side layer the caller may skip (on one rank, say), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor, use_side: bool) -> Tensor:
        x = torch.tanh(self.trunk(x))
        if use_side:
            x = x + torch.tanh(self.side(x))
        return self.head(x)


def grads(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter's gradient, by name (parameters without one left out)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def params(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}
