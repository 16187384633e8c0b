"""Simulating strategies: iteration time and the profiler's breakdown, amortised over refreshes."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from spdkfac.planning.placement import Plan
from spdkfac.planning.schedule import SCHEDULER_POLICIES
from spdkfac.profiling import BREAKDOWN_CATEGORIES, Event, breakdown
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.engine import simulate
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.strategies import (
    Strategy,
    StrategySetup,
    factor_memory_bytes,
    plan_summary,
    prepare,
    selection,
)
from spdkfac.sim.timeline import JITTER_PHASES, build_iteration, rank_speeds
from spdkfac.sim.window import window_policy
from spdkfac.sim.workload import Workload
from spdkfac.strategies import AutoStrategy

__all__ = [
    "FULL_TIMELINE_RANKS",
    "MAX_RANK_PROGRAMS",
    "MAX_WORKERS",
    "IterationKind",
    "StrategyResult",
    "rank_classes",
    "rank_programs",
    "simulate_strategies",
    "simulate_strategy",
]

_MAX_CYCLE = 100_000
#: Rank-iterations drawn per kind with jitter or a contention spread (fixed seed:
#: reproducible): ``max(8, JITTER_SAMPLES / world size)`` iterations, each of every rank.
JITTER_SAMPLES = 96
#: Largest world size :func:`simulate_strategy` takes. With identical ranks it simulates one
#: rank per class (the inverse owners and one more), so this bounds only the O(P) planning.
MAX_WORKERS = 65_536
#: Rank programs per kind of iteration (all draws together) above which ``spdkfac
#: simulate`` refuses a run whose ranks all differ (about 30 s per 1,000 on ResNet-50).
MAX_RANK_PROGRAMS = 2048
#: World sizes up to which ``StrategyResult.events`` holds every rank's timeline; above,
#: one rank per class of identical ranks (the classes' first ranks).
FULL_TIMELINE_RANKS = 16


@dataclass(frozen=True)
class IterationKind:
    """One kind of iteration and how often it occurs in a refresh cycle.

    Attributes:
        factor_step: Factors computed and exchanged.
        inverse_step: Inverses recomputed.
        count: Iterations of this kind per cycle.
        seconds: Simulated time of one such iteration (slowest rank).
        breakdown: Its seconds per category, averaged over ranks.
        simulated_ranks: Distinct rank programs simulated (classes of identical ranks).
    """

    factor_step: bool
    inverse_step: bool
    count: int
    seconds: float
    breakdown: Mapping[str, float]
    simulated_ranks: int = 0


@dataclass(frozen=True)
class StrategyResult:
    """A strategy's simulated iteration.

    Attributes:
        strategy: Strategy name.
        world_size: Ranks.
        iteration_s: Mean iteration time over a refresh cycle.
        breakdown: Mean seconds per iteration in :data:`~spdkfac.profiling.BREAKDOWN_CATEGORIES`.
        kinds: The distinct iterations of the cycle.
        events: Timeline of each distinct iteration, laid end to end (for a trace): of
            every rank up to :data:`FULL_TIMELINE_RANKS` ranks, above of the first rank of
            each class of identical ranks.
        plan: The inverse placement's summary ("" for SGD).
        factor_buckets: Factor all-reduces per factor step (None: SGD or one rank).
        grad_buckets: DDP's gradient buckets per iteration (all-reduced; reduce-scattered
            to owners by an owner-computes strategy).
        factor_memory_bytes: Running factors and inverses on the rank holding the most
            (full float32 squares, as the real blocks store them; 0 for SGD).
        comm_scheduler: The backward window's scheduler (:mod:`spdkfac.sim.window`).
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
    factor_memory_bytes: int = 0
    comm_scheduler: str = "fifo"


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
) -> tuple[list[Event], float, dict[str, float], int]:
    """One kind of iteration: its timeline (the first draw), mean time, breakdown and the
    number of distinct rank programs simulated (:func:`rank_classes`; the first draw's).

    With jitter (``Hardware.jitter_of``) each phase's compute of each rank in each drawn
    iteration is scaled by ``1 + jitter·z`` and with ``Hardware.contention_spread`` > 0
    the contention it suffers by ``1 + contention_spread·z'`` (``z``, ``z'`` standard
    normal, independent per rank, phase and iteration, from a fixed seed; factors kept
    >= 0.5 and >= 0), so ranks reach every collective at different times, as they do on
    real machines; the results are means over the draws (see :data:`JITTER_SAMPLES`).
    Each draw simulates one rank per class of identical ranks (:func:`rank_classes`).
    """
    hardware = setup.costs.hardware
    world = setup.costs.world_size
    draws: list[tuple[list[dict[str, float]], list[float]] | None] = [None]
    jitter: dict[str, float] = {phase: hardware.jitter_of(phase) for phase in JITTER_PHASES}
    if _draws(hardware, world) > 1:
        rng = random.Random(1000 * factor_step + inverse_step)
        draws = []
        for _ in range(_draws(hardware, world)):
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
    simulated = 0
    for draw in draws:
        scales = None if draw is None else draw[0]
        hits = None if draw is None else draw[1]
        classes = rank_classes(setup, inverse_step=inverse_step, jitter=scales, sensitivity=hits)
        ranks = [members[0] for members in classes]
        programs, collectives = build_iteration(
            setup, factor_step=factor_step, inverse_step=inverse_step, jitter=scales, ranks=ranks
        )
        result = simulate(
            programs,
            collectives,
            overlap=hardware.overlap,
            contention=hardware.contention,
            sensitivity=None if hits is None else [hits[rank] for rank in ranks],
        )
        by_class: list[list[Event]] = [[] for _ in classes]
        for event in result.events:
            by_class[event.rank].append(event)
        if not timeline:
            timeline = _timeline(by_class, classes, expand=world <= FULL_TIMELINE_RANKS)
            simulated = len(classes)
        seconds += max((event.end for event in result.events), default=0.0) / len(draws)
        for members, events in zip(classes, by_class, strict=True):
            weight = len(members) / world / len(draws)
            for category, value in breakdown(events, 1).items():
                totals[category] += weight * value
    return timeline, seconds, totals, simulated


