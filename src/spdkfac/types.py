"""Small shared types: factor kinds, hyperparameter schedules, skip entries, option names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import nn

__all__ = [
    "FactorKind",
    "FloatSchedule",
    "IntSchedule",
    "SkipEntry",
]

#: Which Kronecker factor of a layer: ``A`` (inputs) or ``G`` (output gradients).
FactorKind = Literal["A", "G"]
#: A hyperparameter given as a value or as a function of the step counter.
FloatSchedule = float | Callable[[int], float]
#: A refresh interval given as a value or as a function of the step counter.
IntSchedule = int | Callable[[int], int]
#: A module name (its children included) or an ``nn.Module`` type to leave alone.
SkipEntry = str | type[nn.Module]
