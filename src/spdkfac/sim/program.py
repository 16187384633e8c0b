"""What the engine runs: per-rank instructions, collectives, and what came out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spdkfac.profiling import Event
from spdkfac.sim.collectives import CollectiveOp

__all__ = [
    "Close",
    "Collective",
    "Compute",
    "Instruction",
    "Issue",
    "Open",
    "Program",
    "SimulationResult",
    "Wait",
]


@dataclass(frozen=True)
class Compute:
    """Busy the rank's compute stream for ``seconds``; a ``name`` records an event."""

    seconds: float
    name: str | None = None


@dataclass(frozen=True)
class Open:
    """Start the span ``name`` (closed by the matching :class:`Close`)."""

    name: str


@dataclass(frozen=True)
class Close:
    """End the innermost open span called ``name``."""

    name: str


@dataclass(frozen=True)
class Issue:
    """Post collective ``collective`` (an index into the collectives list); never blocks."""

    collective: int


@dataclass(frozen=True)
class Wait:
    """Block until every collective in ``collectives`` completed; a ``name`` records the wait."""

    collectives: tuple[int, ...]
    name: str | None = None


Instruction = Compute | Open | Close | Issue | Wait
Program = Sequence[Instruction]


@dataclass(frozen=True)
class Collective:
    """One collective operation.

    Attributes:
        label: For traces and debugging (``"factor bucket 3"``).
        channel: Process group; collectives of one channel never overlap on a rank.
        participants: Ranks taking part.
        alpha: Start-up seconds (no bandwidth used).
        work: Transfer seconds at the full link rate (β·bytes).
        overlap: This collective's own ``overlap`` (None: the engine's; see
            :func:`~spdkfac.sim.engine.simulate`).
        contention: This collective's own ``contention`` (None: the engine's).
        op: The operation it stands for (None: unspecified; the engine does not read it).
        nbytes: Bytes of its whole buffer (for byte counts; the engine reads ``work``).
    """

    label: str
    channel: str
    participants: tuple[int, ...]
    alpha: float
    work: float
    overlap: float | None = None
    contention: float | None = None
    op: CollectiveOp | None = None
    nbytes: float = 0.0


@dataclass
class SimulationResult:
    """What happened.

    Attributes:
        events: Spans, computes and waits as :class:`~spdkfac.profiling.Event` s.
        finish: Per rank, when its program ended.
        starts: Per collective, when it started (None: never started).
        ends: Per collective, when it completed (None: never completed).
    """

    events: list[Event]
    finish: list[float]
    starts: list[float | None]
    ends: list[float | None]

    @property
    def makespan(self) -> float:
        """When the last rank finished."""
        return max(self.finish, default=0.0)
