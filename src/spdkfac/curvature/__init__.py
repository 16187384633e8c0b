"""Curvature blocks (one protocol; Kronecker, grouped-convolution and normalization
blocks), their state, layer discovery and the factor collector (capture + folding)."""

from __future__ import annotations

from spdkfac.curvature.block import (
    KRONECKER_SECTION,
    NORMALIZATION_SECTION,
    Contribution,
    CurvatureBlock,
    Slot,
    StateSection,
)
from spdkfac.curvature.capture import ActivationCapture
from spdkfac.curvature.collector import CollectorSettings, FactorCollector
from spdkfac.curvature.discovery import (
    BLOCK_RULES,
    BlockSettings,
    discover_batchnorm_layers,
    discover_blocks,
    discover_layers,
)
from spdkfac.curvature.grouped import GroupedConvBlock
from spdkfac.curvature.kronecker import DiagonalKroneckerBlock, KroneckerBlock
from spdkfac.curvature.normalization import NormalizationBlock
from spdkfac.curvature.state import (
    FactorAccumulator,
    blocks_memory,
    blocks_state_dict,
    load_blocks_state,
    running_average,
    without_inverses,
)

__all__ = [
    "BLOCK_RULES",
    "KRONECKER_SECTION",
    "NORMALIZATION_SECTION",
    "ActivationCapture",
    "BlockSettings",
    "CollectorSettings",
    "Contribution",
    "CurvatureBlock",
    "DiagonalKroneckerBlock",
    "FactorAccumulator",
    "FactorCollector",
    "GroupedConvBlock",
    "KroneckerBlock",
    "NormalizationBlock",
    "Slot",
    "StateSection",
    "blocks_memory",
    "blocks_state_dict",
    "discover_batchnorm_layers",
    "discover_blocks",
    "discover_layers",
    "load_blocks_state",
    "running_average",
    "without_inverses",
]
