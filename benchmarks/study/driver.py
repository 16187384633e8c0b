"""The order of a study: tune every workload's optimizers, then the target-setting runs
(workloads whose baselines set the target), then the final runs, then report.

Each step skips the trials already in the record, so running the same command again
continues a study where it stopped (see :mod:`study.store`). Target-setting and final
runs need every tuning trial of their workload recorded (their configurations are chosen
from all of them); final runs of a workload with target-setting runs also need all of
those recorded (the protocol's order: the target is set before any final run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from study.analysis import select
from study.protocol import StudyPlan, Trial, Workload, final_trial, target_trial, tuning_trials
from study.report import write_report
from study.runner import Launcher, run_trial
from study.store import TrialStore, check_protocol

__all__ = ["PHASES", "planned_trials", "run_study"]

#: What a study may be asked to do, in order.
PHASES = ("tune", "target", "final")


def _tuned(plan: StudyPlan, store: TrialStore, workload: Workload) -> bool:
    return all(store.done(t.id) for t in tuning_trials(plan, workload))


def _target_trials(plan: StudyPlan, store: TrialStore, workload: Workload) -> list[Trial]:
    """The workload's target-setting runs: each baseline's chosen configuration with each
    target seed, the baselines alternating (none without target setting)."""
    if not workload.target_setting or not _tuned(plan, store, workload):
        return []
    chosen = select(store.records, workload)
    return [
        target_trial(workload, optimizer, record["hparams"], seed)
        for seed in plan.target_seeds
        for optimizer in workload.baselines
        if (record := chosen[optimizer]) is not None
    ]


def _final_trials(plan: StudyPlan, store: TrialStore) -> list[Trial]:
    trials = []
    for workload in plan.workloads:
        if not _tuned(plan, store, workload):
            continue
        setting = _target_trials(plan, store, workload)
        if not all(store.done(t.id) for t in setting):
            continue
        chosen = select(store.records, workload)
        for seed in plan.seeds:
            for optimizer in workload.spaces:
                record = chosen[optimizer]
                if record is not None:
                    trials.append(final_trial(workload, optimizer, record["hparams"], seed))
    return trials


def planned_trials(plan: StudyPlan, store: TrialStore, phase: str) -> list[Trial]:
    """The trials of ``phase`` as far as they are known (target-setting runs: once their
    workload's tuning is complete; final runs: once its target-setting runs are too)."""
    if phase == "tune":
        return [t for w in plan.workloads for t in tuning_trials(plan, w)]
    if phase == "target":
        return [t for w in plan.workloads for t in _target_trials(plan, store, w)]
    return _final_trials(plan, store)


def run_study(
    plan: StudyPlan,
    out: Path,
    launcher: Launcher,
    *,
    timeout: float,
    phases: tuple[str, ...] = PHASES,
    command: str = "",
    log: Callable[[str], None] = print,
) -> TrialStore:
    """Run what is missing of ``phases`` (none: only rewrite the report), then write
    ``out/report.md``; the record.

    Raises:
        study.store.ProtocolMismatchError: ``out`` holds a study under another protocol.
    """
    check_protocol(out, plan.protocol())
    store = TrialStore(out / "trials.jsonl")
    for phase in PHASES:
        if phase not in phases:
            continue
        trials = planned_trials(plan, store, phase)
        missing = [t for t in trials if not store.done(t.id)]
        log(
            f"{phase}: {len(trials) - len(missing)} of {len(trials)} trials recorded, "
            f"{len(missing)} to run"
        )
        started = time.perf_counter()
        for number, trial in enumerate(missing, 1):
            record = run_trial(trial, out, launcher, store, timeout=timeout, workers=plan.workers)
            elapsed = time.perf_counter() - started
            log(
                f"[{phase} {number}/{len(missing)}] {trial.id}: {_brief(record)} "
                f"({elapsed / number * (len(missing) - number) / 60:.0f} min left at this "
                "pace)"
            )
    path = write_report(plan, store.records, out, command)
    log(f"report: {path}")
    return store


def _brief(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"{record['status']} (exit {record['returncode']})"
    summary = record["summary"]
    return f"ok, {summary['steps']} steps, {summary['train_seconds']:.1f} s training"
