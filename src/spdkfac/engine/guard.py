"""Checks on how the user drives the step: the guard against preconditioning the same
gradient twice, and the warning about registered layers no pass reached."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import Tensor, nn

from spdkfac.curvature import CurvatureBlock

__all__ = ["GradientGuard", "warn_uncaptured"]


def warn_uncaptured(blocks: Sequence[CurvatureBlock]) -> None:
    """Name the registered blocks whose factors are still empty after a factor step."""
    empty = [
        block.name
        for block in blocks
        if all(
            value is None for key, value in block.stored().items() if not key.endswith("inverse")
        )
    ]
    if empty:
        warnings.warn(
            f"spdkfac: no factors were captured for {empty} on the first factor step: "
            "they keep their plain gradient until a training-mode forward and backward "
            "pass reaches them through their forward()",
            RuntimeWarning,
            stacklevel=5,
        )


def _signature(tensor: Tensor | None) -> tuple[int, int] | None:
    return None if tensor is None else (id(tensor), tensor._version)


class GradientGuard:
    """Tells whether the gradients changed since the last preconditioning.

    A backward pass accumulates into ``.grad`` in place (its version counter moves) or
    creates it (after ``zero_grad(set_to_none=True)``); :meth:`record` notes every
    registered weight's gradient tensor and version after the step wrote it back, and
    :meth:`unchanged` is True when none of them moved since — a second ``step()`` without a
    new backward, which would precondition the preconditioned gradient again.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._weights = [m.weight for m in modules if isinstance(m.weight, Tensor)]
        self._recorded: list[tuple[int, int] | None] | None = None

    def record(self) -> None:
        """Note the gradients as the step left them."""
        self._recorded = [_signature(w.grad) for w in self._weights]

    def unchanged(self) -> bool:
        """Whether no gradient changed since :meth:`record` (False before the first)."""
        if self._recorded is None:
            return False
        current = [_signature(w.grad) for w in self._weights]
        return current == self._recorded and any(s is not None for s in current)
