"""The step cost of a steps-scored workload's rows, measured apart from its scored runs.

Declared with the workload (:mod:`study.declared`): each row's configuration of its best
scored trial runs :data:`COST_STEPS` steps (one evaluation, at the end, outside the
training clock), the rows interleaved in rounds of one run each, one run at a time, alone
on the machine. A row's cost in a round is its mean step (training seconds over steps:
K-FAC's refresh steps included); the time ratio of a round is the primary K-FAC row's
cost over the best baseline's, and ``ratio NAME`` is the steps ratio times the median of
the rounds' time ratios (their range printed beside it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from study.protocol import Trial
from study.steps import (
    StepsWorkload,
    best_score,
    kfac_rows,
    row_scores,
    steps_ratio,
    steps_to,
    target_of,
)

__all__ = [
    "COST_ROUNDS",
    "COST_STEPS",
    "best_scored",
    "cost_ratios",
    "cost_trials",
    "mean_steps",
    "paired_costs",
    "round_costs",
]

#: Steps per cost run and rounds of the measurement.
COST_STEPS, COST_ROUNDS = 200, 5


def best_scored(
    workload: StepsWorkload, records: Sequence[dict[str, Any]], row: str, target: float
) -> dict[str, Any]:
    """The row's scored trial with the fewest steps to the target, then the lowest best
    score (what tells apart the trials of a row that never reaches the target), then the
    lowest index: the configuration its cost runs use and a recipe's defaults are read
    from."""
    scored = [
        r
        for r in records
        if r["workload"] == workload.key and r["phase"] == "score" and r["optimizer"] == row
    ]
    metric = workload.metric
    return min(
        scored, key=lambda r: (steps_to(r, metric, target), best_score(r, metric), r["index"])
    )


def cost_trials(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> list[Trial]:
    """The cost runs, once every scored study is recorded (none before)."""
    target = target_of(workload, records)
    rows = kfac_rows(workload, records)
    if target is None or not rows:
        return []
    scores = row_scores(workload, records, target)
    if any(len(values) < workload.studies for values in scores.values()):
        return []
    trials = []
    for round_ in range(COST_ROUNDS):
        for row in (*workload.baselines, *rows):
            best = best_scored(workload, records, row, target.value)
            flags = [*best["flags"], "--max-steps", str(COST_STEPS), "--eval-every",
                     str(COST_STEPS)]  # fmt: skip
            trials.append(Trial(workload.key, row, "cost", round_, best["seed"], best["hparams"],
                                tuple(flags)))  # fmt: skip
    return trials


def _mean_step(record: dict[str, Any]) -> float:
    summary = record.get("summary") or {}
    steps = summary.get("steps") or 0
    return (
        float(summary["train_seconds"]) / steps if steps and record["status"] == "ok" else math.inf
    )


def round_costs(
    workload: StepsWorkload, records: Sequence[dict[str, Any]]
) -> list[dict[str, float]] | None:
    """Each cost round's mean step in seconds by row; None until every cost run is
    recorded."""
    planned = cost_trials(workload, records)
    done = {r["id"]: r for r in records}
    if not planned or any(t.id not in done for t in planned):
        return None
    return [
        {t.optimizer: _mean_step(done[t.id]) for t in planned if t.index == round_}
        for round_ in range(COST_ROUNDS)
    ]


def paired_costs(
    rounds: Sequence[dict[str, float]] | None, row: str, over: str
) -> tuple[float, float, float] | None:
    """(median, lowest, highest) of the rounds' ratios of ``row``'s mean step over
    ``over``'s (paired: the same round), from :func:`round_costs`; None without them."""
    if rounds is None:
        return None
    ratios = [cost[row] / cost[over] for cost in rounds]
    return statistics.median(ratios), min(ratios), max(ratios)


def mean_steps(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each row's median over the rounds of its mean step in seconds (empty until every
    cost run is recorded)."""
    rounds = round_costs(workload, records) or []
    rows = dict.fromkeys(row for cost in rounds for row in cost)
    return {row: statistics.median(cost[row] for cost in rounds) for row in rows}


def cost_ratios(
    workload: StepsWorkload, records: Sequence[dict[str, Any]]
) -> tuple[float, float, float] | None:
    """(median, lowest, highest) of the rounds' time ratios of the primary K-FAC row over
    the best baseline by steps; None until every cost run is recorded."""
    found = steps_ratio(workload, records)
    if found is None:
        return None
    return paired_costs(round_costs(workload, records), kfac_rows(workload, records)[0], found[1])
