"""Curvature blocks (one protocol; Kronecker and normalization blocks), their state, layer
discovery and the factor collector (capture + folding)."""

from __future__ import annotations

from spdkfac.curvature.block import Contribution, CurvatureBlock, Slot
from spdkfac.curvature.capture import ActivationCapture
from spdkfac.curvature.collector import FactorCollector
from spdkfac.curvature.discovery import (
    discover_batchnorm_layers,
    discover_blocks,
    discover_layers,
    unwrap_model,
)
from spdkfac.curvature.kronecker import KroneckerBlock
from spdkfac.curvature.normalization import NormalizationBlock
from spdkfac.curvature.state import (
    FactorAccumulator,
    blocks_state_dict,
    load_blocks_state,
    running_average,
)

__all__ = [
    "ActivationCapture",
    "Contribution",
    "CurvatureBlock",
    "FactorAccumulator",
    "FactorCollector",
    "KroneckerBlock",
    "NormalizationBlock",
    "Slot",
    "blocks_state_dict",
    "discover_batchnorm_layers",
    "discover_blocks",
    "discover_layers",
    "load_blocks_state",
    "running_average",
    "unwrap_model",
]
