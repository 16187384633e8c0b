"""Non-negative least squares on relative error, exact for the few-term models used here."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["Predictor", "check_samples", "median_relative_error", "nonnegative_relative_fit"]

# Two subset fits whose residual norms differ by less than this (relative to sqrt(n)) are a
# tie, and the one with fewer terms wins: with as many samples as terms several subsets fit
# exactly, and the simpler one extrapolates more safely.
_TIE = 1e-10


def check_samples(
    samples: Sequence[tuple[float, float]], what: str, *, min_count: int = 1
) -> tuple[list[float], list[float]]:
    """Split ``(x, seconds)`` pairs into two lists, rejecting unusable samples.

    Raises:
        ValueError: Fewer than ``min_count`` samples, a non-finite or negative ``x``, or
            a time that is not finite and > 0 (relative error needs a positive time).
    """
    if len(samples) < min_count:
        raise ValueError(f"{what}: need at least {min_count} sample(s), got {len(samples)}")
    xs: list[float] = []
    times: list[float] = []
    for index, sample in enumerate(samples):
        if len(sample) != 2:
            raise ValueError(f"{what}: sample {index} must be a pair (x, seconds), got {sample!r}")
        x, seconds = float(sample[0]), float(sample[1])
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{what}: sample {index} has x={sample[0]!r}, must be finite >= 0")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"{what}: sample {index} has seconds={sample[1]!r}, must be finite > 0"
            )
        xs.append(x)
        times.append(seconds)
    return xs, times


def nonnegative_relative_fit(
    columns: Sequence[Sequence[float]], targets: Sequence[float]
) -> tuple[float, ...]:
    """Coefficients ``c >= 0`` minimising ``Σᵢ ((Σⱼ cⱼ·columns[j][i] − tᵢ) / tᵢ)²``.

    Dividing each residual by its target makes a 50 µs point count as much as a 5 s one,
    which is what a median-relative-error goal asks for. The non-negativity constraint is
    solved exactly by enumeration: the constrained optimum is the unconstrained
    least-squares fit on its own support, so the best feasible fit over every non-empty
    subset of columns is the optimum (2ᵏ − 1 small solves for k ≤ 3 terms).

    Args:
        columns: ``k`` basis columns, each with one non-negative value per sample.
        targets: Positive measured values, one per sample.

    Returns:
        ``k`` non-negative coefficients (0 for columns outside the chosen subset).
    """
    design = np.asarray(columns, dtype=np.float64).T
    goal = np.asarray(targets, dtype=np.float64)
    if design.ndim != 2 or design.shape[0] != goal.shape[0] or goal.shape[0] == 0:
        raise ValueError("columns and targets must describe the same, non-empty samples")
    weighted = design / goal[:, None]
    ones = np.ones_like(goal)
    count, terms = weighted.shape
    tie = _TIE * math.sqrt(count)
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, terms + 1):
        for subset in itertools.combinations(range(terms), size):
            block = weighted[:, subset]
            # Equilibrate the columns: d⁰ and d³ differ by ten orders of magnitude.
            scale = np.linalg.norm(block, axis=0)
            if np.any(scale == 0):
                continue
            solution = np.linalg.lstsq(block / scale, ones, rcond=None)[0] / scale
            if np.any(solution < 0):
                continue
            residual = float(np.linalg.norm(block @ solution - ones))
            if best is None or residual < best[0] - tie:
                coefficients = np.zeros(terms)
                coefficients[list(subset)] = solution
                best = (residual, coefficients)
    if best is None:
        raise ValueError("no basis column has a non-zero value; nothing to fit")
    return tuple(float(value) for value in best[1])


class Predictor(Protocol):
    """Anything with ``predict(x) -> seconds``: every model of this package."""

    def predict(self, x: float, /) -> float:
        """Predicted seconds at ``x`` (bytes, dimension or flops)."""
        ...


def median_relative_error(model: Predictor, samples: Sequence[tuple[float, float]]) -> float:
    """Median over samples of ``|model.predict(x) − t| / t`` (0.1 means 10 %).

    Args:
        model: Any model with ``predict``.
        samples: ``(x, seconds)`` pairs with positive times.
    """
    xs, times = check_samples(samples, "median_relative_error")
    errors = [abs(model.predict(x) - t) / t for x, t in zip(xs, times, strict=True)]
    return statistics.median(errors)
