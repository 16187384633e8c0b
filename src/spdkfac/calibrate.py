"""Micro-benchmarks that measure collectives, inverses and factor products and fit cost models."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from spdkfac.calibrate_factors import measure_factors
from spdkfac.calibrate_report import fit_errors, format_report, plot_calibration, run_metadata
from spdkfac.calibrate_timing import Budget, check_repeats, median_seconds, synchronize
from spdkfac.comm import Communicator, barrier
from spdkfac.costmodel import (
    AlphaBetaModel,
    CalibrationFile,
    CalibrationSamples,
    FactorSample,
    FactorTimeModel,
    PolynomialInverseModel,
)
from spdkfac.linalg import InverseMethod, damped_inverse

__all__ = [
    "Budget",
    "CollectiveSamples",
    "calibrate",
    "fit_errors",
    "format_report",
    "measure_collectives",
    "measure_factors",
    "measure_inverses",
    "plot_calibration",
]

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    """A log that drops its messages."""


class CollectiveSamples(NamedTuple):
    """Measured ``(bytes, seconds)`` pairs of both collectives."""

    broadcast: list[tuple[int, float]]
    allreduce: list[tuple[int, float]]


def measure_collectives(
    comm: Communicator,
    sizes_bytes: Sequence[int],
    repeats: int,
    *,
    budget: Budget | None = None,
) -> CollectiveSamples:
    """Time broadcast and all-reduce of float32 messages of each size, on every rank.

    Every rank must call this with the same arguments. Each size gets one untimed warm-up
    of each collective, then ``repeats`` timed ones (up to 8x more below 1 MiB: small
    messages are cheap and their times noisy), each after a barrier so all ranks start
    together; broadcasts rotate their root over the ranks, as inverse owners do.
    One repeat's time is the slowest rank's (a broadcast root can return before the data
    has arrived, and the placement waits for the last receiver); the sample is the median
    over repeats. The result is identical on every rank. Sizes run smallest first; when
    ``budget`` runs out the larger ones are skipped.

    Args:
        comm: The group to measure.
        sizes_bytes: Message sizes in bytes (rounded down to whole float32 elements).
        repeats: Timed repetitions per size and collective (>= 1).
        budget: Optional shared time allowance.
    """
    check_repeats(repeats)
    broadcast: list[tuple[int, float]] = []
    allreduce: list[tuple[int, float]] = []
    ordered = sorted({int(size) for size in sizes_bytes})
    if ordered and ordered[0] < 4:
        raise ValueError(f"sizes_bytes must be >= 4 (one float32), got {ordered[0]}")
    for _ in range(3):  # the first collectives of a group set up connections
        barrier(comm)
    seconds_per_byte = 1e-9  # a pessimistic 1 GB/s until two sizes have been measured
    last: tuple[int, float] | None = None  # (size, seconds per repeat, barriers included)
    for index, size in enumerate(ordered):
        # A function of the size only, so every rank runs the same number of collectives.
        count = repeats * min(8, max(1, 2**20 // size))
        if last is not None and budget is not None:
            predicted = (count + 1) * (last[1] + 2 * seconds_per_byte * (size - last[0]))
            if not budget.allows(predicted):
                budget.skip("message sizes (bytes)", ordered[index:], predicted)
                break
        start = time.perf_counter()
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=comm.device)
        comm.all_reduce_sum(buffer).wait()
        comm.broadcast(buffer, src=0).wait()
        times = torch.zeros(2, count, dtype=torch.float64)
        for repeat in range(count):
            for row in (0, 1):
                barrier(comm)
                synchronize(comm.device)
                began = time.perf_counter()
                if row == 0:
                    comm.all_reduce_sum(buffer).wait()
                else:
                    comm.broadcast(buffer, src=repeat % comm.world_size).wait()
                synchronize(comm.device)
                times[row, repeat] = time.perf_counter() - began
        slowest = comm.all_reduce_max(times.to(comm.device)).wait().cpu()
        nbytes = buffer.numel() * 4
        allreduce.append((nbytes, float(slowest[0].median())))
        broadcast.append((nbytes, float(slowest[1].median())))
        if len(allreduce) >= 2:
            grown = nbytes - allreduce[-2][0]
            slopes = [(pairs[-1][1] - pairs[-2][1]) / grown for pairs in (allreduce, broadcast)]
            seconds_per_byte = max(1e-10, *slopes)
        last = (size, (time.perf_counter() - start) / count)
    return CollectiveSamples(broadcast=broadcast, allreduce=allreduce)


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
    check_repeats(repeats)
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


def _from_rank0(comm: Communicator, values: Sequence[float]) -> list[float]:
    """Rank 0's ``values`` on every rank (every rank must pass as many values)."""
    if comm.world_size == 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=comm.device)
    return [float(v) for v in comm.broadcast(tensor, src=0).wait().cpu().tolist()]


