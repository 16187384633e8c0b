"""The study's markdown report: protocol first, then results, chosen configs, every trial.

The results open with the issue's ratio lines, exactly ``ratio <workload> <target>: X``
(K-FAC's median time to the target over the best other optimizer's; ``n/a`` and why
while a number is missing), then per workload the final table (median and range over
seeds of time and steps to each target), where K-FAC's time goes (steps vs cost per
step), and score-vs-wall-time plots when matplotlib imports.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from study.analysis import (
    Row,
    final_rows,
    final_targets,
    final_value,
    machine_of,
    outcome,
    ratio,
    reference_paces,
    reference_steps,
    select,
    setting_medians,
    tuning_targets,
)
from study.plots import plot_final_runs
from study.protocol import TARGET_SEED_OFFSET, StudyPlan, Workload, show
from study.steps_report import steps_protocol, steps_ratio_lines, steps_results, steps_trials

__all__ = ["ratio_lines", "write_report"]


def _number(value: float, digits: int = 1) -> str:
    if math.isnan(value):
        return "—"
    return "never" if math.isinf(value) else f"{value:.{digits}f}"


def _range(values: Sequence[float], digits: int = 1) -> str:
    return f"{_number(min(values), digits)}–{_number(max(values), digits)}"


def ratio_lines(plan: StudyPlan, records: Sequence[dict[str, Any]]) -> list[str]:
    """``ratio <workload> <label>: X`` for every target of every workload."""
    return [
        line
        for workload in plan.workloads
        for line in _ratios(workload, records, planned=len(plan.seeds) * len(workload.spaces))
    ]


def _ratios(
    workload: Workload, records: Sequence[dict[str, Any]], lead: str = "", planned: int = 0
) -> list[str]:
    """The ratio lines of one workload; ``planned``: its final runs in the plan (a line
    says it is provisional while fewer are recorded)."""
    lines = []
    done = sum(r["workload"] == workload.key and r["phase"] == "final" for r in records)
    status = f" (provisional: {done} of {planned} final runs recorded)" if done < planned else ""
    targets = final_targets(records, workload)
    for index, label in enumerate(workload.labels):
        prefix = f"{lead}ratio {' '.join(filter(None, (workload.name, label)))}:"
        if index >= len(targets):
            setters = (
                f"target-setting runs of {', '.join(workload.baselines)}"
                if workload.target_setting
                else f"{workload.reference} final runs"
            )
            lines.append(f"{prefix} n/a (the {setters} set this target; none has finished)")
            continue
        found = ratio(final_rows(records, workload, targets[index]), workload.kfac)
        if found is None:
            lines.append(
                f"{prefix} n/a (needs final runs of {' or '.join(workload.kfac)} and of "
                "another optimizer)"
            )
        else:
            lines.append(f"{prefix} {found[0]:.2f}{status}")
    return lines


def _protocol(plan: StudyPlan) -> list[str]:
    lines = [
        "## Protocol (declared before any run)",
        "",
        f"- Every run is one `spdkfac train` under `torchrun --standalone --nproc-per-node "
        f"{plan.workers}` (one thread per worker, `OMP_NUM_THREADS=1`), one run at a time "
        "(the workloads scored in steps: as their own protocol says).",
        f"- Tuning: {plan.trials} trials per optimizer (a workload may declare its own "
        "number), drawn at random (seeded) from its "
        "search space below, every optimizer the same number; trial i of each optimizer "
        f"runs in turn. Trials use seed {plan.tune_seed} and score a validation split "
        "carved from the training data (`--val-split`); the test set is never looked at. "
        "No early stopping: every trial runs its whole schedule.",
        "- Selection: per optimizer, the trial that reaches the strictest target on the "
        "validation split soonest (training seconds; across machines, in steps of the pace "
        "reference on the same machine: see the note on machines), then the next target, "
        "then the best final validation score.",
        "- Target-setting (workloads whose baselines set the target, AlgoPerf's rule): "
        "after tuning and before any final run, each baseline's chosen configuration runs "
        "the whole budget (its schedule stretched to 1.0) with seeds "
        f"{', '.join(map(str, plan.target_seeds))} (the final seeds + {TARGET_SEED_OFFSET}), "
        "the baselines alternating; the target is the best baseline's median final score "
        "over them (a failed run counts as the worst score). K-FAC never sets it.",
        f"- Final runs: each chosen configuration with seeds {', '.join(map(str, plan.seeds))}, "
        "the optimizers alternating seed by seed, on the full training set.",
        "- Time: `spdkfac train`'s training clock; evaluations and checkpoints are "
        "excluded, everything else (K-FAC's factor, inverse and communication work "
        "included) counts. A target is reached at the first evaluation at or past it.",
        "- A run that never reaches a target counts as its full budget: the workload's "
        "budget in steps and its own seconds per step times that many steps; a failed run "
        "counts as never (infinite).",
        "- `schedule` is the cosine schedule's length as a fraction of the budget (the run "
        "ends with it); `warmup` is the linear warm-up as a fraction of that schedule.",
    ]
    lines += [f"- Note: {note}" for note in plan.notes]
    for workload in plan.workloads:
        lines += ["", f"### Workload {workload.title}", ""]
        if workload.changes:
            lines += [f"Changed from revision {workload.revision - 1}: {workload.changes}", ""]
        lines += _workload_protocol(workload)
    for steps in plan.steps:
        lines += steps_protocol(steps)
    for workload in plan.retired:
        lines += [
            "",
            f"### Retired: workload {workload.name}, revision {workload.revision}",
            "",
            "Replaced by the next revision above; its trials are listed under Every trial, "
            "and none runs again.",
            "",
            *_workload_protocol(workload),
        ]
    return lines


def _workload_protocol(workload: Workload) -> list[str]:
    target = (
        ", ".join(workload.labels) + f" {workload.final_metric}"
        if workload.targets
        else f"the median final {workload.final_metric} of the {workload.reference} "
        "final runs (its best configuration at the end of its schedule); tuning trials "
        f"are timed to the best final {workload.tune_metric} of the {workload.reference} "
        "tuning trials"
    )
    if workload.targets and workload.tune_margin:
        tuned = ", ".join(f"{t:g}" for t in tuning_targets((), workload))
        target += f"; tuning trials are timed to {tuned} {workload.tune_metric}"
    if workload.target_setting:
        target = (
            f"the best baseline's median final {workload.final_metric} over its "
            f"target-setting runs (baselines: {', '.join(workload.baselines)}; K-FAC rows: "
            f"{', '.join(n for n in workload.kfac if n in workload.spaces) or 'none yet'}); "
            f"tuning trials are timed to the best final {workload.tune_metric} of the "
            "baselines' tuning trials"
        )
    trials = "" if workload.trials is None else f" Tuning: {workload.trials} trials per optimizer."
    lines = [
        f"{workload.description}. Budget: {workload.budget} {workload.unit}. Targets: "
        f"{target}.{trials}  ",
        f"Flags of every run: `{' '.join(workload.flags)}`  ",
        f"Tuning trials add `{' '.join(workload.tune_flags)}` and are scored on "
        f"`{workload.tune_metric}`; final runs add `{' '.join(workload.final_flags)}` "
        f"and are timed on `{workload.final_metric}`.",
        "",
        "| optimizer | fixed flags | search space |",
        "|---|---|---|",
    ]
    for name, space in workload.spaces.items():
        searched = "; ".join(f"{k}: {d.describe()}" for k, d in space.dimensions.items())
        lines.append(f"| {name} | `{' '.join(space.fixed)}` | {searched} |")
    return lines


def _final_section(
    workload: Workload,
    records: Sequence[dict[str, Any]],
    out: Path,
    *,
    heading: bool = True,
    setting_runs: int = 0,
) -> list[str]:
    lines = ["", f"### {workload.title}: final runs", ""] if heading else [""]
    lines += _target_setting(workload, records, setting_runs)
    targets = final_targets(records, workload)
    finished = [r for r in records if r["workload"] == workload.key and r["phase"] == "final"]
    if not targets or not finished:
        return [*lines, "No final runs yet."]
    lines += [
        f"| target | optimizer | reached | median s | range s | median steps | range steps "
        f"| ms/step | final {workload.final_metric} (median) |",
        "|---|---|---|---:|---|---:|---|---:|---:|",
    ]
    decomposition = []
    for target, label in zip(targets, workload.labels, strict=False):
        rows = final_rows(records, workload, target)
        for row in rows:
            seconds = [o.seconds for o in row.outcomes]
            steps = [o.steps for o in row.outcomes]
            final = statistics.median(row.final_scores) if row.final_scores else math.nan
            lines.append(
                f"| {label or workload.name} ({target:.4g}) | {row.optimizer} | "
                f"{row.reached}/{len(row.outcomes)} | {_number(row.median_seconds)} | "
                f"{_range(seconds)} | "
                f"{_number(row.median_steps, 0)} | {_range(steps, 0)} | "
                f"{_number(row.ms_per_step)} | {final:.4f} |"
            )
        decomposition += _where_time_goes(rows, workload, label or workload.name)
    lines += ["", *decomposition]
    if workload.pilots:
        lines += ["", f"Tried before the study (pilots, not study trials): {workload.pilots}"]
    machines = sorted({machine_of(r) for r in finished})
    if len(machines) > 1:
        lines += [
            "",
            f"Caution: these final runs ran on {len(machines)} machines ({'; '.join(machines)}): "
            "their seconds are not comparable across machines (see Every trial).",
        ]
    if plot_final_runs(workload, records, targets, out / f"{workload.key}.png"):
        lines += ["", f"![{workload.final_metric} vs training wall time]({workload.key}.png)"]
    else:
        lines += ["", "(plot skipped: matplotlib does not import here)"]
    return lines


def _target_setting(
    workload: Workload, records: Sequence[dict[str, Any]], expected: int
) -> list[str]:
    """How the target was set: each baseline's median over its target-setting runs
    (``expected``: the runs of each baseline the plan makes)."""
    if not workload.target_setting:
        return []
    medians = setting_medians(records, workload)
    targets = final_targets(records, workload)
    if not targets:
        return ["Target: not set yet (no target-setting run has finished).", ""]
    best = next(name for name, (value, _) in medians.items() if value == targets[0])
    each = "; ".join(f"{name} {value:.4f} (of {count})" for name, (value, count) in medians.items())
    done, planned = sum(c for _, c in medians.values()), expected * len(workload.baselines)
    status = f" (provisional: {done} of {planned} target-setting runs recorded)"
    return [
        f"Target: {targets[0]:.4f} {workload.final_metric}, set by {best}'s target-setting "
        "runs (AlgoPerf's rule: each baseline's chosen configuration over the whole budget; "
        f"the best baseline's median final score){status if done < planned else ''}. "
        f"Medians: {each}.",
        "",
    ]


def _where_time_goes(rows: Sequence[Row], workload: Workload, label: str) -> list[str]:
    """Steps to the target against time per step for every K-FAC row (the chosen one
    first) over the best other optimizer, then each K-FAC row's mean time per step over
    every other optimizer's."""
    found = ratio(rows, workload.kfac)
    if found is None or math.isnan(found[0]):
        return []
    _, chosen, best = found
    forms = sorted(
        (row for row in rows if row.optimizer in workload.kfac),
        key=lambda row: (row is not chosen, row.optimizer),
    )
    lines = [_decomposition(row, best, label) for row in forms]
    short = [row for row in (chosen, best) if 2 * row.reached <= len(row.outcomes)]
    if short:
        counts = ", ".join(
            f"{row.optimizer} in {row.reached} of {len(row.outcomes)}" for row in short
        )
        lines.append(
            f"- {label}: reached by {counts} runs only. A run that never reaches the target "
            "counts as the whole budget at its own pace, so a median without the target "
            "is the cost of the budget, not a time to the target."
        )
    others = [row for row in rows if row.optimizer not in workload.kfac]
    if all(math.isfinite(row.ms_per_step) for row in (*forms, *others)):
        costs = "; ".join(
            f"{row.optimizer} "
            + ", ".join(f"{row.ms_per_step / o.ms_per_step:.2f}x {o.optimizer}" for o in others)
            for row in forms
        )
        lines.append(f"- {label}, mean time per step (refresh steps included): {costs}.")
    return lines


