"""The time-to-result study of issue 20: K-FAC against fairly tuned optimizers.

Modules by role: :mod:`study.protocol` (workloads, targets, budgets, search spaces: what
is declared before any number), :mod:`study.store` (the JSON-lines record of every trial,
the commit point that makes a study resumable), :mod:`study.runner` (one ``spdkfac
train`` run per trial under ``torchrun``), :mod:`study.analysis` (time and steps to a
target, selection, ratios), :mod:`study.report` (the markdown report and plots) and
:mod:`study.driver` (the order of the trials). The entry point is
``benchmarks/study_time_to_accuracy.py``.
"""

from __future__ import annotations

__all__: list[str] = []
