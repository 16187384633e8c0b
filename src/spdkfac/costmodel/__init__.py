"""Pure cost models (fit / predict / save / load JSON) for fusion, placement and simulation."""

from __future__ import annotations

from spdkfac.costmodel.factor import (
    FactorKind,
    FactorSample,
    FactorTimeModel,
    FlopRateModel,
    factor_flops,
)
from spdkfac.costmodel.fitting import (
    Predictor,
    median_relative_error,
    nonnegative_relative_fit,
)
from spdkfac.costmodel.models import (
    DEFAULT_COST_MODEL,
    AlphaBetaModel,
    CostModel,
    ExponentialInverseModel,
    PolynomialInverseModel,
)
from spdkfac.costmodel.persistence import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CalibrationFile,
    load_cost_model,
    resolve_cost_model,
    save_cost_model,
)
from spdkfac.costmodel.schema import CalibrationSamples

__all__ = [
    "DEFAULT_COST_MODEL",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "AlphaBetaModel",
    "CalibrationFile",
    "CalibrationSamples",
    "CostModel",
    "ExponentialInverseModel",
    "FactorKind",
    "FactorSample",
    "FactorTimeModel",
    "FlopRateModel",
    "PolynomialInverseModel",
    "Predictor",
    "factor_flops",
    "load_cost_model",
    "median_relative_error",
    "nonnegative_relative_fit",
    "resolve_cost_model",
    "save_cost_model",
]