def _decomposition(mine: Row, best: Row, label: str) -> str:
    value = mine.median_seconds / best.median_seconds
    steps = mine.median_steps / best.median_steps if best.median_steps else math.nan
    pace = mine.ms_per_step / best.ms_per_step if best.ms_per_step else math.nan
    line = (
        f"- {label}: {mine.optimizer} takes {value:.2f}x the time of {best.optimizer} "
        f"(the best other): {steps:.2f}x the steps to the target at {pace:.2f}x the time "
        "per step"
    )
    if math.isfinite(mine.median_step_ms) and mine.ms_per_step > mine.median_step_ms:
        share = 1 - mine.median_step_ms / mine.ms_per_step
        line += (
            f"; its steps take {mine.ms_per_step:.0f} ms on average and {mine.median_step_ms:.0f} "
            f"ms at the median: the time above the median (refresh steps) is {share:.0%} of "
            "its total"
        )
    if 2 * mine.reached > len(mine.outcomes) and math.isfinite(mine.run_steps):
        line += (
            f"; it passes the target at step {mine.median_steps:.0f} of its "
            f"{mine.run_steps:.0f}-step schedule ({mine.median_steps / mine.run_steps:.0%} "
            "of the way: the later, the more the annealed tail sets the time)"
        )
    return line + "."