def _draws(hardware: Hardware, world_size: int) -> int:
    """Iterations drawn per kind: several when compute or contention vary per iteration."""
    varies = any(hardware.jitter_of(phase) for phase in JITTER_PHASES)
    if (varies or hardware.contention_spread > 0) and world_size > 1:
        return max(8, math.ceil(JITTER_SAMPLES / world_size))
    return 1


def rank_programs(hardware: Hardware, world_size: int) -> int | None:
    """Rank programs one kind of iteration simulates (all draws together) when every rank
    differs (a rank spread, jitter or a contention spread); None when ranks are identical
    but for their inverse broadcasts, where :func:`rank_classes` keeps it small."""
    draws = _draws(hardware, world_size)
    if draws == 1 and (hardware.rank_spread == 0 or world_size < 2):
        return None
    return draws * world_size


def rank_classes(
    setup: StrategySetup,
    *,
    inverse_step: bool,
    jitter: Sequence[Mapping[str, float]] | None = None,
    sensitivity: Sequence[float] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """The ranks of ``setup``'s world in classes of identical programs (by first rank).

    A rank's program depends only on the inverse broadcasts it owns (on inverse steps) or,
    where owners compute (Osawa et al.), on the layers it owns (on every step), its
    compute speed (``Hardware.rank_spread``) and this iteration's draws (``jitter``, the
    contention ``sensitivity``). Every collective spans every rank, and the engine's rates
    depend on its participants only through whether any computes and how many collectives
    each is in, which members of a class share. So one rank per class, with collectives
    among the representatives, gives exactly every rank's timeline: at 1,024 workers a
    round-robin placement of ResNet-50's 108 factors has 109 classes, D-KFAC one.
    """
    world = setup.costs.world_size
    speeds = rank_speeds(world, setup.costs.hardware.rank_spread)
    owned: dict[int, list[int]] = {}
    if inverse_step and setup.strategy.uses_kfac:
        for index, group in enumerate(setup.groups):
            owned.setdefault(group.owner, []).append(index)
    layers: dict[int, list[str]] = {}
    for layer, owner in setup.layer_owners.items():
        layers.setdefault(owner, []).append(layer)
    classes: dict[tuple[object, ...], list[int]] = {}
    for rank in range(world):
        key = (
            tuple(owned.get(rank, ())),
            tuple(layers.get(rank, ())),
            speeds[rank],
            () if jitter is None else tuple(sorted(jitter[rank].items())),
            1.0 if sensitivity is None else sensitivity[rank],
        )
        classes.setdefault(key, []).append(rank)
    return tuple(tuple(members) for members in classes.values())


def _timeline(
    by_class: list[list[Event]], classes: tuple[tuple[int, ...], ...], *, expand: bool
) -> list[Event]:
    """Engine events (rank = class position) on real ranks: every member of each class
    when ``expand``, else the class's first rank alone."""
    events = [
        Event(event.name, rank, event.start, event.duration)
        for members, class_events in zip(classes, by_class, strict=True)
        for rank in (members if expand else members[:1])
        for event in class_events
    ]
    return sorted(events, key=lambda e: (e.rank, e.start, -e.duration))


def simulate_strategy(
    workload: Workload,
    hardware: Hardware,
    world_size: int,
    strategy: str | Strategy | AutoStrategy,
    *,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
    plan: Plan | None = None,
    comm_scheduler: str = "fifo",
) -> StrategyResult:
    """Simulate ``strategy`` on ``world_size`` ranks of ``hardware``.

    Every distinct iteration of the refresh cycle (factor step or not, inverse step or
    not) is simulated once; each ends with every rank synchronised, so iterations are
    independent and the cycle's mean is their count-weighted mean. ``plan`` replaces the
    strategy's inverse placement; ``comm_scheduler`` orders the backward window's
    gradient and factor buckets (:mod:`spdkfac.sim.window`; its schedule is appended to
    the result's ``plan``; a scheduler that orders no traffic, ``"fifo"``, keeps the
    row's own, e.g. ``spd-kfac+priority``'s).

    ``strategy`` is a row, a name (:func:`~spdkfac.sim.strategies.selection`) or an
    :class:`~spdkfac.strategies.AutoStrategy` (``"auto"``): the fastest of its candidates
    here (what ``strategy="auto"`` keeps after its trials, whose steps are not modelled).
    The inverse form is the workload's (:attr:`Workload.form`).

    Raises:
        ValueError: An unknown strategy or ``comm_scheduler``, a world size < 1 or bad
            refresh intervals.
    """
    window_policy(comm_scheduler)
    run = _Run(workload, hardware, world_size, factor_update_steps, inv_update_steps, plan)
    chosen = selection(strategy)
    if isinstance(chosen, AutoStrategy):
        tried = [run.row(row, comm_scheduler) for row in chosen.candidates]
        best = min(tried, key=lambda result: result.iteration_s)
        times = ", ".join(f"{r.strategy} {1e3 * r.iteration_s:.1f} ms" for r in tried)
        return replace(
            best, strategy=chosen.name, plan=f"chose {best.strategy} ({times}); {best.plan}"
        )
    return run.row(chosen, comm_scheduler)


@dataclass(frozen=True)
class _Run:
    """One simulation's inputs but the strategy: :meth:`row` simulates one row."""

    workload: Workload
    hardware: Hardware
    world_size: int
    factor_update_steps: int
    inv_update_steps: int
    plan: Plan | None

    def __post_init__(self) -> None:
        world_size = self.world_size
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if world_size > MAX_WORKERS:
            raise ValueError(f"world_size must be <= {MAX_WORKERS}, got {world_size}")
        _cycle(self.factor_update_steps, self.inv_update_steps)  # checks the intervals

    def row(self, strategy: Strategy, comm_scheduler: str) -> StrategyResult:
        """Simulate the row ``strategy`` over a refresh cycle."""
        if not SCHEDULER_POLICIES[comm_scheduler].orders_traffic:
            comm_scheduler = strategy.scheduler.name  # a ``+priority`` row keeps its own
        counts = _cycle(self.factor_update_steps, self.inv_update_steps)
        if not strategy.uses_kfac:
            counts = {(False, False): 1}
        costs = WorkloadCosts(self.workload, self.hardware, self.world_size)
        setup = prepare(costs, strategy, self.plan, comm_scheduler=comm_scheduler)
        kinds: list[IterationKind] = []
        timeline: list[Event] = []
        offset = 0.0
        for (factor_step, inverse_step), count in sorted(counts.items(), reverse=True):
            events, seconds, split, simulated = _run_kind(setup, factor_step, inverse_step)
            kinds.append(IterationKind(factor_step, inverse_step, count, seconds, split, simulated))
            timeline.extend(Event(e.name, e.rank, e.start + offset, e.duration) for e in events)
            offset += max((event.end for event in events), default=0.0)
        return _result(setup, kinds, timeline)


def _result(
    setup: StrategySetup, kinds: Sequence[IterationKind], timeline: Sequence[Event]
) -> StrategyResult:
    """A row's result: its kinds of iteration weighted by their counts in the cycle."""
    total = sum(kind.count for kind in kinds)
    mean = {
        category: sum(kind.count * kind.breakdown[category] for kind in kinds) / total
        for category in BREAKDOWN_CATEGORIES
    }
    return StrategyResult(
        strategy=setup.strategy.name,
        world_size=setup.costs.world_size,
        iteration_s=sum(kind.count * kind.seconds for kind in kinds) / total,
        breakdown=mean,
        kinds=tuple(kinds),
        events=tuple(timeline),
        plan=plan_summary(setup),
        factor_buckets=None if setup.fusion is None else len(setup.fusion.buckets),
        grad_buckets=len(setup.grad_buckets),
        factor_memory_bytes=factor_memory_bytes(setup),
        comm_scheduler=setup.comm_scheduler,
    )


def simulate_strategies(
    workload: Workload,
    hardware: Hardware,
    worker_counts: Sequence[int],
    strategies: Sequence[str],
    *,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
    comm_scheduler: str = "fifo",
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
                comm_scheduler=comm_scheduler,
            )
            for name in strategies
        }
        for workers in worker_counts
    }
