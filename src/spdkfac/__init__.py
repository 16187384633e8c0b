"""spdkfac: distributed K-FAC preconditioning for PyTorch (SPD-KFAC, D-KFAC, MPD-KFAC)."""

from __future__ import annotations

from spdkfac.config import KFACConfig
from spdkfac.optim import KFACOptimizer
from spdkfac.preconditioner import KFACPreconditioner

__all__ = ["KFACConfig", "KFACOptimizer", "KFACPreconditioner", "__version__"]

__version__ = "0.1.0"