def _trials(plan: StudyPlan, records: Sequence[dict[str, Any]]) -> list[str]:
    hours = sum(float(r.get("process_seconds", 0.0)) for r in records) / 3600
    lines = [
        "",
        "## Every trial",
        "",
        f"Every run of the study ({len(records)} runs, {hours:.2f} h of machine time "
        "including start-up and evaluation), in the order it finished; none is left out.",
    ]
    machines = list(dict.fromkeys(machine_of(r) for r in records))
    letter = {machine: chr(ord("A") + i) for i, machine in enumerate(machines)}
    lines += ["", "Machines (the CPU each run ran on):", ""]
    lines += [f"- {letter[m]}: {m}" for m in machines]
    for workload in (*plan.workloads, *plan.retired):
        targets = tuning_targets(records, workload)
        retired = " (retired)" if workload in plan.retired else ""
        picks = {} if retired else select(records, workload)
        chosen = {id(r) for r in picks.values() if r is not None}
        paces = reference_paces(records, workload)
        reference = workload.pace_reference
        lines += [
            "",
            f"### {workload.title}{retired}",
            "",
            f"Tuning targets on {workload.tune_metric}: "
            f"{', '.join(f'{t:.4g}' for t in targets) or 'none yet'}. One {reference} step "
            "(median of its tuning trials) took "
            + (
                "; ".join(f"{ms:.0f} ms on {letter[m]}" for m, ms in paces.items())
                or "— (none yet)"
            )
            + f"; tuning trials are chosen on the times to the targets in {reference} steps.",
            "",
            "| phase | optimizer | # | seed | hyperparameters | status | machine | s to targets "
            f"| in {reference} steps | final score | train s | ms/step | chosen |",
            "|---|---|---:|---:|---|---|---|---|---|---:|---:|---:|---|",
        ]
        for record in (r for r in records if r["workload"] == workload.key):
            tuning = record["phase"] == "tune"
            metric = workload.tune_metric if tuning else workload.final_metric
            aims = targets if tuning else final_targets(records, workload)
            reached = [outcome(record, workload, metric, t) for t in aims]
            times = ", ".join(_number(o.seconds) if o.reached else "never" for o in reached)
            units = ", ".join(
                _number(reference_steps(o.seconds, record, paces), 0) if o.reached else "never"
                for o in reached
            )
            summary = record.get("summary") or {"train_seconds": math.nan}
            value = final_value(record, metric)
            hparams = ", ".join(f"{k}={show(v)}" for k, v in record["hparams"].items())
            pace = (
                (1e3 * summary["train_seconds"] / summary["steps"])
                if summary.get("steps")
                else math.nan
            )
            lines.append(
                f"| {record['phase']} | {record['optimizer']} | {record['index']} | "
                f"{record['seed']} | {hparams} | {record['status']} | "
                f"{letter[machine_of(record)]} | {times or '—'} | {units or '—'} | "
                f"{'—' if value is None else f'{value:.4f}'} | "
                f"{_number(float(summary.get('train_seconds', math.inf)))} | {_number(pace)} | "
                f"{'yes' if id(record) in chosen else ''} |"
            )
    for steps in plan.steps:
        lines += steps_trials(steps, records, lambda r: letter[machine_of(r)])
    failures = [r for r in records if r.get("status") != "ok"]
    if failures:
        lines += ["", "Failed runs (last lines of their output):", ""]
        for record in failures:
            tail = " / ".join(record.get("error", "").strip().splitlines()[-3:])
            lines.append(f"- `{record['id']}` ({record['status']}): {tail}")
    return lines


