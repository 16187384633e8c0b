"""Training with SGD or distributed K-FAC: ``spdkfac train`` and the loops of demo and bench.

Modules by role: :mod:`~spdkfac.training.config` (the run's options),
:mod:`~spdkfac.training.setup` (image datasets, schedules, optimizers from the options),
:mod:`~spdkfac.training.optimizers` (the base optimizers by name: SGD, AdamW, Muon, SOAP),
:mod:`~spdkfac.training.tasks` (what image classification and language modelling do
differently: data, model, batch, loss, scores),
:mod:`~spdkfac.training.loop` (one training step, shared by train, demo and bench),
:mod:`~spdkfac.training.trainer` (the resumable epoch loop of ``spdkfac train``),
:mod:`~spdkfac.training.evaluation` (when a run evaluates; its training clock),
:mod:`~spdkfac.training.lr_schedules` and :mod:`~spdkfac.training.rescaling` (the
recipe's LR schedules and weight rescaling), :mod:`~spdkfac.training.checkpoint` (the
checkpoint file format and atomic writes), :mod:`~spdkfac.training.persistence` (saving
and restoring a run's checkpoint), :mod:`~spdkfac.training.metrics` (a row per
evaluation, summary, outputs), :mod:`~spdkfac.training.replicas` (cross-rank equality),
:mod:`~spdkfac.training.progress` (the progress bar) and
:mod:`~spdkfac.training.faults` (fault injection for the reliability tests).
"""

from __future__ import annotations

__all__: list[str] = []
