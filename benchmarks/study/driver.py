"""The order of a study: tune every workload's optimizers, then the target-setting runs
(workloads whose baselines set the target), then the final runs, then the phases of the
workloads scored in steps (:mod:`study.steps`, their trials ``parallel`` at a time, one
process each), then report.

Each step skips the trials already in the record, so running the same command again
continues a study where it stopped (see :mod:`study.store`). Target-setting and final
runs need every tuning trial of their workload recorded (their configurations are chosen
from all of them); final runs of a workload with target-setting runs also need all of
those recorded (the protocol's order: the target is set before any final run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from study.analysis import select
from study.protocol import StudyPlan, Trial, Workload, final_trial, target_trial, tuning_trials
from study.report import write_report
from study.runner import Launcher, allow_runs, kill_running, run_trial
from study.steps import STEPS_PHASES, planned_steps_trials
from study.steps_cost import cost_trials
from study.store import TrialStore, check_protocol

__all__ = ["ALL_PHASES", "PHASES", "planned_trials", "run_study"]

#: What a study may be asked to do for the workloads timed to their targets, in order.
PHASES = ("tune", "target", "final")
#: Every phase, in order: those, then the steps-scored workloads', then their step cost
#: (one run at a time, alone on the machine: :mod:`study.steps_cost`).
ALL_PHASES = (*PHASES, *STEPS_PHASES, "cost")


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
    workload's tuning is complete; final runs: once its target-setting runs are too; the
    steps-scored workloads' phases: :func:`study.steps.planned_steps_trials`)."""
    if phase in STEPS_PHASES:
        return [t for w in plan.steps for t in planned_steps_trials(w, store.records, phase)]
    if phase == "cost":
        return [t for w in plan.steps for t in cost_trials(w, store.records)]
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
    phases: tuple[str, ...] = ALL_PHASES,
    command: str = "",
    log: Callable[[str], None] = print,
    single: Launcher | None = None,
    parallel: int = 1,
    report_plan: StudyPlan | None = None,
) -> TrialStore:
    """Run what is missing of ``phases`` (none: only rewrite the report), then write
    ``out/report.md``; the record. ``single`` launches the one-process runs of the
    steps-scored workloads (default: ``launcher``), ``parallel`` of them at a time.
    ``report_plan`` is what the report covers (default: ``plan``): the whole study, so that
    a run limited to some workloads or optimizers still writes every one's sections.

    Raises:
        study.store.ProtocolMismatchError: ``out`` holds a study under another protocol.
    """
    check_protocol(out, plan.protocol())
    store = TrialStore(out / "trials.jsonl")
    allow_runs()
    for phase in ALL_PHASES:
        if phase not in phases:
            continue
        trials = planned_trials(plan, store, phase)
        missing = [t for t in trials if not store.done(t.id)]
        log(
            f"{phase}: {len(trials) - len(missing)} of {len(trials)} trials recorded, "
            f"{len(missing)} to run"
        )
        steps = phase in (*STEPS_PHASES, "cost")
        chosen, workers = (single or launcher, 1) if steps else (launcher, plan.workers)

        def run(trial: Trial, chosen: Launcher = chosen, workers: int = workers) -> dict[str, Any]:
            return run_trial(trial, out, chosen, store, timeout=timeout, workers=workers)

        _run_all(missing, run, phase, log, parallel if phase in STEPS_PHASES else 1)
    path = write_report(report_plan or plan, store.records, out, command)
    log(f"report: {path}")
    return store


def _run_all(
    trials: Sequence[Trial],
    run: Callable[[Trial], dict[str, Any]],
    phase: str,
    log: Callable[[str], None],
    parallel: int,
) -> None:
    """Run ``trials``, ``parallel`` at a time, logging each as it ends."""
    started, finished = time.perf_counter(), [0]
    lock = threading.Lock()

    def one(trial: Trial) -> None:
        record = run(trial)
        with lock:
            finished[0] += 1
            number = finished[0]
            left = (time.perf_counter() - started) / number * (len(trials) - number) / 60
            log(
                f"[{phase} {number}/{len(trials)}] {trial.id}: {_brief(record)} "
                f"({left:.0f} min left at this pace)"
            )

    if parallel <= 1:
        for trial in trials:
            one(trial)
        return
    pool = ThreadPoolExecutor(max_workers=parallel)
    try:
        for future in [pool.submit(one, trial) for trial in trials]:
            future.result()
    except BaseException:
        # Ctrl-C or SIGTERM reach this thread only: end the runs the others wait for (a
        # run ended so is not recorded: it runs again when the study continues).
        kill_running()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()


def _brief(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"{record['status']} (exit {record['returncode']})"
    summary = record["summary"]
    return f"ok, {summary['steps']} steps, {summary['train_seconds']:.1f} s training"
