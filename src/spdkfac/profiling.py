"""Spans per phase and layer (``kfac/<phase>/<layer>``), the paper's breakdown, Chrome traces.

The profiler is off by default: :meth:`Profiler.span` then returns one shared no-op context
manager, so instrumented code pays a method call and nothing else. When on, a span records
the host clock on CPU; on CUDA it records CUDA events on the current stream and converts
them to host time when :meth:`Profiler.events` resolves them (after a synchronize), so
asynchronous kernels are timed where they run, never by a bare clock around a launch.
An enabled span also enters ``torch.profiler.record_function`` under its name, so the
phases show in ``torch.profiler`` (Kineto) traces next to the kernels they launched.

Phases are the members of :class:`Phase`, shared by the real code and the simulator.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from spdkfac.support.checks import check_choice
from spdkfac.support.jsonio import write_json

__all__ = [
    "BREAKDOWN_CATEGORIES",
    "PHASES",
    "Event",
    "Phase",
    "Profiler",
    "breakdown",
    "chrome_trace",
    "events_from_json",
    "events_to_json",
    "phase_of",
    "span_name",
    "write_chrome_trace",
]


class Phase(str, Enum):
    """The ``<phase>`` of a span name ``kfac/<phase>/<layer>``.

    A ``str`` enum: a member equals, hashes and formats as its value, so ``"step"`` and
    ``Phase.STEP`` are interchangeable as arguments and as dictionary keys.
    """

    #: The forward and backward passes (factor hooks run inside).
    FORWARD_BACKWARD = "forward_backward"
    #: Waiting for the data-parallel gradient all-reduce.
    GRAD_COMM = "grad_comm"
    #: Factor products in the hooks; the running average of the factors.
    FACTOR_COMPUTE = "factor_compute"
    #: Waiting for the factor all-reduce; unpacking the reduced factors.
    FACTOR_COMM = "factor_comm"
    #: Damped inverses; packing them for their broadcast.
    INVERSE_COMPUTE = "inverse_compute"
    #: Waiting for the inverse broadcasts and the failure-flag all-reduce.
    INVERSE_COMM = "inverse_comm"
    #: Preconditioning the gradients; the KL clip.
    PRECONDITION = "precondition"
    #: Waiting for the one-element skip-flag all-reduce of a step without factor update
    #: (counted as ``Other``, where the step's time went before it had a span).
    FLAG_COMM = "flag_comm"
    #: The whole preconditioner step.
    STEP = "step"
    #: One whole training iteration.
    ITERATION = "iteration"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


#: Phase → breakdown category (the SPD-KFAC paper's Fig. 9 bars).
PHASES: dict[str, str] = {
    Phase.FORWARD_BACKWARD: "FF&BP",
    Phase.GRAD_COMM: "GradComm",
    Phase.FACTOR_COMPUTE: "FactorComp",
    Phase.FACTOR_COMM: "FactorComm",
    Phase.INVERSE_COMPUTE: "InverseComp",
    Phase.INVERSE_COMM: "InverseComm",
    Phase.PRECONDITION: "Precondition",
    Phase.FLAG_COMM: "Other",
    Phase.ITERATION: "Other",
    Phase.STEP: "Other",
}
BREAKDOWN_CATEGORIES: tuple[str, ...] = (
    "FF&BP",
    "GradComm",
    "FactorComp",
    "FactorComm",
    "InverseComp",
    "InverseComm",
    "Precondition",
    "Other",
)
# When spans overlap on one rank, a moment belongs to the most specific active phase:
# waits on collectives first, then K-FAC work, then the forward/backward that contains
# the hooks, then the iteration itself.
_PRIORITY: dict[str, int] = {
    Phase.FACTOR_COMM: 0,
    Phase.INVERSE_COMM: 0,
    Phase.GRAD_COMM: 0,
    Phase.FLAG_COMM: 0,
    Phase.FACTOR_COMPUTE: 1,
    Phase.INVERSE_COMPUTE: 1,
    Phase.PRECONDITION: 1,
    Phase.FORWARD_BACKWARD: 2,
    Phase.STEP: 3,
    Phase.ITERATION: 4,
}
_BY_VALUE: dict[str, Phase] = {phase.value: phase for phase in Phase}


def span_name(phase: Phase | str, layer: str = "all") -> str:
    """``kfac/<phase>/<layer>``, the one naming scheme of spans, traces and the simulator.

    Args:
        phase: A :class:`Phase` or its value (``"precondition"``).
        layer: What the span covers: a layer, a factor key (``fc/A``) or a piece
            (``wait``); ``all`` for a whole phase.

    Raises:
        ValueError: For a phase that is not a :class:`Phase`.
    """
    check_choice("phase", phase, _BY_VALUE)
    return f"kfac/{_BY_VALUE[phase].value}/{layer}"


def phase_of(name: str) -> str:
    """The ``<phase>`` part of a span name."""
    parts = name.split("/", 2)
    if len(parts) < 2 or parts[0] != "kfac":
        raise ValueError(f"span name must look like kfac/<phase>/<layer>, got {name!r}")
    return parts[1]


@dataclass(frozen=True)
class Event:
    """One timed span on one rank; times in seconds on the rank's wall clock."""

    name: str
    rank: int
    start: float
    duration: float

    @property
    def end(self) -> float:
        """``start + duration``."""
        return self.start + self.duration

    @property
    def phase(self) -> str:
        """The span's phase (see :data:`PHASES`)."""
        return phase_of(self.name)