def calibrate(
    comm: Communicator,
    *,
    dims: Sequence[int],
    sizes_bytes: Sequence[int],
    repeats: int = 5,
    method: InverseMethod = "cholesky",
    max_seconds: float = 60.0,
    model: nn.Module | None = None,
    batch: tuple[Tensor, Tensor] | None = None,
    log: Log | None = None,
    extra_metadata: dict[str, Any] | None = None,
) -> CalibrationFile:
    """Measure and fit every cost model; every rank must call it and gets the same file.

    Phases, in order: collectives (world size > 1; up to 30 % of the budget), factor
    products (when ``model`` and ``batch`` are given; up to 30 % of what is left), then
    inverses (the rest). Inverse and factor timings run on every rank at once, as in
    training, and rank 0's are kept; collective timings are the slowest rank's. A
    single-process run stores world size 1 with α = β = 0.

    Args:
        comm: The group; :class:`~spdkfac.comm.LocalCommunicator` for one process.
        dims: Inverse dimensions to time.
        sizes_bytes: Message sizes to time.
        repeats: Timed repetitions per item.
        method: Inverse method.
        max_seconds: Total time allowance; larger items are skipped when it runs out.
        model: Optional model whose layers' factor times are measured.
        batch: ``(inputs, targets)`` for ``model``.
        log: Progress lines (call it on rank 0 only for one copy).
        extra_metadata: Merged into the file's metadata (e.g. the model name).
    """
    # Every rank checks the same arguments before the first collective, so all fail alike.
    check_repeats(repeats)
    if not dims or min(dims) < 1:
        raise ValueError(f"dims must be a non-empty list of dimensions >= 1, got {dims!r}")
    if comm.world_size > 1 and (not sizes_bytes or min(sizes_bytes) < 4):
        raise ValueError(f"sizes_bytes must be a non-empty list of sizes >= 4, got {sizes_bytes!r}")
    if (model is None) != (batch is None):
        raise ValueError("model and batch must be given together")
    say = log or _quiet
    budget = Budget(max_seconds, comm)
    world = comm.world_size
    broadcast: list[tuple[int, float]] = []
    allreduce: list[tuple[int, float]] = []
    if world > 1:
        say(f"collectives: {len(sizes_bytes)} sizes x {repeats} repeats on {world} ranks")
        measured = measure_collectives(comm, sizes_bytes, repeats, budget=budget.phase(0.3))
        broadcast, allreduce = measured.broadcast, measured.allreduce
    factor_samples: list[FactorSample] = []
    if model is not None and batch is not None:
        say("factor products: one captured batch, every K-FAC layer")
        local = measure_factors(model, *batch, repeats, budget=budget.phase(0.3))
        shared = _from_rank0(comm, [sample.seconds for sample in local])
        factor_samples = [
            FactorSample(s.layer, s.kind, s.flops, seconds)
            for s, seconds in zip(local, shared, strict=True)
        ]
    say(f"inverses ({method}): dims {sorted(set(dims))}, {repeats} repeats")
    local_inverses = measure_inverses(dims, repeats, method, device=comm.device, budget=budget)
    inverse_times = _from_rank0(comm, [seconds for _, seconds in local_inverses])
    inverse_samples = [(d, t) for (d, _), t in zip(local_inverses, inverse_times, strict=True)]
    zero = AlphaBetaModel(alpha=0.0, beta=0.0)
    communication = (
        {1: (zero, zero)}
        if world == 1
        else {world: (AlphaBetaModel.fit(broadcast), AlphaBetaModel.fit(allreduce))}
    )
    samples = CalibrationSamples(
        world_size=world,
        inverse=tuple(inverse_samples),
        broadcast=tuple(broadcast),
        allreduce=tuple(allreduce),
        factor=tuple(factor_samples),
    )
    inverse = PolynomialInverseModel.fit(inverse_samples)
    metadata = run_metadata(comm, method=method, repeats=repeats, max_seconds=max_seconds)
    metadata["budget_notes"] = list(budget.notes)
    metadata.update(extra_metadata or {})
    calibration = CalibrationFile(
        inverse=inverse,
        communication=communication,
        factor=FactorTimeModel.fit(factor_samples) if factor_samples else None,
        metadata=metadata,
        samples=samples,
    )
    metadata["fit_errors"] = fit_errors(calibration)
    for note in budget.notes:
        say(note)
    return dataclasses.replace(calibration, metadata=metadata)
