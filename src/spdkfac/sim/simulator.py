"""Simulating strategies: iteration time and the profiler's breakdown, amortised over refreshes."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spdkfac.placement import Plan
from spdkfac.profiling import BREAKDOWN_CATEGORIES, Event, breakdown
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.engine import simulate
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.strategies import STRATEGY_TABLE, Strategy, StrategySetup, prepare
from spdkfac.sim.timeline import JITTER_PHASES, build_iteration
from spdkfac.sim.workload import Workload

__all__ = ["IterationKind", "StrategyResult", "simulate_strategies", "simulate_strategy"]

_MAX_CYCLE = 100_000
#: Rank-iterations drawn per kind with jitter or a contention spread (fixed seed:
#: reproducible): ``max(8, JITTER_SAMPLES / world size)`` iterations, each of every rank.
JITTER_SAMPLES = 96


@dataclass(frozen=True)
class IterationKind:
    """One kind of iteration and how often it occurs in a refresh cycle.

    Attributes:
        factor_step: Factors computed and exchanged.
        inverse_step: Inverses recomputed.
        count: Iterations of this kind per cycle.
        seconds: Simulated time of one such iteration (slowest rank).
        breakdown: Its seconds per category, averaged over ranks.
    """

    factor_step: bool
    inverse_step: bool
    count: int
    seconds: float
    breakdown: Mapping[str, float]


@dataclass(frozen=True)
class StrategyResult:
    """A strategy's simulated iteration.

    Attributes:
        strategy: Strategy name.
        world_size: Ranks.
        iteration_s: Mean iteration time over a refresh cycle.
        breakdown: Mean seconds per iteration in :data:`~spdkfac.profiling.BREAKDOWN_CATEGORIES`.
        kinds: The distinct iterations of the cycle.
        events: Timeline of each distinct iteration, laid end to end (for a trace).
        plan: The inverse placement's summary ("" for SGD).
        factor_buckets: Factor all-reduces per factor step (None: SGD or one rank).
        grad_buckets: Gradient all-reduces per iteration.
    """

    strategy: str
    world_size: int
    iteration_s: float
    breakdown: Mapping[str, float]
    kinds: tuple[IterationKind, ...]
    events: tuple[Event, ...]
    plan: str
    factor_buckets: int | None
    grad_buckets: int


def _cycle(factor_update_steps: int, inv_update_steps: int) -> dict[tuple[bool, bool], int]:
    for name, value in (
        ("factor_update_steps", factor_update_steps),
        ("inv_update_steps", inv_update_steps),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    length = math.lcm(factor_update_steps, inv_update_steps)
    if length > _MAX_CYCLE:
        raise ValueError(f"refresh cycle of {length} steps is too long (max {_MAX_CYCLE})")
    counts: dict[tuple[bool, bool], int] = {}
    for step in range(length):
        kind = (step % factor_update_steps == 0, step % inv_update_steps == 0)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _run_kind(
    setup: StrategySetup, factor_step: bool, inverse_step: bool
) -> tuple[list[Event], float, dict[str, float]]:
    """One kind of iteration: its timeline (the first draw), mean time and breakdown.

    With jitter (``Hardware.jitter_of``) each phase's compute of each rank in each drawn
    iteration is scaled by ``1 + jitter·z`` and with ``Hardware.contention_spread`` > 0
    the contention it suffers by ``1 + contention_spread·z'`` (``z``, ``z'`` standard
    normal, independent per rank, phase and iteration, from a fixed seed; factors kept
    >= 0.5 and >= 0), so ranks reach every collective at different times, as they do on
    real machines; the results are means over the draws (see :data:`JITTER_SAMPLES`).
    """
    hardware = setup.costs.hardware
    world = setup.costs.world_size
    draws: list[tuple[list[dict[str, float]], list[float]] | None] = [None]
    jitter: dict[str, float] = {phase: hardware.jitter_of(phase) for phase in JITTER_PHASES}
    if (any(jitter.values()) or hardware.contention_spread > 0) and world > 1:
        rng = random.Random(1000 * factor_step + inverse_step)
        draws = []
        for _ in range(max(8, math.ceil(JITTER_SAMPLES / world))):
            speed = [
                {p: max(0.5, 1.0 + sd * rng.gauss(0.0, 1.0)) for p, sd in jitter.items()}
                for _ in range(world)
            ]
            spread = hardware.contention_spread
            hit = [max(0.0, 1.0 + spread * rng.gauss(0.0, 1.0)) for _ in range(world)]
            draws.append((speed, hit))
    timeline: list[Event] = []
    seconds = 0.0
    totals = dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0)
    for draw in draws:
        programs, collectives = build_iteration(
            setup,
            factor_step=factor_step,
            inverse_step=inverse_step,
            jitter=None if draw is None else draw[0],
        )
        events = simulate(
            programs,
            collectives,
            overlap=hardware.overlap,
            contention=hardware.contention,
            sensitivity=None if draw is None else draw[1],
        ).events
        timeline = timeline or events
        seconds += max((event.end for event in events), default=0.0) / len(draws)
        for category, value in breakdown(events, 1).items():
            totals[category] += value / len(draws)
    return timeline, seconds, totals


def _summary(setup: StrategySetup) -> str:
    plan = setup.plan
    assert plan is not None
    communicated = sum(owner >= 0 for owner in plan.owners)
    loads = plan.loads()
    text = (
        f"{plan.placement}: {communicated}/{len(plan.factors)} factors communicated in "
        f"{len(setup.groups)} broadcast(s), max CT load {1000 * max(loads):.2f} ms, "
        f"NCT {1000 * plan.replicated_seconds():.2f} ms"
    )
    return text


def simulate_strategy(
    workload: Workload,
    hardware: Hardware,
    world_size: int,
    strategy: str | Strategy,
    *,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
    plan: Plan | None = None,
) -> StrategyResult:
    """Simulate ``strategy`` on ``world_size`` ranks of ``hardware``.

    Every distinct iteration of the refresh cycle (factor step or not, inverse step or
    not) is simulated once; each ends with every rank synchronised, so iterations are
    independent and the cycle's mean is their count-weighted mean. ``plan`` replaces the
    strategy's inverse placement.

    Raises:
        ValueError: An unknown strategy, a world size < 1 or bad refresh intervals.
    """
    if isinstance(strategy, str):
        if strategy not in STRATEGY_TABLE:
            raise ValueError(f"unknown strategy {strategy!r}")
        strategy = STRATEGY_TABLE[strategy]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    counts = _cycle(factor_update_steps, inv_update_steps)
    if not strategy.uses_kfac:
        counts = {(False, False): 1}
    setup = prepare(WorkloadCosts(workload, hardware, world_size), strategy, plan)
    kinds: list[IterationKind] = []
    timeline: list[Event] = []
    offset = 0.0
    for (factor_step, inverse_step), count in sorted(counts.items(), reverse=True):
        events, seconds, split = _run_kind(setup, factor_step, inverse_step)
        kinds.append(IterationKind(factor_step, inverse_step, count, seconds, split))
        timeline.extend(Event(e.name, e.rank, e.start + offset, e.duration) for e in events)
        offset += max((event.end for event in events), default=0.0)
    total = sum(kind.count for kind in kinds)
    mean = {
        category: sum(kind.count * kind.breakdown[category] for kind in kinds) / total
        for category in BREAKDOWN_CATEGORIES
    }
    return StrategyResult(
        strategy=strategy.name,
        world_size=world_size,
        iteration_s=sum(kind.count * kind.seconds for kind in kinds) / total,
        breakdown=mean,
        kinds=tuple(kinds),
        events=tuple(timeline),
        plan="" if setup.plan is None else _summary(setup),
        factor_buckets=None if setup.fusion is None else len(setup.fusion.buckets),
        grad_buckets=len(setup.grad_buckets),
    )


def simulate_strategies(
    workload: Workload,
    hardware: Hardware,
    worker_counts: Sequence[int],
    strategies: Sequence[str],
    *,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
) -> dict[int, dict[str, StrategyResult]]:
    """:func:`simulate_strategy` for every world size and strategy."""
    return {
        workers: {
            name: simulate_strategy(
                workload,
                hardware,
                workers,
                name,
                factor_update_steps=factor_update_steps,
                inv_update_steps=inv_update_steps,
            )
            for name in strategies
        }
        for workers in worker_counts
    }
