"""What :class:`~spdkfac.comm.scheduler.CommScheduler` keeps per window and per call.

A *window* is one factor step's backward pass (:mod:`spdkfac.planning.schedule`): the calls the
gradient and factor streams hand over during it, how many each stream may still hand over,
and the readiness times recorded for planning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch import Tensor
from torch.futures import Future

from spdkfac.planning.schedule import FACTORS, GRADIENTS, STREAMS, CommSchedule

__all__ = ["Call", "Window"]


@dataclass
class Call:
    """One submitted collective: its chunks, and the future the stream waits on."""

    segments: list[tuple[Tensor, int | None]]  # (flat piece, owner rank or None: all-reduce)
    result: Tensor
    chunks: list[tuple[Tensor, int | None]] = field(default_factory=list)
    future: Future[Tensor] = field(default_factory=Future)
    left: int = 0
    completed: bool = False

    def cut(self, chunk_elements: int) -> None:
        """Cut every segment into chunks of at most ``chunk_elements`` (one if empty)."""
        for piece, owner in self.segments:
            for start in range(0, max(1, piece.numel()), chunk_elements):
                self.chunks.append((piece[start : start + chunk_elements], owner))
        self.left = len(self.chunks)


class Window:
    """One window: its schedule (None: unplanned), calls and recorded readiness times."""

    def __init__(self, schedule: CommSchedule | None, factor_calls: int) -> None:
        self.schedule = schedule
        # The factor stream's calls after its buckets (weights, flags) are never ordered.
        self.limit = {GRADIENTS: 2**62, FACTORS: factor_calls}
        self.start = time.perf_counter()
        self.counts = dict.fromkeys(STREAMS, 0)
        self.calls: dict[tuple[str, int], Call] = {}
        self.record: list[tuple[str, int, int, float]] = []
        self.planned = {s: len(schedule.sizes(s)) if schedule else 0 for s in STREAMS}
