"""From records to answers: time and steps to a target, selection, final tables, ratios.

A run's time to a target is its training clock (``train_seconds``: evaluations and
checkpoints excluded, everything else in) at the first evaluation at or past the target.
A run that never gets there counts as its full budget: the workload's budget in steps,
and the run's own seconds per step times that many steps. A run that failed has no rate
and counts as infinitely slow.

Tuning trials are compared within an optimizer, and they may have run on different
machines (a study stops and continues across sessions): their times to the targets are
compared in *reference steps*, the seconds divided by the time of one step of the
workload's pace reference optimizer on the same machine (:func:`reference_paces`). On one
machine that is the declared rule (seconds) scaled by a constant; K-FAC's costlier steps
still count in full.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from study.protocol import Workload

__all__ = [
    "Outcome",
    "Row",
    "budget_point",
    "curve",
    "final_rows",
    "final_targets",
    "final_value",
    "machine_of",
    "outcome",
    "ratio",
    "reference_paces",
    "reference_steps",
    "select",
    "setting_medians",
    "tuning_key",
    "tuning_targets",
]


@dataclass(frozen=True)
class Outcome:
    """When a run first reached a target, or its full budget if it never did."""

    reached: bool
    steps: float
    seconds: float


def curve(record: dict[str, Any], metric: str) -> list[tuple[int, float, float]]:
    """(step, training seconds, score) at each evaluation that scored ``metric``."""
    rows = record.get("summary", {}).get("metrics", [])
    return [
        (int(row["step"]), float(row["train_seconds"]), float(row[metric]))
        for row in rows
        if metric in row
    ]


def budget_point(record: dict[str, Any], workload: Workload) -> tuple[float, float]:
    """(steps, seconds) of the workload's full budget at this run's pace (inf if failed)."""
    summary = record.get("summary")
    if record.get("status") != "ok" or not summary or not summary.get("steps"):
        return math.inf, math.inf
    steps = float(workload.budget)
    if workload.unit == "epochs":
        last = summary["metrics"][-1]
        steps = round(float(last["step"]) / float(last["epoch"]) * workload.budget)
    return steps, float(summary["train_seconds"]) / float(summary["steps"]) * steps


def _passes(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def outcome(record: dict[str, Any], workload: Workload, metric: str, target: float) -> Outcome:
    """Steps and seconds to ``target`` on ``metric``, or the full budget."""
    for step, seconds, value in curve(record, metric):
        if _passes(value, target, workload.higher_is_better):
            return Outcome(True, float(step), seconds)
    steps, seconds = budget_point(record, workload)
    return Outcome(False, steps, seconds)


def final_value(record: dict[str, Any], metric: str) -> float | None:
    """The score at the run's last evaluation (None without one)."""
    points = curve(record, metric)
    return points[-1][2] if points else None


def _ok(records: Sequence[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in fields.items())
    ]


def tuning_targets(records: Sequence[dict[str, Any]], workload: Workload) -> tuple[float, ...]:
    """The targets tuning trials are timed to: the workload's own moved by its
    ``tune_margin`` towards better scores, or the best final validation score among the
    reference optimizer's trials (without one: the baselines' trials; none before one
    finished)."""
    if workload.targets:
        margin = workload.tune_margin if workload.higher_is_better else -workload.tune_margin
        return tuple(round(target + margin, 6) for target in workload.targets)
    setters = workload.baselines if workload.reference is None else (workload.reference,)
    values = [
        v
        for r in _ok(records, workload=workload.key, phase="tune")
        if r["optimizer"] in setters
        and (v := final_value(r, workload.tune_metric)) is not None
        and math.isfinite(v)
    ]
    if not values:
        return ()
    return (max(values) if workload.higher_is_better else min(values),)


#: The machine of a record written before the study recorded machines (every run until
#: 2026-12-01 22:59 UTC, when the study's machine changed).
UNRECORDED = "not recorded"


def machine_of(record: dict[str, Any]) -> str:
    """The CPU a run ran on, as the study recorded it."""
    return str(record.get("machine") or UNRECORDED)


def reference_paces(records: Sequence[dict[str, Any]], workload: Workload) -> dict[str, float]:
    """Machine -> median ms per step of the workload's pace reference's tuning trials
    there."""
    paces: dict[str, list[float]] = {}
    reference = workload.pace_reference
    for record in _ok(records, workload=workload.key, phase="tune", optimizer=reference):
        summary = record["summary"]
        if summary.get("steps"):
            ms = 1e3 * float(summary["train_seconds"]) / float(summary["steps"])
            paces.setdefault(machine_of(record), []).append(ms)
    return {machine: statistics.median(values) for machine, values in paces.items()}


def reference_steps(seconds: float, record: dict[str, Any], paces: dict[str, float]) -> float:
    """``seconds`` of ``record``'s run in steps of the pace reference on its machine (on a
    machine without a reference trial yet: at the median pace over the others; with none
    at all: at 1 s per step)."""
    pace = paces.get(machine_of(record))
    if pace is None:
        pace = statistics.median(paces.values()) if paces else 1e3
    return 1e3 * seconds / pace


def tuning_key(
    record: dict[str, Any],
    workload: Workload,
    targets: Sequence[float],
    paces: dict[str, float] | None = None,
) -> tuple[float, ...]:
    """Sort key of a tuning trial, smaller is better: reference steps (seconds, see
    :func:`reference_steps`) to each target, strictest first (never reached: inf), then the
    final score (larger first for accuracies)."""
    if record.get("status") != "ok":
        return (math.inf,) * (len(targets) + 1)
    strictest = sorted(targets, reverse=workload.higher_is_better)
    times = [outcome(record, workload, workload.tune_metric, t) for t in strictest]
    value = final_value(record, workload.tune_metric)
    if value is None or not math.isfinite(value):
        last = math.inf
    else:
        last = -value if workload.higher_is_better else value
    cost = [
        reference_steps(o.seconds, record, paces or {}) if o.reached else math.inf for o in times
    ]
    return (*cost, last)


