"""Compute times taken from a profiled run of the real code (``profile=True`` spans).

:mod:`spdkfac.sim.measured` times ops and factor products one by one, outside a training
step. Inside a real step the same work runs slower: fresh allocations of large factors
fault in new pages, caches are cold after the backward pass, the Python of hooks and
``step()`` adds up. A profiled run of one strategy (``spdkfac bench`` writes one Chrome
trace per variant; ``KFACPreconditioner(profile=True)`` gives the same spans) measures
every piece where it really runs. :class:`ProfiledCompute` keeps, per iteration and
averaged over ranks:

* ``factor_compute/<layer>/<A|G>``: each hook, product, scaling and packing included;
* ``precondition/<layer>``, ``precondition/kl_clip``, ``factor_compute/running_average``;
* ``inverse_compute/<factor>``: each damped inverse (when the run inverted it);
* ``step/prologue``: from the start of ``step()`` to its first span (gradient and factor
  checks, ``mean()`` of every factor, launching the last buckets);
* ``iteration/tail``: from the end of ``step()`` to the end of the iteration (optimizer);
* ``factor_comm/unpack``: the exchange rebuilding the reduced factors (host work inside
  the factor wait; traces from before this span existed lack it);

and the forward/backward compute (``forward_backward`` less the spans inside it), which
scales every traced op so that their sum matches. The profiled bookkeeping pieces
(running average, KL clip, prologue, unpacking) against their models give
``Hardware.bookkeeping_scale`` for the pieces the trace did not time (the packing and
unpacking of broadcast inverses in a D-KFAC trace; unpacking factors in an old trace).
The ranks' speed spread is the relative difference of their mean compute per iteration;
the jitter is the relative standard deviation of one rank's compute from iteration to
iteration, apart from what all ranks share that iteration, which makes equally fast ranks
wait for each other at every collective.

The simulator then predicts other strategies, links and world sizes from the pieces.
Communication waits are never taken from the trace: they are what the simulator predicts.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from spdkfac.profiling import Event, Phase, phase_of, span_name
from spdkfac.sim.costs import WorkloadCosts, piece_name
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.workload import Op, TraceItem, Workload
from spdkfac.support.jsonio import read_json

__all__ = ["ProfiledCompute", "events_from_chrome_trace"]

_WAITS = frozenset({Phase.GRAD_COMM, Phase.FACTOR_COMM, Phase.INVERSE_COMM, Phase.FLAG_COMM})
_CONTAINERS = frozenset({Phase.ITERATION, Phase.STEP, Phase.FORWARD_BACKWARD})
#: Host work that runs inside a wait span.
_WORK_IN_WAITS = frozenset({span_name(Phase.FACTOR_COMM, "unpack")})
_ITERATION = span_name(Phase.ITERATION)
_STEP = span_name(Phase.STEP)
_FORWARD_BACKWARD = span_name(Phase.FORWARD_BACKWARD)


def events_from_chrome_trace(data: Mapping[str, Any] | Sequence[Any]) -> list[Event]:
    """The spans of a Chrome trace written by :func:`spdkfac.profiling.chrome_trace`
    (complete ``"X"`` events; ``pid`` is the rank, times in microseconds)."""
    items = data.get("traceEvents", []) if isinstance(data, Mapping) else data
    events = []
    for item in items:
        if not isinstance(item, Mapping) or item.get("ph") != "X":
            continue
        name = str(item.get("name", ""))
        if not name.startswith("kfac/"):
            continue
        events.append(
            Event(name, int(item["pid"]), float(item["ts"]) / 1e6, float(item["dur"]) / 1e6)
        )
    return sorted(events, key=lambda event: (event.rank, event.start))


def _inside(event: Event, outer: Event) -> bool:
    return event is not outer and outer.start <= event.start and event.end <= outer.end + 1e-7


def _relative_deviation(per_rank: Sequence[Sequence[float]]) -> float:
    """How much one rank's values vary independently of the other ranks', relative to the
    mean of all; capped below 0.5.

    With P ≥ 2 ranks and the same number of iterations each, iteration i's deviation of
    rank r from its own mean, less the ranks' average deviation that iteration (what all
    ranks share does not make them wait for each other), has variance σ²(1 − 1/P) when
    each rank varies independently with σ. One rank: the spread around its mean.
    """
    ranks = [list(values) for values in per_rank if values]
    overall = statistics.fmean(v for values in ranks for v in values) if ranks else 0.0
    if overall <= 0:
        return 0.0
    deviations = [[v - statistics.fmean(values) for v in values] for values in ranks]
    count = len(ranks)
    if count > 1 and len({len(values) for values in ranks}) == 1:
        shared = [statistics.fmean(column) for column in zip(*deviations, strict=True)]
        own = [d - s for row in deviations for d, s in zip(row, shared, strict=True)]
        variance = statistics.fmean(d * d for d in own) * count / (count - 1)
    else:
        variance = statistics.fmean(d * d for row in deviations for d in row)
    deviation: float = math.sqrt(variance)
    return min(deviation / overall, 0.49)


def _union(spans: Iterable[Event]) -> float:
    """Seconds covered by at least one of ``spans``."""
    total, reach = 0.0, float("-inf")
    for event in sorted(spans, key=lambda e: e.start):
        if event.end <= reach:
            continue
        total += event.end - max(event.start, reach)
        reach = event.end
    return total


@dataclass(frozen=True)
class ProfiledCompute:
    """Per-piece compute seconds of one model at one batch size, from a profiled run.

    Attributes:
        spans: Piece name (see the module docstring) → seconds per occurrence.
        forward_backward: Seconds per iteration of forward/backward compute.
        rank_spread: Relative difference of the ranks' compute (the simulator's
            ``Hardware.rank_spread``).
        jitter: Relative standard deviation of a rank's compute per iteration
            (``Hardware.jitter``).
        phase_jitter: The same per phase (``Hardware.phase_jitter``): the phases vary
            independently, so the waits at each collective follow the phase before it.
        source: Where it came from, for reports.
    """

    spans: Mapping[str, float]
    forward_backward: float
    rank_spread: float = 0.0
    jitter: float = 0.0
    phase_jitter: Mapping[str, float] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        spans = {str(k): float(v) for k, v in self.spans.items()}
        if any(not v >= 0 for v in spans.values()) or not self.forward_backward > 0:
            raise ValueError("profiled seconds must be >= 0 (forward_backward > 0)")
        object.__setattr__(self, "spans", MappingProxyType(spans))

    @classmethod
    def from_events(cls, events: Iterable[Event], *, source: str = "") -> ProfiledCompute:
        """Average the pieces over every iteration and rank of ``events``.

        Args:
            events: Spans of whole iterations (``kfac/iteration/all`` each), all ranks.

        Raises:
            ValueError: When there is no ``kfac/iteration/all`` span.
        """
        by_rank: dict[int, list[Event]] = defaultdict(list)
        for event in events:
            by_rank[event.rank].append(event)
        samples: dict[str, list[float]] = defaultdict(list)
        forward_backward: list[float] = []
        rank_compute: list[list[dict[str, float]]] = []
        for rank_events in by_rank.values():
            iterations = [e for e in rank_events if e.name == _ITERATION]
            computes = [
                cls._iteration(
                    iteration,
                    [e for e in rank_events if _inside(e, iteration)],
                    samples,
                    forward_backward,
                )
                for iteration in iterations
            ]
            if computes:
                rank_compute.append(computes)
        if not forward_backward:
            raise ValueError(f"{source or 'events'}: no kfac/iteration/all spans")
        spans = {name: statistics.fmean(values) for name, values in samples.items()}
        totals = [[sum(phases.values()) for phases in computes] for computes in rank_compute]
        means = [statistics.fmean(values) for values in totals]
        overall = statistics.fmean(means)
        spread = statistics.pstdev(means) / overall if len(means) > 1 and overall > 0 else 0.0
        phases = sorted({str(phase) for computes in rank_compute for p in computes for phase in p})
        return cls(
            spans=spans,
            forward_backward=statistics.fmean(forward_backward),
            rank_spread=min(spread, 0.49),
            jitter=_relative_deviation(totals),
            phase_jitter={
                phase: _relative_deviation(
                    [[p.get(phase, 0.0) for p in computes] for computes in rank_compute]
                )
                for phase in phases
            },
            source=source,
        )

    @staticmethod
    def _iteration(
        iteration: Event,
        inside: list[Event],
        samples: dict[str, list[float]],
        forward_backward: list[float],
    ) -> dict[str, float]:
        """Collect one iteration's pieces; returns its compute seconds by phase."""
        compute: dict[str, float] = defaultdict(float)
        for event in inside:
            phase = phase_of(event.name)
            if phase in _CONTAINERS or (phase in _WAITS and event.name not in _WORK_IN_WAITS):
                continue
            samples[event.name.split("/", 1)[1]].append(event.duration)
            compute[phase] += event.duration
        passes = [e for e in inside if e.name == _FORWARD_BACKWARD]
        for outer in passes:
            nested = [e for e in inside if _inside(e, outer)]
            forward_backward.append(outer.duration - _union(nested))
            compute[Phase.FORWARD_BACKWARD] += forward_backward[-1]
        step = next((e for e in inside if e.name == _STEP), None)
        if step is not None:
            children = [e for e in inside if _inside(e, step)]
            first = min((e.start for e in children), default=step.end)
            samples[piece_name(Phase.STEP, "prologue")].append(first - step.start)
            samples[piece_name(Phase.ITERATION, "tail")].append(iteration.end - step.end)
            compute[Phase.STEP] += first - step.start
            compute[Phase.ITERATION] += iteration.end - step.end
        return compute

    @classmethod
    def load(cls, path: str | Path) -> ProfiledCompute:
        """Read a Chrome trace (``spdkfac bench``'s ``traces/<variant>.json``)."""
        return cls.from_events(
            events_from_chrome_trace(read_json(path, "profiled trace")), source=str(path)
        )

    def apply(self, workload: Workload, hardware: Hardware) -> tuple[Workload, Hardware]:
        """``workload`` with its ops scaled to the profiled forward/backward time and
        ``hardware`` with the profiled pieces and rank spread.

        Raises:
            ValueError: When the profile's factor products are not those of the workload's
                layers (another model, or a run without K-FAC). The batch and input size
                cannot be checked: the trace does not record them.
        """
        wanted = {f"{layer.name}/{kind}" for layer in workload.layers for kind in ("A", "G")}
        prefix = piece_name(Phase.FACTOR_COMPUTE, "")
        profiled = {
            name.removeprefix(prefix)
            for name in self.spans
            if name.startswith(prefix) and name.endswith(("/A", "/G"))
        }
        for problem, keys in (
            ("has no factor_compute span of", sorted(wanted - profiled)),
            ("has factor_compute spans of layers it does not have:", sorted(profiled - wanted)),
        ):
            if keys:
                raise ValueError(
                    f"{self.source or 'profile'} {problem} {', '.join(keys[:4])}"
                    f"{' ...' if len(keys) > 4 else ''}: it is not a K-FAC run of "
                    f"{workload.model}"
                )
        ops = workload.ops()
        total = sum(hardware.device.op_seconds(op) for op in ops)
        scale = self.forward_backward / total if total > 0 else 1.0

        def scaled(items: tuple[TraceItem, ...]) -> tuple[TraceItem, ...]:
            return tuple(
                replace(item, seconds=hardware.device.op_seconds(item) * scale)
                if isinstance(item, Op)
                else item
                for item in items
            )

        scale_bookkeeping = self._bookkeeping_scale(WorkloadCosts(workload, hardware, 2))
        timed = replace(
            workload, forward=scaled(workload.forward), backward=scaled(workload.backward)
        )
        key = (workload.model, workload.batch_size, workload.input_shape)
        return timed, replace(
            hardware,
            spans=self.spans,
            spans_for=key,
            rank_spread=self.rank_spread,
            jitter=self.jitter,
            phase_jitter=self.phase_jitter,
            bookkeeping_scale=hardware.bookkeeping_scale * scale_bookkeeping,
        )

    def _bookkeeping_scale(self, costs: WorkloadCosts) -> float:
        """Profiled over modelled seconds of the bookkeeping pieces the profile has."""
        modelled = {
            piece_name(Phase.FACTOR_COMPUTE, "running_average"): costs.running_average(),
            piece_name(Phase.PRECONDITION, "kl_clip"): costs.kl_clip(),
            piece_name(Phase.STEP, "prologue"): costs.step_prologue(True),
            piece_name(Phase.FACTOR_COMM, "unpack"): costs.unpack_factors(),
        }
        profiled = sum(self.spans[name] for name in modelled if name in self.spans)
        model = sum(seconds for name, seconds in modelled.items() if name in self.spans)
        return profiled / model if profiled > 0 and model > 0 else 1.0
