"""Micro-benchmarks that measure collectives, inverses and factor products and fit cost models.

Modules by role: :mod:`~spdkfac.calibrate.timing` (the time budget, median timing),
:mod:`~spdkfac.calibrate.collectives`, :mod:`~spdkfac.calibrate.inverses` and
:mod:`~spdkfac.calibrate.factors` (the measurements), :mod:`~spdkfac.calibrate.run`
(:func:`calibrate`: all of them, as a :class:`CalibrationPlan` says, fitted into a
:class:`~spdkfac.costmodel.CalibrationFile`), :mod:`~spdkfac.calibrate.report` (metadata,
fit errors, the markdown report) and :mod:`~spdkfac.calibrate.plot` (the PNG).
"""

from __future__ import annotations

from spdkfac.calibrate.collectives import CollectiveSamples, measure_collectives
from spdkfac.calibrate.factors import measure_factors
from spdkfac.calibrate.inverses import measure_inverses
from spdkfac.calibrate.plot import plot_calibration
from spdkfac.calibrate.report import describe_device, fit_errors, format_report, run_metadata
from spdkfac.calibrate.run import CalibrationPlan, FactorWorkload, calibrate
from spdkfac.calibrate.timing import Budget, median_seconds, synchronize

__all__ = [
    "Budget",
    "CalibrationPlan",
    "CollectiveSamples",
    "FactorWorkload",
    "calibrate",
    "describe_device",
    "fit_errors",
    "format_report",
    "measure_collectives",
    "measure_factors",
    "measure_inverses",
    "median_seconds",
    "plot_calibration",
    "run_metadata",
    "synchronize",
]