def select(
    records: Sequence[dict[str, Any]], workload: Workload
) -> dict[str, dict[str, Any] | None]:
    """Each optimizer's best tuning trial (None when all of them failed); ties go to the
    earlier trial."""
    targets = tuning_targets(records, workload)
    paces = reference_paces(records, workload)
    chosen: dict[str, dict[str, Any] | None] = {}
    for optimizer in workload.spaces:
        trials = _ok(records, workload=workload.key, phase="tune", optimizer=optimizer)
        ranked = sorted(trials, key=lambda r: (tuning_key(r, workload, targets, paces), r["index"]))
        chosen[optimizer] = ranked[0] if ranked else None
    return chosen


def setting_medians(
    records: Sequence[dict[str, Any]], workload: Workload
) -> dict[str, tuple[float, int]]:
    """Baseline -> (median final score, runs) over its recorded target-setting runs (a
    failed run, or one without a finite score, counts as the worst score)."""
    worst = -math.inf if workload.higher_is_better else math.inf
    medians = {}
    for optimizer in workload.baselines:
        runs = [
            r
            for r in records
            if r["workload"] == workload.key
            and r["phase"] == "target"
            and r["optimizer"] == optimizer
        ]
        scores = [final_value(r, workload.final_metric) if r.get("status") == "ok" else None
                  for r in runs]  # fmt: skip
        if scores:
            finite = [v if v is not None and math.isfinite(v) else worst for v in scores]
            medians[optimizer] = (statistics.median(finite), len(finite))
    return medians


def final_targets(records: Sequence[dict[str, Any]], workload: Workload) -> tuple[float, ...]:
    """The final runs' targets: the workload's own; with target-setting runs, the best
    baseline's median final score over them; or the median over the reference optimizer's
    final runs of their final score (none before one finished)."""
    if workload.targets:
        return workload.targets
    if workload.target_setting:
        values = [v for v, _ in setting_medians(records, workload).values() if math.isfinite(v)]
        if not values:
            return ()
        return (max(values) if workload.higher_is_better else min(values),)
    values = [
        v
        for r in _ok(records, workload=workload.key, phase="final", optimizer=workload.reference)
        if (v := final_value(r, workload.final_metric)) is not None
    ]
    return (statistics.median(values),) if values else ()


@dataclass(frozen=True)
class Row:
    """One optimizer at one target over its final runs (one outcome per seed)."""

    optimizer: str
    target: float
    outcomes: tuple[Outcome, ...]
    ms_per_step: float
    final_scores: tuple[float, ...]
    #: Median over runs of each run's median step (K-FAC: a step without a refresh).
    median_step_ms: float = math.nan
    #: Median over runs of each run's length in steps (its schedule's end).
    run_steps: float = math.nan

    @property
    def median_seconds(self) -> float:
        return statistics.median(o.seconds for o in self.outcomes)

    @property
    def median_steps(self) -> float:
        return statistics.median(o.steps for o in self.outcomes)

    @property
    def reached(self) -> int:
        return sum(o.reached for o in self.outcomes)


def final_rows(records: Sequence[dict[str, Any]], workload: Workload, target: float) -> list[Row]:
    """One :class:`Row` per optimizer with final runs (failed runs included, as inf)."""
    rows = []
    for optimizer in workload.spaces:
        runs = [
            r
            for r in records
            if r["workload"] == workload.key
            and r["phase"] == "final"
            and r["optimizer"] == optimizer
        ]
        if not runs:
            continue
        outcomes = tuple(outcome(r, workload, workload.final_metric, target) for r in runs)
        stepped = [r["summary"] for r in _ok(runs) if r["summary"].get("steps")]
        pace = [1e3 * summary["train_seconds"] / summary["steps"] for summary in stepped]
        lengths = [summary["steps"] for summary in stepped]
        typical = [
            ms for r in _ok(runs) if (ms := r["summary"].get("median_iteration_ms")) is not None
        ]
        finals = tuple(v for r in runs if (v := final_value(r, workload.final_metric)) is not None)
        rows.append(
            Row(
                optimizer,
                target,
                outcomes,
                statistics.median(pace) if pace else math.inf,
                finals,
                statistics.median(typical) if typical else math.nan,
                statistics.median(lengths) if lengths else math.nan,
            )
        )
    return rows


def ratio(rows: Sequence[Row], kfac: str | Sequence[str]) -> tuple[float, Row, Row] | None:
    """(the best K-FAC row's median seconds / the best other optimizer's, that K-FAC row,
    that other row), or None without a K-FAC row or another optimizer. ``kfac``: the
    K-FAC optimizers' names (or one name)."""
    names = (kfac,) if isinstance(kfac, str) else tuple(kfac)
    mine_rows = [row for row in rows if row.optimizer in names]
    others = [row for row in rows if row.optimizer not in names]
    if not mine_rows or not others:
        return None
    mine = min(mine_rows, key=lambda row: row.median_seconds)
    best = min(others, key=lambda row: row.median_seconds)
    if math.isinf(mine.median_seconds) and math.isinf(best.median_seconds):
        return math.nan, mine, best
    return mine.median_seconds / best.median_seconds, mine, best
