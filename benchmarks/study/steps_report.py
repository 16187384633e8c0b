"""The report's parts for a workload scored in steps (:mod:`study.steps`): its protocol,
its ratio lines, its phases' results and every one of its trials."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from study.protocol import show
from study.steps import (
    STEPS_PHASES,
    StepsWorkload,
    best_baseline,
    best_score,
    kfac_rows,
    planned_steps_trials,
    row_medians,
    row_scores,
    setting_choice,
    steps_ratio,
    steps_to,
    target_of,
)
from study.steps_cost import (
    COST_ROUNDS,
    COST_STEPS,
    best_scored,
    cost_ratios,
    mean_steps,
    paired_costs,
    round_costs,
)

__all__ = [
    "steps_comparison",
    "steps_protocol",
    "steps_ratio_lines",
    "steps_results",
    "steps_trials",
]


def _steps(value: float) -> str:
    return f"{value:.0f}" if math.isfinite(value) else "never"


def steps_protocol(workload: StepsWorkload) -> list[str]:
    """The workload's declared protocol: what changed, the workload, every row's space."""
    lines = [
        "",
        f"### Workload {workload.title}",
        "",
        f"Changed from revision {workload.revision - 1}: {workload.changes}",
        "",
        f"- Task: {workload.description}; scored on `{workload.metric}` (lower is better).",
        f"- Flags of every run: `{' '.join(workload.flags)}` (one process, "
        "`OMP_NUM_THREADS=1`, trials two at a time).",
        f"- Target setting: {', '.join(workload.setters)}, {workload.setter_trials} trials "
        f"each over {workload.budget} steps; the best rerun with seeds "
        f"{', '.join(map(str, workload.setting_seeds))}; scored budget "
        f"{workload.budget_factor} x their median steps to the target.",
        f"- Pilots: {workload.pilot_trials} per K-FAC candidate; {workload.kfac_rows} rows "
        f"chosen. Scored: {workload.studies} studies x {workload.trials} trials per row.",
        "",
        "| row | fixed flags | searched |",
        "|---|---|---|",
    ]
    for name, space in {**workload.baselines, **workload.candidates}.items():
        kind = " (K-FAC candidate)" if name in workload.candidates else ""
        searched = "; ".join(f"{k}: {d.describe()}" for k, d in space.dimensions.items())
        lines.append(f"| {name}{kind} | `{' '.join(space.fixed)}` | {searched} |")
    return lines


def steps_ratio_lines(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> list[str]:
    """``ratio NAME steps: X`` and ``ratio NAME: Y``, or ``n/a`` and why."""
    found = steps_ratio(workload, records)
    if found is None:
        why = _why_no_ratio(workload, records)
        return [
            f"ratio {workload.name} steps: n/a ({why})",
            f"ratio {workload.name}: n/a ({why})",
        ]
    value, best = found
    primary = kfac_rows(workload, records)[0]
    steps_line = (
        f"ratio {workload.name} steps: {value:.2f} ({primary}'s median steps to the target "
        f"over {best}'s)"
    )
    cost = cost_ratios(workload, records)
    if cost is None:
        return [steps_line, f"ratio {workload.name}: n/a (the step-cost runs are not all in)"]
    median, low, high = cost
    return [
        steps_line,
        f"ratio {workload.name}: {value * median:.2f} (the steps ratio x {primary}'s mean "
        f"step over {best}'s, {median:.2f}: the median of {COST_ROUNDS} interleaved rounds "
        f"of {COST_STEPS} steps, refresh steps included; rounds {low:.2f}-{high:.2f})",
    ]


def _why_no_ratio(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> str:
    if target_of(workload, records) is None:
        return "the target is not set yet"
    medians = row_medians(workload, records)
    if medians is None:
        return "not every scored study is recorded"
    primary = kfac_rows(workload, records)[0]
    if not math.isfinite(medians[primary]):
        return f"{primary}'s median study never reaches the target: K-FAC does not win"
    return "no baseline's median study reaches the target"


def _rounds(found: tuple[float, float, float] | None) -> str:
    if found is None:
        return "—"
    median, low, high = found
    return f"{median:.2f} ({low:.2f}-{high:.2f})"


def steps_comparison(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> list[str]:
    """Every row against the baseline with the fewest median steps: steps, step cost
    (paired by round, once the cost runs are in) and their product, time to the target."""
    medians = row_medians(workload, records)
    if medians is None:
        return []
    best = best_baseline(workload, medians)
    seconds = mean_steps(workload, records)
    rounds = round_costs(workload, records)
    reference = "muon" if "muon" in workload.baselines else best
    lines = [
        "",
        f"Every row against {best}, the baseline with the fewest median steps (only the "
        "primary K-FAC row's ratio above is the study's answer; the others show where each "
        f"row stands). Step costs: the {COST_ROUNDS} interleaved cost rounds, each row's "
        "mean step over the other's in the same round, median (lowest-highest); time to "
        "the target: steps ratio x step-cost ratio.",
        "",
        f"| row | median steps | steps over {best} | mean step (ms) | step over {reference} "
        f"| step over {best} | time to target over {best} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, median in medians.items():
        steps = median / medians[best] if math.isfinite(medians[best]) else math.inf
        over_best = paired_costs(rounds, row, best)
        time = steps * over_best[0] if over_best is not None and math.isfinite(steps) else None
        lines.append(
            f"| {row} | {_steps(median)} | {f'{steps:.2f}' if math.isfinite(steps) else '—'} "
            f"| {f'{1000 * seconds[row]:.0f}' if row in seconds else '—'} "
            f"| {_rounds(paired_costs(rounds, row, reference))} "
            f"| {_rounds(over_best)} | {'—' if time is None else f'{time:.2f}'} |"
        )
    return lines


def steps_results(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> list[str]:
    """Where each phase stands: the target and budget, the pilots' choice, study scores."""
    lines = ["", f"### {workload.title}: steps to the target", ""]
    for phase in STEPS_PHASES:
        planned = planned_steps_trials(workload, records, phase)
        done = sum(1 for r in records if r["id"] in {t.id for t in planned})
        lines.append(f"- {phase}: {done} of {len(planned)} planned trials recorded.")
    chosen = setting_choice(workload, records)
    if chosen is not None:
        hparams = ", ".join(f"{k}={show(v)}" for k, v in chosen["hparams"].items())
        lines.append(
            f"- Target-setting configuration: {chosen['optimizer']} trial {chosen['index']} "
            f"({hparams}; best {workload.metric} {best_score(chosen, workload.metric):.4f})."
        )
    target = target_of(workload, records)
    if target is None:
        return lines
    lines.append(
        f"- Target: {target.value:.4f} {workload.metric} (median of the setting runs' best); "
        f"their median steps to it {_steps(target.setter_steps)}; scored budget "
        f"{target.budget} steps."
    )
    rows = kfac_rows(workload, records)
    if rows:
        lines.append(f"- K-FAC rows chosen by the pilots: {', '.join(rows)} (primary: {rows[0]}).")
    scores = row_scores(workload, records, target)
    lines += ["", "| row | study scores (steps) | median |", "|---|---|---:|"]
    for row, values in scores.items():
        median = _steps(sorted(values)[(len(values) - 1) // 2]) if values else "—"
        shown = ", ".join(_steps(v) for v in values) or "—"
        lines.append(f"| {row} | {shown} | {median if len(values) == workload.studies else '—'} |")
    if scores and all(len(values) == workload.studies for values in scores.values()):
        lines += [
            "",
            "Each row's best scored trial (fewest steps to the target, then the lowest best",
            "score, which tells apart the trials of a row that never reaches the target, then",
            "the lowest index): the configuration its step-cost runs use and a recipe's",
            "defaults are read from.",
            "",
            "| row | study | # | seed | configuration | steps to target |",
            "|---|---:|---:|---:|---|---:|",
        ]
        for row in scores:
            best = best_scored(workload, records, row, target.value)
            hparams = ", ".join(f"{k}={show(v)}" for k, v in best["hparams"].items())
            study = best["index"] // workload.trials + 1
            steps = _steps(steps_to(best, workload.metric, target.value))
            lines.append(
                f"| {row} | {study} | {best['index']} | {best['seed']} | {hparams} | {steps} |"
            )
    return lines + steps_comparison(workload, records)


def steps_trials(
    workload: StepsWorkload, records: Sequence[dict[str, Any]], letter: Callable[[Any], str]
) -> list[str]:
    """Every trial of the workload, in the order it finished."""
    target = target_of(workload, records)
    lines = [
        "",
        f"### {workload.title}",
        "",
        "| phase | optimizer | # | seed | hyperparameters | status | machine | best score "
        "| steps to target | steps | ms/step |",
        "|---|---|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for record in (r for r in records if r["workload"] == workload.key):
        summary = record.get("summary") or {}
        steps = summary.get("steps") or 0
        pace = 1e3 * summary.get("train_seconds", math.nan) / steps if steps else math.nan
        reached = "—" if target is None else _steps(steps_to(record, workload.metric, target.value))
        hparams = ", ".join(f"{k}={show(v)}" for k, v in record["hparams"].items())
        lines.append(
            f"| {record['phase']} | {record['optimizer']} | {record['index']} | "
            f"{record['seed']} | {hparams} | {record['status']} | {letter(record)} | "
            f"{best_score(record, workload.metric):.4f} | {reached} | {steps} | {pace:.0f} |"
        )
    return lines
