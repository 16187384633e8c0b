"""Timing damped factor inverses over a range of dimensions."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from spdkfac.calibrate.timing import Budget, median_seconds
from spdkfac.linalg import InverseMethod, damped_inverse
from spdkfac.support.checks import check_int

__all__ = ["measure_inverses"]


def _random_factor(dim: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """A symmetric positive definite ``dim`` x ``dim`` matrix, built in O(d²).

    Cholesky does not pivot, so its time does not depend on the values; a symmetrised
    Gaussian matrix (spectral radius about √(2d)) shifted by 2√d is safely definite without
    the 2d³-flop product ``XXᵀ`` that would cost as much as the inverse being timed.
    """
    matrix = torch.randn(dim, dim, generator=generator).to(device)
    matrix = (matrix + matrix.T).mul_(0.5)
    matrix.diagonal().add_(2.0 * math.sqrt(dim))
    return matrix


def measure_inverses(
    dims: Sequence[int],
    repeats: int,
    method: InverseMethod = "cholesky",
    *,
    damping: float = 1e-3,
    device: torch.device | None = None,
    budget: Budget | None = None,
) -> list[tuple[int, float]]:
    """Median seconds of :func:`~spdkfac.linalg.damped_inverse` for each dimension.

    Runs in the caller's thread settings (set ``torch.set_num_threads`` first). Dims run
    smallest first; a dimension is skipped, with every larger one, when its predicted
    cost (the last dimension's wall time scaled by the cube of the size ratio) no longer
    fits ``budget``.

    Args:
        dims: Factor dimensions.
        repeats: Timed repetitions per dimension (>= 1).
        method: ``"cholesky"`` or ``"eigen"``, as the preconditioner's ``inverse_method``.
        damping: γ added to the diagonal.
        device: Where to run (default CPU).
        budget: Optional shared time allowance.
    """
    check_int("repeats", repeats)
    target = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    samples: list[tuple[int, float]] = []
    ordered = sorted({int(dim) for dim in dims})
    if ordered and ordered[0] < 1:
        raise ValueError(f"dims must be >= 1, got {ordered[0]}")
    last: tuple[int, float] | None = None
    for index, dim in enumerate(ordered):
        if last is not None and budget is not None:
            predicted = last[1] * (dim / last[0]) ** 3
            if not budget.allows(predicted):
                budget.skip("inverse dims", ordered[index:], predicted)
                break
        start = time.perf_counter()
        factor = _random_factor(dim, generator, target)
        invert = functools.partial(damped_inverse, factor, damping, method)
        seconds = median_seconds(invert, repeats, target)
        samples.append((dim, seconds))
        last = (dim, time.perf_counter() - start)
    return samples
