"""The communication scheduler of the backward window (``comm_scheduler``), planned with the
runtime's own planner.

While a pipelined factor exchange is in flight, DDP's gradient buckets and the factor
buckets share each rank's link. ``"fifo"`` is what the simulator always modelled: gradient
buckets on the ``default`` channel, factor buckets on a ``factor`` channel of their own,
each in its own order, the two sharing the link (or one queue with
``Hardware.single_queue``). ``"priority"`` plans one order with
:func:`~spdkfac.planning.schedule.plan_priority`, the planner the real run uses: every bucket
is cut into chunks of :func:`~spdkfac.planning.schedule.chunk_elements_for` elements, one
collective each, all on a channel of their own (the scheduler's process group), and every
rank issues them in the planned order as their data becomes ready
(:class:`~spdkfac.sim.builder.ScheduledWindow`), so a gradient chunk goes before the rest
of a factor bucket planned after it. The factor exchange's other calls (the weights) stay
on the factor channel, as the runtime leaves them on the factor stream's own group.

The planner reads what the real run gives it: each bucket's ready time on the nominal
compute-only timeline (rank 0's measurement without communication in the way; a bucket
launches after the ones before it in its stream, as DDP and the fusion plan launch them)
and the α-β all-reduce line the run plans with (``Hardware.cost_model``). The engine then
runs that order with its own costs, so a bucket that is late against the plan holds up
every chunk planned after it, as at run time.

A window exists only on factor steps of a strategy whose factor buckets are launched
during the backward pass (an eager fusion plan); elsewhere ``"priority"`` is ``"fifo"``.
Strategies whose owners compute (Osawa et al.) are simulated as with ``"fifo"`` too: the
runtime may chunk their reduce-scatters, but that is not modelled here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.linalg import packed_size
from spdkfac.planning.fusion import FusionPlan
from spdkfac.planning.schedule import (
    COMM_SCHEDULERS,
    FACTORS,
    GRADIENTS,
    STARTUP_SHARE,
    CommSchedule,
    ScheduledCall,
    chunk_elements_for,
    gradient_busy,
    plan_priority,
)
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.network import CollectiveCost
from spdkfac.sim.workload import FactorHook, GradReady, Op
from spdkfac.strategies import Strategy

__all__ = [
    "BYTES_PER_ELEMENT",
    "WINDOW_POLICIES",
    "FifoWindow",
    "PriorityWindow",
    "WindowPolicy",
    "chunk_line",
    "gradient_calls",
    "nominal_ready_times",
    "parse_comm_schedulers",
    "window_calls",
    "window_policy",
]

#: Bytes of one communicated element of a bucket (float32, as the simulated buckets and
#: the fusion plans count them).
BYTES_PER_ELEMENT = 4


class WindowPolicy(Protocol):
    """A ``comm_scheduler`` value: how the backward window's collectives are ordered."""

    @property
    def name(self) -> str:
        """The option's value."""
        ...

    def plan(
        self,
        costs: WorkloadCosts,
        strategy: Strategy,
        grad_buckets: tuple[tuple[str, ...], ...],
        fusion: FusionPlan | None,
    ) -> CommSchedule | None:
        """The window's schedule, or None: gradient and factor buckets as without one."""
        ...

    def gradient_busy(
        self, costs: WorkloadCosts, strategy: Strategy, grad_buckets: tuple[tuple[str, ...], ...]
    ) -> tuple[tuple[tuple[float, float], ...], int | None]:
        """The link intervals the window's gradient chunks hold (seconds from the forward
        pass's start) and the chunk size, for a fusion policy that plans around them."""
        ...


@dataclass(frozen=True)
class FifoWindow:
    """Today's behaviour: no plan (two channels, or one queue, in launch order)."""

    name: str = "fifo"

    def plan(
        self,
        costs: WorkloadCosts,
        strategy: Strategy,
        grad_buckets: tuple[tuple[str, ...], ...],
        fusion: FusionPlan | None,
    ) -> CommSchedule | None:
        """No schedule."""
        return None

    def gradient_busy(
        self, costs: WorkloadCosts, strategy: Strategy, grad_buckets: tuple[tuple[str, ...], ...]
    ) -> tuple[tuple[tuple[float, float], ...], int | None]:
        """Nothing pre-empts the factor buckets."""
        return (), None


@dataclass(frozen=True)
class PriorityWindow:
    """:func:`~spdkfac.planning.schedule.plan_priority` over the window's buckets.

    Attributes:
        name: The option's value.
        startup_share: Start-up share of a chunk's time (sets the chunk size).
    """

    name: str = "priority"
    startup_share: float = STARTUP_SHARE

    def plan(
        self,
        costs: WorkloadCosts,
        strategy: Strategy,
        grad_buckets: tuple[tuple[str, ...], ...],
        fusion: FusionPlan | None,
    ) -> CommSchedule | None:
        """The chunk order of a window with pipelined factor buckets (None without one)."""
        if costs.world_size < 2 or fusion is None or not fusion.eager or strategy.owner_computes:
            return None
        model = costs.hardware.cost_model(costs.world_size).allreduce
        calls = window_calls(costs, grad_buckets, fusion)
        return plan_priority(
            calls,
            model,
            bytes_per_element=BYTES_PER_ELEMENT,
            chunk_elements=self._chunk(model, calls),
        )

    def gradient_busy(
        self, costs: WorkloadCosts, strategy: Strategy, grad_buckets: tuple[tuple[str, ...], ...]
    ) -> tuple[tuple[tuple[float, float], ...], int | None]:
        """:func:`~spdkfac.planning.schedule.gradient_busy` of the window's gradient calls (the
        chunk size from the largest of them: the factor buckets are not planned yet)."""
        calls = gradient_calls(costs, grad_buckets)
        if costs.world_size < 2 or strategy.owner_computes or not calls:
            return (), None
        model = costs.hardware.cost_model(costs.world_size).allreduce
        chunk = self._chunk(model, calls)
        busy = gradient_busy(
            calls, model, bytes_per_element=BYTES_PER_ELEMENT, chunk_elements=chunk
        )
        return busy, chunk

    def _chunk(self, model: AlphaBetaModel, calls: Sequence[ScheduledCall]) -> int:
        largest = BYTES_PER_ELEMENT * max(call.elements for call in calls)
        return chunk_elements_for(
            chunk_line(model, largest), BYTES_PER_ELEMENT, startup_share=self.startup_share
        )


