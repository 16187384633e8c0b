"""One calibration run: measure collectives, factor products and inverses, fit every model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.calibrate.collectives import measure_collectives
from spdkfac.calibrate.factors import measure_factors
from spdkfac.calibrate.inverses import measure_inverses
from spdkfac.calibrate.report import fit_errors, run_metadata
from spdkfac.calibrate.timing import Budget
from spdkfac.comm import Communicator
from spdkfac.costmodel import (
    AlphaBetaModel,
    CalibrationFile,
    CalibrationSamples,
    FactorSample,
    FactorTimeModel,
    PolynomialInverseModel,
)
from spdkfac.linalg import InverseMethod
from spdkfac.support.checks import check_int

__all__ = ["Log", "calibrate"]

#: Where progress lines go (``print``, a list's ``append``, ...).
Log = Callable[[str], None]


def _quiet(_: str) -> None:
    """A log that drops its messages."""


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
    check_int("repeats", repeats)
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
