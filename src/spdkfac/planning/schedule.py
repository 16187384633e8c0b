"""Priority schedules: the one order in which every rank issues the chunks of a window's
collectives (``comm_scheduler="priority"``).

PACE (Bao, Peng, Chen, Wu, "Preemptive All-reduce Scheduling for Expediting Distributed
DNN Training", IEEE INFOCOM 2020, Sec. III–IV) and ByteScheduler (Peng et al., SOSP 2019,
Sec. 3) cut tensors into chunks and let a chunk of a more urgent tensor go before the
remaining chunks of a less urgent one. Collectives must be issued in the same order on
every rank, so the order here is not decided by whichever hook fires first: it is a pure
function of the window's calls (sizes, priorities, and their readiness times as rank 0
measured them), computed once by list scheduling on the α-β model: whenever the link is
free, the most urgent call whose data is predicted ready sends its next chunk. At run time
a rank waits for a chunk's data before issuing it (:mod:`spdkfac.comm.scheduler`).

A *window* is one backward pass with a factor exchange in flight: DDP's gradient buckets
(stream ``"gradients"``, DDP's bucket order) and the pipelined factor buckets (stream
``"factors"``, the fusion plan's order). The priority rule (ByteScheduler's: what the next
computation needs first):

1. Gradients before factors. DDP's backward does not return before every gradient bucket
   is reduced, and the optimizer step needs them; factors are needed only after that,
   when the inverse phase starts (which waits for the whole exchange).
2. Among gradient buckets, the first layers' first: DDP's last bucket holds the first
   layers, which the next forward pass uses first.
3. Among factor buckets, the fusion plan's order (the order they become ready).

A gradient chunk planned after a factor bucket waits for it; a factor bucket still
incomplete when the backward pass ends (a layer unused on this rank) is launched then with
what it has (missing slots count with weight 0, exactly as at the step), so no chunk ever
waits for data that comes only after DDP's backward has waited for its gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.costmodel import AlphaBetaModel

__all__ = [
    "COMM_SCHEDULERS",
    "FACTORS",
    "FIFO",
    "GRADIENTS",
    "PRIORITY",
    "SCHEDULER_POLICIES",
    "STREAMS",
    "CommSchedule",
    "ScheduledCall",
    "SchedulerPolicy",
    "call_priority",
    "chunk_elements_for",
    "gradient_busy",
    "plan_fifo",
    "plan_priority",
]


@dataclass(frozen=True)
class SchedulerPolicy:
    """Who orders a factor step's traffic (a strategy axis).

    Attributes:
        name: A value of :data:`COMM_SCHEDULERS`.
        orders_traffic: One dispatcher on a group of its own issues DDP's gradient buckets
            and the pipelined factor buckets in this module's order (``"priority"``);
            otherwise each has a group of its own and its own order (``"fifo"``).
    """

    name: str
    orders_traffic: bool


#: Gradient and factor buckets on separate groups, each in its own order.
FIFO = SchedulerPolicy("fifo", orders_traffic=False)
#: One group, one order: gradients preempt factors chunk by chunk (PACE).
PRIORITY = SchedulerPolicy("priority", orders_traffic=True)
#: Scheduler policy by ``comm_scheduler`` value.
SCHEDULER_POLICIES: Mapping[str, SchedulerPolicy] = MappingProxyType(
    {policy.name: policy for policy in (FIFO, PRIORITY)}
)
#: The ``comm_scheduler`` option's values: ``"fifo"`` (gradient and factor buckets on
#: separate process groups, each in its own order, contending for the link) and
#: ``"priority"`` (one group, one order: this module's).
COMM_SCHEDULERS: tuple[str, ...] = tuple(SCHEDULER_POLICIES)

GRADIENTS = "gradients"
FACTORS = "factors"
#: The streams of a window, most urgent class first.
STREAMS: tuple[str, ...] = (GRADIENTS, FACTORS)

#: Chunks are sized so that the start-up time α is at most this share of a chunk's time.
STARTUP_SHARE = 0.1
#: No chunk is cut smaller than this (elements), whatever the model says.
MIN_CHUNK_ELEMENTS = 16 * 1024


@dataclass(frozen=True)
class ScheduledCall:
    """One collective of a window, as the planner sees it.

    Attributes:
        stream: :data:`GRADIENTS` or :data:`FACTORS`.
        index: Position within its stream in the window (the order the stream hands calls
            to the scheduler, identical on every rank).
        elements: Elements it moves.
        ready: Predicted seconds after the window's start at which its data is ready.
    """

    stream: str
    index: int
    elements: int
    ready: float

    def __post_init__(self) -> None:
        if self.stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {self.stream!r}")
        if self.index < 0 or self.elements < 0:
            raise ValueError("a call's index and elements must be >= 0")


def call_priority(call: ScheduledCall, count: int) -> tuple[int, int]:
    """The rule of the module docstring: smaller is more urgent.

    Args:
        call: The call.
        count: Calls of its stream in the window.
    """
    if call.stream == GRADIENTS:
        return (0, count - 1 - call.index)  # DDP's last bucket holds the first layers
    return (1, call.index)


def chunk_elements_for(
    model: AlphaBetaModel, bytes_per_element: int, *, startup_share: float = STARTUP_SHARE
) -> int:
    """Chunk size (elements) whose start-up time is ``startup_share`` of its transfer time.

    Larger chunks waste less start-up time, smaller ones let an urgent tensor in sooner
    (its worst wait is one chunk): ``α = share · (α + β·n·b)`` gives ``n``.
    """
    if not 0 < startup_share < 1:
        raise ValueError(f"startup_share must be in (0, 1), got {startup_share}")
    if model.beta <= 0:
        return 2**62  # no bandwidth cost: never cut
    elements = model.alpha * (1 - startup_share) / (startup_share * model.beta * bytes_per_element)
    return max(MIN_CHUNK_ELEMENTS, math.ceil(elements))


def chunk_count(elements: int, chunk_elements: int) -> int:
    """Chunks of a call (an empty call still issues one, empty, chunk)."""
    return max(1, -(-elements // chunk_elements))


@dataclass(frozen=True)
class CommSchedule:
    """The issue order of one window's chunks, identical on every rank.

    Attributes:
        policy: ``"priority"`` or ``"fifo"``.
        calls: The window's calls.
        chunk_elements: Elements per chunk (a call's last chunk holds the rest).
        order: ``(stream, call index, chunk index)`` in issue order.
        flush_before: Per gradient call index, the highest factor call index planned
            before its first chunk (-1: none): what a gradient bucket's hand-over launches.
        predicted_end: Predicted seconds from the window's start to its last chunk's end.
    """

    policy: str
    calls: tuple[ScheduledCall, ...]
    chunk_elements: int
    order: tuple[tuple[str, int, int], ...]
    predicted_end: float

    def __post_init__(self) -> None:
        # Per stream, elements by call index: read on every call and chunk at run time.
        by_stream = {
            stream: tuple(
                c.elements
                for c in sorted(
                    (c for c in self.calls if c.stream == stream), key=lambda c: c.index
                )
            )
            for stream in STREAMS
        }
        object.__setattr__(self, "_sizes", by_stream)

    def sizes(self, stream: str) -> tuple[int, ...]:
        """Elements of each call of ``stream``, by index."""
        sizes: dict[str, tuple[int, ...]] = getattr(self, "_sizes")  # noqa: B009
        return sizes[stream]

    def describe(self) -> str:
        """One line for logs and reports."""
        counts = ", ".join(f"{s} {len(self.sizes(s))}" for s in STREAMS)
        return (
            f"{self.policy} schedule: calls ({counts}) in {len(self.order)} chunks of up to "
            f"{self.chunk_elements} elements; predicted {self.predicted_end * 1e3:.1f} ms"
        )


def _check_calls(calls: Sequence[ScheduledCall]) -> None:
    for stream in STREAMS:
        indices = sorted(c.index for c in calls if c.stream == stream)
        if indices != list(range(len(indices))):
            raise ValueError(f"the {stream} calls must be numbered 0..n-1, got {indices}")


def _list_schedule(
    calls: Sequence[ScheduledCall],
    model: AlphaBetaModel,
    bytes_per_element: int,
    chunk_elements: int,
) -> list[tuple[str, int, int, float, float]]:
    """:func:`plan_priority`'s list scheduling: ``(stream, call, chunk, start, end)`` of
    every chunk in issue order."""
    _check_calls(calls)
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    counts = {s: sum(1 for c in calls if c.stream == s) for s in STREAMS}
    key = {
        (c.stream, c.index): (*call_priority(c, counts[c.stream]), c.ready, STREAMS.index(c.stream))
        for c in calls
    }
    left = {(c.stream, c.index): chunk_count(c.elements, chunk_elements) for c in calls}
    done = {(c.stream, c.index): 0 for c in calls}
    by_id = {(c.stream, c.index): c for c in calls}
    now = 0.0
    spans: list[tuple[str, int, int, float, float]] = []
    while any(left.values()):
        ready = [i for i, n in left.items() if n and by_id[i].ready <= now]
        if not ready:
            now = min(by_id[i].ready for i, n in left.items() if n)
            continue
        chosen = min(ready, key=key.__getitem__)
        chunk = done[chosen]
        size = min(chunk_elements, by_id[chosen].elements - chunk * chunk_elements)
        start, now = now, now + model.predict(max(0, size) * bytes_per_element)
        spans.append((chosen[0], chosen[1], chunk, start, now))
        done[chosen] += 1
        left[chosen] -= 1
    return spans


def plan_priority(
    calls: Sequence[ScheduledCall],
    model: AlphaBetaModel,
    *,
    bytes_per_element: int,
    chunk_elements: int,
) -> CommSchedule:
    """List scheduling of the chunks by :func:`call_priority` on the α-β model.

    Whenever the link is free, the most urgent call whose data is predicted ready sends its
    next chunk (a call's chunks go in order); when none is ready the link idles until the
    next one is. Ties go to the earlier-ready call, then to the stream order.
    """
    spans = _list_schedule(calls, model, bytes_per_element, chunk_elements)
    order = tuple((stream, index, chunk) for stream, index, chunk, _, _ in spans)
    end = spans[-1][4] if spans else 0.0
    return CommSchedule("priority", tuple(calls), chunk_elements, order, end)


def gradient_busy(
    calls: Sequence[ScheduledCall],
    model: AlphaBetaModel,
    *,
    bytes_per_element: int,
    chunk_elements: int,
) -> tuple[tuple[float, float], ...]:
    """The link intervals the gradient calls of a window hold under :func:`plan_priority`
    (merged where they touch): gradients are the most urgent class, so factor buckets
    get the link only outside them. What the ``dp`` fusion policy plans around
    (:func:`spdkfac.planning.merge.merge_dp`)."""
    gradients = [c for c in calls if c.stream == GRADIENTS]
    busy: list[tuple[float, float]] = []
    for *_, start, end in _list_schedule(gradients, model, bytes_per_element, chunk_elements):
        if busy and start <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], end))
        else:
            busy.append((start, end))
    return tuple(busy)


def plan_fifo(
    calls: Sequence[ScheduledCall], model: AlphaBetaModel, *, bytes_per_element: int
) -> CommSchedule:
    """The baseline on one shared link: whole calls in the order they are ready."""
    _check_calls(calls)
    now = 0.0
    order: list[tuple[str, int, int]] = []
    for call in sorted(calls, key=lambda c: (c.ready, STREAMS.index(c.stream), c.index)):
        now = max(now, call.ready) + model.predict(call.elements * bytes_per_element)
        order.append((call.stream, call.index, 0))
    largest = max((c.elements for c in calls), default=1)
    return CommSchedule("fifo", tuple(calls), max(1, largest), tuple(order), now)
