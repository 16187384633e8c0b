"""Small shared types: factor kinds, hyperparameter schedules, skip entries, option names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import nn

__all__ = [
    "FactorExchangeName",
    "FactorKind",
    "FloatSchedule",
    "IntSchedule",
    "NormalizationMode",
    "PlacementName",
    "SkipEntry",
    "StrategyName",
    "WeightSharing",
]

#: Which Kronecker factor of a layer: ``A`` (inputs) or ``G`` (output gradients).
FactorKind = Literal["A", "G"]
#: A hyperparameter given as a value or as a function of the step counter.
FloatSchedule = float | Callable[[int], float]
#: A refresh interval given as a value or as a function of the step counter.
IntSchedule = int | Callable[[int], int]
#: A module name (its children included) or an ``nn.Module`` type to leave alone.
SkipEntry = str | type[nn.Module]

#: Names ``strategy=`` accepts (rows of :data:`spdkfac.strategies.STRATEGIES` that are
#: algorithms, the ablations being reached with the overrides below; or ``"auto"``).
StrategyName = Literal["d-kfac", "mpd-kfac", "spd-kfac", "osawa", "layer-paths", "auto"]
#: Fusion policies (:data:`spdkfac.planning.fusion.FUSION_POLICIES`).
FactorExchangeName = Literal["after-backward", "layerwise", "threshold", "optimal", "dp"]
#: Communication schedulers (:data:`spdkfac.planning.schedule.COMM_SCHEDULERS`).
CommSchedulerName = Literal["fifo", "priority"]
#: Placement policies (:data:`spdkfac.planning.placement.PLACEMENT_POLICIES`).
PlacementName = Literal["replicated", "round-robin", "balanced", "layer-owners"]
#: Curvature of normalization layers' scale and shift (Osawa et al. 2019).
NormalizationMode = Literal["diagonal", "unit-wise"]
#: How a layer applied at many positions of each example (a sequence, an image) is
#: factored (Eschenhagen et al., NeurIPS 2023, Sec. 3): ``"expand"`` treats every position
#: as an example, ``"reduce"`` sums the output gradients and averages the inputs over the
#: positions first.
WeightSharing = Literal["expand", "reduce"]
