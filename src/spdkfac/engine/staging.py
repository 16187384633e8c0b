"""Stateful forms' moments staged for one step: a skipped step leaves no trace in them.

Eigen-Adam and Adam grafting update their moments while they precondition, which the
owner strategies do before every rank has agreed that the step is usable (the skip flag
travels in the KL clip's all-reduce, after preconditioning), and which any strategy does
before a non-finite KL-clip sum is seen. :func:`apply_staged` copies the moments of the
blocks this rank preconditions before the final stage runs and puts the copies back when
the step is skipped, so a non-finite value on any rank never reaches them, under every
strategy and layout. Factors never absorb a skipped step (the factor exchange agrees
first); inverses are recomputed only from those factors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from spdkfac.curvature import CurvatureBlock
from spdkfac.engine.final import FinalStage
from spdkfac.forms import Moments

__all__ = ["apply_staged", "stage_moments"]


def stage_moments(blocks: Sequence[CurvatureBlock]) -> list[tuple[CurvatureBlock, Moments]]:
    """Copies of the moments of ``blocks`` that have a stateful form."""
    saved = []
    for block in blocks:
        moments: Moments | None = getattr(block, "moments", None)
        if moments:
            copy = {k: None if v is None else v.clone() for k, v in moments.items()}
            saved.append((block, copy))
    return saved


def apply_staged(
    final: FinalStage,
    gradients: Mapping[str, Tensor],
    rates: Mapping[str, float],
    kl_clip: float | None,
    usable: bool,
) -> bool:
    """``final.apply(...)``; when it skips the step, every moment it moved is restored."""
    staged = stage_moments(final.held())
    if final.apply(gradients, rates, kl_clip, usable):
        return True
    for block, moments in staged:
        setattr(block, "moments", moments)  # noqa: B010 (not every block type has moments)
    return False
