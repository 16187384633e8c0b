"""Shared kernels for factor computation: the (optionally bias-augmented) second moment."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["covariance"]


def covariance(rows: Tensor, *, bias: bool) -> Tensor:
    """Second moment ``x̄ᵀx̄ / N`` of the N rows of ``rows`` (``[N, d]``), x̄ = [x, 1] if bias.

    The bias block is filled from column sums instead of concatenating a ones column, so no
    ``[N, d+1]`` copy is made.
    """
    count, dim = rows.shape
    scale = 1.0 / float(count)
    if not bias:
        return torch.mm(rows.t(), rows).mul_(scale)
    out = rows.new_empty(dim + 1, dim + 1)
    out[:dim, :dim] = torch.mm(rows.t(), rows)
    sums = rows.sum(dim=0)
    out[:dim, dim] = sums
    out[dim, :dim] = sums
    out[dim, dim] = float(count)
    return out.mul_(scale)
