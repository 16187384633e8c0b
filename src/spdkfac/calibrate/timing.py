"""The time budget and timing helpers shared by the calibration measurements."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from spdkfac.comm import Communicator

__all__ = ["Budget", "median_seconds", "synchronize"]


@dataclass
class Budget:
    """A wall-clock allowance shared by the measurement loops.

    Loops measure their first item unconditionally (a fit needs data) and ask
    :meth:`allows` before each further one. With a communicator every rank gets the same
    answer (one tiny all-reduce per question), so ranks never disagree on which
    collectives to issue.

    Attributes:
        seconds: The allowance from creation.
        comm: Makes the decisions collective; None decides locally.
        notes: What was skipped, for the report (shared with :meth:`phase` children).
    """

    seconds: float
    comm: Communicator | None = None
    notes: list[str] = field(default_factory=list)
    _deadline: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Not checks.check_number: that refuses infinity, which here means "no limit".
        if not (self.seconds > 0):
            raise ValueError(f"max_seconds must be > 0, got {self.seconds!r}")
        self._deadline = time.perf_counter() + self.seconds

    def remaining(self) -> float:
        """Seconds left (negative when overrun)."""
        return self._deadline - time.perf_counter()

    def phase(self, fraction: float) -> Budget:
        """A child allowance of ``fraction`` of what is left, sharing comm and notes."""
        return Budget(max(self.remaining(), 1e-3) * fraction, self.comm, self.notes)

    def allows(self, predicted_seconds: float) -> bool:
        """Whether an item predicted to take ``predicted_seconds`` still fits (agreed)."""
        stop = predicted_seconds > self.remaining()
        if self.comm is not None and self.comm.world_size > 1:
            flag = torch.tensor([1.0 if stop else 0.0], device=self.comm.device)
            stop = bool(self.comm.all_reduce_max(flag).wait().item() > 0)
        return not stop

    def skip(self, what: str, items: Sequence[object], predicted_seconds: float) -> None:
        """Record that ``items`` of ``what`` were left out."""
        self.notes.append(
            f"time budget: skipped {what} {list(items)} (the next needs ~{predicted_seconds:.1f} s,"
            f" {max(self.remaining(), 0.0):.1f} s left); raise --max-seconds to include them"
        )


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a host clock measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median time of ``repeats`` calls after one warm-up; a warm-up slower than 0.2 s
    counts as a sample instead (large operations are not cache-sensitive, and repeating
    them would eat the budget)."""
    times: list[float] = []
    for index in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        elapsed = time.perf_counter() - start
        if index > 0 or elapsed > 0.2:
            times.append(elapsed)
        if len(times) >= repeats:
            break
    return statistics.median(times)
