"""One calibration run: measure collectives, factor products and inverses, fit every model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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

__all__ = ["CalibrationPlan", "FactorWorkload", "Log", "calibrate"]

#: Where progress lines go (``print``, a list's ``append``, ...).
Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class CalibrationPlan:
    """What a calibration measures, and how long it may take.

    Attributes:
        dims: Inverse dimensions to time.
        sizes_bytes: Message sizes to time (collectives: world size > 1 only).
        repeats: Timed repetitions per item.
        method: Inverse method.
        max_seconds: Total time allowance; larger items are skipped when it runs out.
    """

    dims: Sequence[int]
    sizes_bytes: Sequence[int]
    repeats: int = 5
    method: InverseMethod = "cholesky"
    max_seconds: float = 60.0

    def check(self, world_size: int) -> None:
        """Raise ``ValueError`` naming the first unusable value (every rank checks the same
        values before the first collective, so all fail alike)."""
        check_int("repeats", self.repeats)
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"dims must be a non-empty list of dimensions >= 1, got {self.dims!r}")
        if world_size > 1 and (not self.sizes_bytes or min(self.sizes_bytes) < 4):
            raise ValueError(
                f"sizes_bytes must be a non-empty list of sizes >= 4, got {self.sizes_bytes!r}"
            )


@dataclass(frozen=True)
class FactorWorkload:
    """A model whose layers' factor products are timed, and the batch they are timed on.

    Attributes:
        model: The model.
        batch: ``(inputs, targets)``.
    """

    model: nn.Module
    batch: tuple[Tensor, Tensor]


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
    plan: CalibrationPlan,
    *,
    factors: FactorWorkload | None = None,
    log: Log | None = None,
    extra_metadata: dict[str, Any] | None = None,
) -> CalibrationFile:
    """Measure and fit every cost model; every rank must call it and gets the same file.

    Phases, in order: collectives (world size > 1; up to 30 % of the budget), factor
    products (with ``factors``; up to 30 % of what is left), then inverses (the rest).
    Inverse and factor timings run on every rank at once, as in training, and rank 0's are
    kept; collective timings are the slowest rank's. A single-process run stores world
    size 1 with α = β = 0.

    Args:
        comm: The group; :class:`~spdkfac.comm.LocalCommunicator` for one process.
        plan: What to time, how often, within which time allowance.
        factors: Optional model (and batch) whose layers' factor times are measured.
        log: Progress lines (call it on rank 0 only for one copy).
        extra_metadata: Merged into the file's metadata (e.g. the model name).
    """
    plan.check(comm.world_size)
    say = log or _quiet
    budget = Budget(plan.max_seconds, comm)
    samples = _measure(comm, plan, factors, budget, say)
    calibration = _fit(samples)
    metadata = run_metadata(
        comm, method=plan.method, repeats=plan.repeats, max_seconds=plan.max_seconds
    )
    metadata["budget_notes"] = list(budget.notes)
    metadata.update(extra_metadata or {})
    metadata["fit_errors"] = fit_errors(calibration)
    for note in budget.notes:
        say(note)
    return dataclasses.replace(calibration, metadata=metadata)


def _measure(
    comm: Communicator,
    plan: CalibrationPlan,
    factors: FactorWorkload | None,
    budget: Budget,
    say: Log,
) -> CalibrationSamples:
    """Every phase's measurements, the same on every rank."""
    world, repeats = comm.world_size, plan.repeats
    broadcast: list[tuple[int, float]] = []
    allreduce: list[tuple[int, float]] = []
    if world > 1:
        say(f"collectives: {len(plan.sizes_bytes)} sizes x {repeats} repeats on {world} ranks")
        measured = measure_collectives(comm, plan.sizes_bytes, repeats, budget=budget.phase(0.3))
        broadcast, allreduce = measured.broadcast, measured.allreduce
    factor_samples: list[FactorSample] = []
    if factors is not None:
        say("factor products: one captured batch, every K-FAC layer")
        local = measure_factors(factors.model, *factors.batch, repeats, budget=budget.phase(0.3))
        shared = _from_rank0(comm, [sample.seconds for sample in local])
        factor_samples = [
            FactorSample(s.layer, s.kind, s.flops, seconds)
            for s, seconds in zip(local, shared, strict=True)
        ]
    say(f"inverses ({plan.method}): dims {sorted(set(plan.dims))}, {repeats} repeats")
    local_inverses = measure_inverses(
        plan.dims, repeats, plan.method, device=comm.device, budget=budget
    )
    inverse_times = _from_rank0(comm, [seconds for _, seconds in local_inverses])
    return CalibrationSamples(
        world_size=world,
        inverse=tuple((d, t) for (d, _), t in zip(local_inverses, inverse_times, strict=True)),
        broadcast=tuple(broadcast),
        allreduce=tuple(allreduce),
        factor=tuple(factor_samples),
    )


def _fit(samples: CalibrationSamples) -> CalibrationFile:
    """The cost models fitted to ``samples`` (which the file keeps), without metadata."""
    world = samples.world_size
    zero = AlphaBetaModel(alpha=0.0, beta=0.0)
    communication = (
        {1: (zero, zero)}
        if world == 1
        else {world: (AlphaBetaModel.fit(samples.broadcast), AlphaBetaModel.fit(samples.allreduce))}
    )
    factor = samples.factor
    return CalibrationFile(
        inverse=PolynomialInverseModel.fit(samples.inverse),
        communication=communication,
        factor=FactorTimeModel.fit(factor) if factor else None,
        samples=samples,
    )