def chunk_line(model: AlphaBetaModel, nbytes: float) -> AlphaBetaModel:
    """The α-β line that sizes chunks: the one an ``nbytes``-byte message travels on.

    A simulated network's all-reduce is the envelope of several algorithms
    (:class:`~spdkfac.sim.network.CollectiveCost`), whose ``alpha`` and ``beta`` are the
    small-message line's; chunks sized from it (a tree's small start-up) would cost more
    per byte than the window's buckets do on their own line (a ring's). A real run's one
    calibrated line, fitted to bucket-sized messages, is closer to the latter.
    """
    return model.choose(nbytes)[1] if isinstance(model, CollectiveCost) else model


#: ``comm_scheduler`` value → policy (keys: :data:`~spdkfac.planning.schedule.COMM_SCHEDULERS`).
WINDOW_POLICIES: Mapping[str, WindowPolicy] = MappingProxyType(
    {policy.name: policy for policy in (FifoWindow(), PriorityWindow())}
)


def window_policy(name: str) -> WindowPolicy:
    """The policy called ``name``.

    Raises:
        ValueError: An unknown name (the message names ``comm_scheduler`` and the value).
    """
    if not isinstance(name, str) or name not in WINDOW_POLICIES:
        raise ValueError(f"comm_scheduler must be one of {COMM_SCHEDULERS}, got {name!r}")
    return WINDOW_POLICIES[name]


def parse_comm_schedulers(text: str) -> tuple[str, ...]:
    """Scheduler names from a comma list; ``both`` stands for every one (order kept,
    duplicates dropped).

    Raises:
        ValueError: An unknown or missing name.
    """
    names: list[str] = []
    for item in (part.strip().lower() for part in text.split(",")):
        chosen = COMM_SCHEDULERS if item == "both" else (item,) if item else ()
        for name in chosen:
            window_policy(name)
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"comm_scheduler: expected a comma list of schedulers, got {text!r}")
    return tuple(names)


def nominal_ready_times(costs: WorkloadCosts) -> dict[str, float]:
    """Seconds from the forward pass's start, on the compute-only timeline of a factor
    step, at which each factor (``"<layer>/A"``, ``"<layer>/G"``: its first hand-over, as
    the simulated hooks hand over) and each parameter's gradient is ready."""
    workload = costs.workload
    now = 0.0
    times: dict[str, float] = {}
    for item in (*workload.forward, *workload.backward):
        if isinstance(item, Op):
            now += costs.op(item)
        elif isinstance(item, FactorHook):
            now += costs.factor(workload.layer(item.layer), item.kind)
            times.setdefault(f"{item.layer}/{item.kind}", now)
        elif isinstance(item, GradReady):
            times.setdefault(item.parameter, now)
    return times


def _launch_times(buckets: Sequence[Sequence[str]], times: Mapping[str, float]) -> list[float]:
    """When each bucket is launched: complete, and after every bucket before it."""
    launched: list[float] = []
    for bucket in buckets:
        ready = max((times.get(key, 0.0) for key in bucket), default=0.0)
        launched.append(max(ready, launched[-1] if launched else 0.0))
    return launched


def gradient_calls(
    costs: WorkloadCosts, grad_buckets: tuple[tuple[str, ...], ...]
) -> list[ScheduledCall]:
    """Every gradient bucket of the window (DDP's order), its elements and nominal launch
    time."""
    times = nominal_ready_times(costs)
    numel = dict(costs.workload.parameters)
    return [
        ScheduledCall(GRADIENTS, index, sum(numel[name] for name in bucket), ready)
        for index, (bucket, ready) in enumerate(
            zip(grad_buckets, _launch_times(grad_buckets, times), strict=True)
        )
    ]


def window_calls(
    costs: WorkloadCosts, grad_buckets: tuple[tuple[str, ...], ...], fusion: FusionPlan
) -> tuple[ScheduledCall, ...]:
    """The window's calls for the planner: every gradient bucket (DDP's order) and every
    factor bucket (the fusion plan's), their elements and nominal launch times."""
    workload = costs.workload
    times = nominal_ready_times(costs)
    dims = {f"{layer.name}/A": layer.a_dim for layer in workload.layers}
    dims |= {f"{layer.name}/G": layer.g_dim for layer in workload.layers}
    calls = gradient_calls(costs, grad_buckets)
    calls += [
        ScheduledCall(FACTORS, index, sum(packed_size(dims[key]) for key in bucket), ready)
        for index, (bucket, ready) in enumerate(
            zip(fusion.buckets, _launch_times(fusion.buckets, times), strict=True)
        )
    ]
    return tuple(calls)
