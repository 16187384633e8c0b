"""A hand-made window of two layers for the priority scheduler's tests (pure and
distributed)."""

from __future__ import annotations

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.schedule import FACTORS, GRADIENTS, ScheduledCall

__all__ = ["EXPECTED", "HAND_MADE", "ONE_MS"]

#: Every chunk takes 1 ms whatever its size: the order is the rule's alone.
ONE_MS = AlphaBetaModel(alpha=1e-3, beta=0.0)

#: Two layers: A factors (12 elements) ready first, the last layer's gradient bucket (6)
#: at 1 ms, the G factors (7) at 2 ms, the first layer's gradient bucket (5) at 3 ms.
HAND_MADE = (
    ScheduledCall(FACTORS, 0, 12, 0.0),
    ScheduledCall(GRADIENTS, 0, 6, 1e-3),
    ScheduledCall(FACTORS, 1, 7, 2e-3),
    ScheduledCall(GRADIENTS, 1, 5, 3e-3),
)
#: What the rule prescribes with chunks of 4 elements: the factor chunk in flight
#: finishes, then gradients go first (the first layers' bucket before the last's once
#: both wait), then the factors' remaining chunks in plan order.
EXPECTED = (
    (FACTORS, 0, 0),
    (GRADIENTS, 0, 0),
    (GRADIENTS, 0, 1),
    (GRADIENTS, 1, 0),
    (GRADIENTS, 1, 1),
    (FACTORS, 0, 1),
    (FACTORS, 0, 2),
    (FACTORS, 1, 0),
    (FACTORS, 1, 1),
)
