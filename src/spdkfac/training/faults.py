"""Fault injection for ``spdkfac train``, a testing aid driven by ``SPDKFAC_FAULT``.

The variable holds comma-separated items ``ACTION@STEP`` or ``ACTION@STEP:rankR`` (no
rank: every rank). ``STEP`` is the number of optimizer steps already completed, so
``kill@7:rank1`` fires on rank 1 during its eighth step. Actions:

* ``kill``: SIGKILL this process after the backward pass, on the first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted worker runs through.
* ``raise``: raise ``RuntimeError`` at the same point, on the first attempt only.
* ``stall``: sleep ``SPDKFAC_FAULT_STALL_SECONDS`` (default 600) at the same point, before
  the K-FAC step and its factor all-reduce, on the first attempt only.
* ``nan``: replace the step's input batch by NaNs, on every attempt (a function of the
  step, so a resumed run replays it exactly as the uninterrupted one did).

Unset or empty, nothing is injected. It exists for the reliability tests and
``benchmarks/perf/soak.py``; it is never needed in production.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FAULT_ACTIONS", "Fault", "FaultPlan"]

FAULT_ACTIONS: tuple[str, ...] = ("kill", "raise", "stall", "nan")
_ITEM = re.compile(r"^(?P<action>[a-z]+)@(?P<step>\d+)(?::rank(?P<rank>\d+))?$")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``action`` at ``step`` on ``rank`` (None: every rank)."""

    action: str
    step: int
    rank: int | None = None

    def applies(self, step: int, rank: int) -> bool:
        """Whether this fault fires at ``step`` on ``rank``."""
        return self.step == step and self.rank in (None, rank)


class FaultPlan:
    """The faults to inject into one worker.

    Args:
        faults: What to inject.
        first_attempt: Whether this is the first attempt of the worker group (``kill``,
            ``raise`` and ``stall`` fire only then).
        stall_seconds: How long ``stall`` sleeps.
    """

    def __init__(
        self,
        faults: tuple[Fault, ...] = (),
        *,
        first_attempt: bool = True,
        stall_seconds: float = 600.0,
    ) -> None:
        self.faults = faults
        self.first_attempt = first_attempt
        self.stall_seconds = float(stall_seconds)

    @classmethod
    def parse(cls, text: str) -> tuple[Fault, ...]:
        """The faults of a ``SPDKFAC_FAULT`` value.

        Raises:
            ValueError: Naming the item that is not ``ACTION@STEP[:rankR]``.
        """
        faults = []
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            match = _ITEM.match(item)
            if match is None or match["action"] not in FAULT_ACTIONS:
                raise ValueError(
                    f"SPDKFAC_FAULT: {item!r} is not ACTION@STEP[:rankR] with ACTION one "
                    f"of {FAULT_ACTIONS}"
                )
            rank = None if match["rank"] is None else int(match["rank"])
            faults.append(Fault(match["action"], int(match["step"]), rank))
        return tuple(faults)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan:
        """The plan described by ``SPDKFAC_FAULT`` (empty when it is unset)."""
        env = os.environ if environ is None else environ
        restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        return cls(
            cls.parse(env.get("SPDKFAC_FAULT", "")),
            first_attempt=int(restarts) == 0,
            stall_seconds=float(env.get("SPDKFAC_FAULT_STALL_SECONDS", "600")),
        )

    def _fires(self, action: str, step: int, rank: int) -> bool:
        return any(f.action == action and f.applies(step, rank) for f in self.faults)

    def poison_batch(self, images: Tensor, step: int, rank: int) -> Tensor:
        """``images``, or NaNs of the same shape when a ``nan`` fault fires here."""
        if self.faults and self._fires("nan", step, rank):
            return torch.full_like(images, float("nan"))
        return images

    def before_update(self, step: int, rank: int) -> None:
        """Kill, raise or stall here (after backward, before the K-FAC step) when due."""
        if not (self.faults and self.first_attempt):
            return
        if self._fires("stall", step, rank):
            time.sleep(self.stall_seconds)
        if self._fires("raise", step, rank):
            raise RuntimeError(f"SPDKFAC_FAULT: injected failure at step {step} on rank {rank}")
        if self._fires("kill", step, rank):
            os.kill(os.getpid(), signal.SIGKILL)