class _CudaSpan:
    __slots__ = ("begin", "finish", "name")

    def __init__(self, name: str, begin: Any, finish: Any) -> None:
        self.name, self.begin, self.finish = name, begin, finish


class Profiler:
    """Collects :class:`Event` spans for one rank.

    Args:
        enabled: Record spans (default off: near-zero overhead).
        rank: Rank stamped on every event.
        device: Where the timed work runs; CUDA devices are timed with CUDA events.
    """

    def __init__(
        self, *, enabled: bool = False, rank: int = 0, device: torch.device | None = None
    ) -> None:
        self.enabled = enabled
        self.rank = rank
        self._cuda = device is not None and device.type == "cuda"
        # perf_counter is monotonic but has a per-process origin; the offset puts every
        # rank of one host on the shared wall clock for a single timeline.
        self._wall_offset = time.time() - time.perf_counter()
        self._events: list[Event] = []
        self._cuda_spans: list[_CudaSpan] = []
        self._cuda_origin: tuple[Any, float] | None = None
        self._noop = contextlib.nullcontext()

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time the ``with`` block as an event called ``name`` (``kfac/<phase>/<layer>``).

        When enabled, the block is also a ``torch.profiler.record_function`` range of that
        name (visible to ``torch.profiler`` and Kineto traces).
        """
        if not self.enabled:
            return self._noop
        return self._cuda_span(name) if self._cuda else self._host_span(name)

    @contextlib.contextmanager
    def _host_span(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            start = time.perf_counter()
            try:
                yield
            finally:
                end = time.perf_counter()
                self._events.append(Event(name, self.rank, start + self._wall_offset, end - start))

    @contextlib.contextmanager
    def _cuda_span(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name), self._cuda_events(name):
            yield

    @contextlib.contextmanager
    def _cuda_events(self, name: str) -> Iterator[None]:
        if self._cuda_origin is None:
            torch.cuda.synchronize()
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            torch.cuda.synchronize()
            self._cuda_origin = (origin, time.time())
        begin = torch.cuda.Event(enable_timing=True)
        finish = torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            finish.record()
            self._cuda_spans.append(_CudaSpan(name, begin, finish))

    def record(self, name: str, start: float, end: float) -> None:
        """Add a span measured elsewhere (``time.perf_counter()`` values)."""
        if self.enabled:
            self._events.append(Event(name, self.rank, start + self._wall_offset, end - start))

    def events(self) -> list[Event]:
        """Every event so far, ordered by start (synchronizes CUDA to resolve its spans)."""
        if self._cuda_spans:
            torch.cuda.synchronize()
            assert self._cuda_origin is not None
            origin, origin_time = self._cuda_origin
            for span in self._cuda_spans:
                start = origin_time + origin.elapsed_time(span.begin) / 1000
                duration = span.begin.elapsed_time(span.finish) / 1000
                self._events.append(Event(span.name, self.rank, start, duration))
            self._cuda_spans.clear()
        return sorted(self._events, key=lambda event: event.start)

    def clear(self) -> None:
        """Forget every event."""
        self._events.clear()
        self._cuda_spans.clear()


def _rank_breakdown(events: Sequence[Event]) -> dict[str, float]:
    """Seconds per category on one rank; overlapping spans count once, innermost wins.

    A sweep over span boundaries: between two consecutive boundaries the set of active
    phases is constant, and the segment goes to the highest-priority one.
    """
    points: list[tuple[float, int, str]] = []
    for event in events:
        if event.phase in _PRIORITY and event.duration > 0:
            points.append((event.start, 1, event.phase))
            points.append((event.end, -1, event.phase))
    points.sort(key=lambda point: (point[0], point[1]))
    totals = dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0)
    active = dict.fromkeys(_PRIORITY, 0)
    previous: float | None = None
    for moment, change, phase in points:
        if previous is not None and moment > previous:
            running = [p for p, count in active.items() if count > 0]
            if running:
                winner = min(running, key=lambda p: _PRIORITY[p])
                totals[PHASES[winner]] += moment - previous
        active[phase] += change
        previous = moment
    return totals


def breakdown(events: Iterable[Event], iterations: int) -> dict[str, float]:
    """Per-iteration seconds in the paper's categories, averaged over ranks.

    Each moment of a rank's timeline is attributed once, to the most specific span active
    then (a wait on a collective inside a step counts as communication, factor work inside
    the forward pass as ``FactorComp``). Communication categories are therefore only the
    non-overlapped part: the time the rank waited.

    Raises:
        ValueError: When ``iterations`` < 1.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    by_rank: dict[int, list[Event]] = {}
    for event in events:
        by_rank.setdefault(event.rank, []).append(event)
    totals = dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0)
    for rank_events in by_rank.values():
        for category, seconds in _rank_breakdown(rank_events).items():
            totals[category] += seconds
    ranks = max(len(by_rank), 1)
    return {category: seconds / ranks / iterations for category, seconds in totals.items()}


def chrome_trace(
    events: Iterable[Event], *, labels: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """A Chrome-trace (Perfetto) document: one process per rank, one row per phase."""
    events = list(events)
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        label = (labels or {}).get(rank, f"rank {rank}")
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}})
    phases = sorted({e.phase for e in events})
    for event in events:
        trace.append(
            {
                "name": event.name,
                "cat": event.phase,
                "ph": "X",
                "ts": (event.start - origin) * 1e6,
                "dur": event.duration * 1e6,
                "pid": event.rank,
                "tid": phases.index(event.phase),
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | Path, events: Iterable[Event], *, labels: Mapping[int, str] | None = None
) -> Path:
    """Write :func:`chrome_trace` as JSON, atomically; open it in ui.perfetto.dev or
    chrome://tracing."""
    return write_json(path, chrome_trace(events, labels=labels), indent=None, allow_nan=True)


def events_to_json(events: Iterable[Event]) -> str:
    """Serialize events (for gathering across ranks or saving)."""
    return json.dumps([asdict(e) for e in events])


def events_from_json(text: str) -> list[Event]:
    """Inverse of :func:`events_to_json`."""
    return [Event(**item) for item in json.loads(text)]