def write_report(
    plan: StudyPlan, records: Sequence[dict[str, Any]], out: Path, command: str
) -> Path:
    """Write ``out/report.md`` (and the plots); its path."""
    lines = [
        "# Time to result, fairly tuned: K-FAC against the optimizers people would pick",
        "",
        f"command: `{command}`",
        "",
        *_protocol(plan),
        "",
        "## Results",
        "",
        "K-FAC's median time to each target over the best other optimizer's (below 1: "
        "K-FAC is faster):",
    ]
    for line in ratio_lines(plan, records):
        lines += ["", line]
    for steps in plan.steps:
        lines += [line for text in steps_ratio_lines(steps, records) for line in ("", text)]
    for workload in plan.workloads:
        lines += _final_section(workload, records, out, setting_runs=len(plan.target_seeds))
    for steps in plan.steps:
        lines += steps_results(steps, records)
    finished = {r["workload"] for r in records if r["phase"] == "final"}
    for workload in (w for w in plan.retired if w.key in finished):
        lines += [
            "",
            f"### Retired: {workload.name}, revision {workload.revision}",
            "",
            "Replaced by the revision above, so not the study's answer; kept as measured:",
            "",
            *(f"- {line}" for line in _ratios(workload, records, lead="retired: ")),
            *_final_section(workload, records, out, heading=False),
        ]
    lines += [
        "",
        "## Chosen configurations",
        "",
        "The best tuning trial of each optimizer, and the flags of its final runs (each "
        "adds `--seed S`); a row says so while its tuning trials are not all recorded:",
        "",
        "| workload | optimizer | tuning trial | final-run flags |",
        "|---|---|---|---|",
    ]
    for workload in plan.workloads:
        for optimizer, record in select(records, workload).items():
            mine = {"workload": workload.key, "phase": "tune", "optimizer": optimizer}
            tuned = sum(all(r.get(k) == v for k, v in mine.items()) for r in records)
            if record is None:
                why = "every trial failed" if tuned else "no trial has run yet"
                lines.append(f"| {workload.title} | {optimizer} | — | {why} |")
                continue
            trial = str(record["index"])
            if tuned < plan.trials_of(workload):
                trial += f" (provisional: {tuned} of {plan.trials_of(workload)} trials so far)"
            flags = workload.flags_for(optimizer, record["hparams"]) + list(workload.final_flags)
            lines.append(f"| {workload.title} | {optimizer} | {trial} | `{' '.join(flags)}` |")
    lines += _trials(plan, records)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
