"""When ``spdkfac train`` evaluates, and the clock that leaves evaluations out.

:class:`EvalSchedule` says after which optimizer steps the run scores its model: at the
end of every epoch (the default), every ``--eval-every N`` steps, or ``--evals-per-epoch
K`` times per epoch, evenly spaced (the last at the epoch's end); and always after the
last step. It depends only on the step, so a resumed run evaluates where an uninterrupted
one does. :class:`TrainClock` measures training wall time with evaluations and
checkpoints paused out of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from spdkfac.training.config import TrainConfig

__all__ = ["EvalSchedule", "TrainClock"]


@dataclass(frozen=True)
class EvalSchedule:
    """The steps after which a run evaluates.

    Attributes:
        steps_per_epoch: Optimizer steps of one epoch (on this world size).
        total_steps: The run's last step (``--epochs`` or ``--max-steps``).
        every: Evaluate every ``every`` steps (``--eval-every``), or None.
        per_epoch: Otherwise, evaluations per epoch, evenly spaced (``--evals-per-epoch``,
            1 by default: at the epoch's end).
    """

    steps_per_epoch: int
    total_steps: int
    every: int | None = None
    per_epoch: int = 1

    @classmethod
    def from_config(
        cls, config: TrainConfig, *, steps_per_epoch: int, total_steps: int
    ) -> EvalSchedule:
        """The schedule ``config`` asks for."""
        return cls(
            steps_per_epoch=steps_per_epoch,
            total_steps=total_steps,
            every=config.eval_every,
            per_epoch=config.evals_per_epoch or 1,
        )

    def scheduled(self, step: int) -> bool:
        """Whether the schedule itself (not the end of the run) evaluates after ``step``."""
        if step < 1:
            return False
        if self.every is not None:
            return step % self.every == 0
        # Position 1..steps_per_epoch within its epoch; evaluation i of the epoch falls
        # after position ceil(i * steps_per_epoch / per_epoch).
        position = (step - 1) % self.steps_per_epoch + 1
        before = (position - 1) * self.per_epoch // self.steps_per_epoch
        return position * self.per_epoch // self.steps_per_epoch > before

    def due(self, step: int) -> bool:
        """Whether the run evaluates after ``step``: on the schedule or at the end."""
        return step >= self.total_steps or self.scheduled(step)


class TrainClock:
    """Training wall time: runs from :meth:`start`, leaves out :meth:`paused` sections.

    Args:
        elapsed: Seconds already trained (a resumed run's checkpointed time).
    """

    def __init__(self, elapsed: float = 0.0) -> None:
        self._elapsed = elapsed
        self._since: float | None = None

    def start(self) -> None:
        """Start (or keep) counting."""
        if self._since is None:
            self._since = time.perf_counter()

    def stop(self) -> None:
        """Stop counting, adding the time since :meth:`start`."""
        if self._since is not None:
            self._elapsed += time.perf_counter() - self._since
            self._since = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time inside the ``with`` block out (evaluation, checkpoints)."""
        running = self._since is not None
        self.stop()
        try:
            yield
        finally:
            if running:
                self.start()

    @property
    def seconds(self) -> float:
        """Seconds counted so far, including the running stretch."""
        running = 0.0 if self._since is None else time.perf_counter() - self._since
        return self._elapsed + running
