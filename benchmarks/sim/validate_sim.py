"""Validate ``spdkfac simulate`` against ``spdkfac bench`` measurements on this machine.

For every ``results.json`` given (default: ``benchmarks/reports/*/results.json``), simulate
the same model, batch, world size, refresh intervals and variants with the ``cpu`` preset,
the costs the run itself planned with (its inverse and collective fits, printed in
``results.json``), the link's bandwidth and interference
(``benchmarks/sim/calibrate_sim_interference.py``), and three sources of compute times:

1. *profiled*: the spans of one profiled run of the real code, D-KFAC on loopback
   (``bench_MODEL_loopback/traces/d-kfac.json`` in the same folder as the run validated;
   see ``spdkfac.sim.profiled``). Every other variant, and every variant on the 1 Gbit/s
   link, is a prediction; only D-KFAC on loopback is the calibration run itself (marked
   in the tables).
2. *measured compute*: per-op and per-layer factor times taken outside the benchmark
   (``benchmarks/sim/measure_sim_compute.py``), when there is a file for the model.
3. *roofline*: the preset's FLOP-based model, no measurement of the model at all.

Writes measured against simulated iteration time and breakdown categories.

    python benchmarks/sim/validate_sim.py --out benchmarks/reports/sim_validation.md
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from spdkfac.bench.costs import read_cost_model
from spdkfac.bench.results import BenchResults, iteration_stats
from spdkfac.profiling import BREAKDOWN_CATEGORIES
from spdkfac.sim import (
    CommunicationModel,
    Hardware,
    MeasuredCompute,
    ProfiledCompute,
    StrategyResult,
    Workload,
    cpu_preset,
    model_by_name,
    simulate_strategy,
    trace_workload,
)

#: Measured-compute files, by model and batch size (benchmarks/sim/measure_sim_compute.py).
MEASURED = "benchmarks/reports/sim_measured_{model}_b{batch}.json"
#: The profiled run the "profiled" compute comes from, by model.
PROFILED = "bench_{model}_loopback"  # beside the validated run's own folder
#: Runs validated by default: (label, results.json glob, folder of the profiled runs
#: (None: beside the run), whether to add the measured-compute and roofline tables).
RUN_SETS: tuple[tuple[str, str, str | None, bool], ...] = (
    ("one session", "benchmarks/reports/validation/*/results.json", None, True),
    (
        "one session, profiled on a repeat",
        "benchmarks/reports/validation/*/results.json",
        "benchmarks/reports/validation_repeat",
        False,
    ),
    ("earlier sessions", "benchmarks/reports/*/results.json", None, True),
)
PROFILED_VARIANT = "d-kfac"
LIMIT = 0.15


def _intervals(results: BenchResults) -> tuple[int, int]:
    factor, inverse = str(results.settings.get("factor/inverse update steps", "1/1")).split("/")
    return int(factor), int(inverse)


def _input_size(results: BenchResults) -> int:
    match = re.search(r"(\d+)x(\d+)x(\d+)", str(results.settings.get("input", "3x32x32")))
    return int(match.group(2)) if match else 32


INTERFERENCE = "benchmarks/reports/sim_interference_cpu.json"


def _link_measurements(link: str) -> dict[str, float]:
    """What ``benchmarks/sim/calibrate_sim_interference.py`` measured on this link."""
    path = Path(INTERFERENCE)
    if not path.exists():
        return {}
    measured = json.loads(path.read_text())
    key = "loopback" if "loopback" in link else next((k for k in measured if k in link), None)
    return {k: float(v) for k, v in measured.get(key or "", {}).items() if k != "link"}


def run_costs(results: BenchResults) -> Hardware:
    """The ``cpu`` preset with the run's own inverse and collective fits for planning, and
    for the collectives' cost the same fits with the bandwidth of a large message and the
    interference measured on the run's link (``benchmarks/sim/calibrate_sim_interference.py``).

    The run fits α-β at start on 4 KiB-8 MiB messages, weighting relative error, so its β
    follows the small messages (on the tbf link a 256 KiB burst passes at full speed); the
    factor buckets are megabytes, so their time follows the large-message β.
    """
    costs = read_cost_model(results.cost_model)
    broadcast, allreduce = costs.broadcast, costs.allreduce
    planning = CommunicationModel({results.world_size: (broadcast, allreduce)}, scaling="ring")
    link = _link_measurements(results.link)
    communication = planning
    if "transfer_alone_s" in link:
        beta = max(allreduce.beta, link["transfer_alone_s"] / link["message_bytes"])
        ratio = beta / allreduce.beta if allreduce.beta > 0 else 1.0
        communication = CommunicationModel(
            {
                results.world_size: (
                    replace(broadcast, beta=broadcast.beta * ratio),
                    replace(allreduce, beta=beta),
                )
            },
            scaling="ring",
        )
    names = ("overlap", "contention", "broadcast_overlap", "broadcast_contention")
    knobs = {k: link[k] for k in (*names, "issue_overhead_seconds") if k in link}
    if "contention_spread" in link:
        knobs["contention_spread"] = min(2.0, link["contention_spread"])
    return replace(
        cpu_preset(),
        inverse=costs.inverse,
        communication=communication,
        planning=planning,
        **knobs,
    )


def _error(simulated: float, measured: float) -> float | None:
    return None if measured <= 0 else simulated / measured - 1


def _cell(simulated: float, measured: float) -> str:
    error = _error(simulated, measured)
    if error is None:
        return "—" if simulated < 1e-4 else f"0.0 / {1e3 * simulated:.1f}"
    flag = "" if abs(error) <= LIMIT else " ✗"
    return f"{1e3 * measured:.1f} / {1e3 * simulated:.1f}, {100 * error:+.0f}%{flag}"


def _simulate(
    workload: Workload, hardware: Hardware, results: BenchResults
) -> dict[str, StrategyResult]:
    factor_steps, inverse_steps = _intervals(results)
    return {
        variant.name: simulate_strategy(
            workload,
            hardware,
            results.world_size,
            variant.name,
            factor_update_steps=factor_steps,
            inv_update_steps=inverse_steps,
        )
        for variant in results.variants
    }


def _table(
    results: BenchResults, simulated: dict[str, StrategyResult], calibration: str = ""
) -> list[str]:
    lines = [
        "| variant | iteration (median) | iteration (mean) | "
        + " | ".join(BREAKDOWN_CATEGORIES)
        + " |",
        "|---" * (3 + len(BREAKDOWN_CATEGORIES)) + "|",
    ]
    for variant in results.variants:
        result = simulated[variant.name]
        cells = [
            _cell(result.iteration_s, iteration_stats(variant).median),
            _cell(result.iteration_s, statistics.fmean(variant.measured)),
        ]
        cells += [
            _cell(result.breakdown[c], variant.breakdown.get(c, 0.0)) for c in BREAKDOWN_CATEGORIES
        ]
        name = variant.name + (" (calibration run)" if variant.name == calibration else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


#: (runs, compute) -> column -> [cells within LIMIT, cells]
Score = dict[tuple[str, str], dict[str, list[int]]]


def _validate(
    path: str,
    measured_files: dict[str, str],
    scores: Score,
    run_set: tuple[str, str | None, bool] = ("given", None, True),
) -> tuple[list[str], list[str]]:
    results = BenchResults.load(path)
    runs, profiles, all_modes = run_set
    entry = model_by_name(results.model, input_size=_input_size(results))
    workload = trace_workload(
        entry.build, entry.input_shape, batch_size=results.batch_size, name=entry.name
    )
    roofline = run_costs(results)
    factor_steps, inverse_steps = _intervals(results)
    link = "1 Gbit/s" if "1gbit" in results.link else results.link.split(" ")[0]
    title = (
        f"`{Path(path).parent}`: {results.model}, {results.world_size} ranks x batch "
        f"{results.batch_size}, {link}" + (f" ({runs})" if profiles else "")
    )
    lines = [
        f"### {title}",
        "",
        f"`{path}`; all-reduce β for costs {1e9 * roofline.communication.at(2)[1].beta:.2f} "
        f"ns/B; overlap {roofline.overlap:.2f}, contention {roofline.contention:.2f}, "
        f"issue {1e6 * roofline.issue_overhead_seconds:.0f} µs "
        f"(`{INTERFERENCE}`); refresh {factor_steps}/{inverse_steps}; inverse and collectives: the "
        f"run's own fits ({results.cost_model.get('source', '?')}): inverse "
        f"{results.cost_model.get('inverse')}, all-reduce {results.cost_model.get('all-reduce')}, "
        f"broadcast {results.cost_model.get('broadcast')}",
        "",
    ]
    summary = []

    def score(compute: str) -> dict[str, list[int]]:
        return scores.setdefault((runs, compute), {})

    profiled_dir = Path(profiles or Path(path).parent.parent) / PROFILED.format(model=results.model)
    trace = profiled_dir / "traces" / f"{PROFILED_VARIANT}.json"
    if trace.exists():
        profile = ProfiledCompute.load(trace)
        timed, hardware = profile.apply(workload, roofline)
        simulated = _simulate(timed, hardware, results)
        same = Path(path).parent == profiled_dir
        lines += [
            f"Compute: profiled, from the spans of `{trace}`: forward/backward "
            f"{1e3 * profile.forward_backward:.1f} ms, rank spread {profile.rank_spread:.3f}, "
            f"jitter {profile.jitter:.3f}, bookkeeping x{hardware.bookkeeping_scale:.2f}.",
            "",
        ]
        lines += [*_table(results, simulated, PROFILED_VARIANT if same else ""), ""]
        summary.append(_summary(title, "profiled", results, simulated, score))
    if not all_modes:
        return lines, summary
    measured_path = measured_files.get(results.model) or MEASURED.format(
        model=results.model, batch=results.batch_size
    )
    if Path(measured_path).exists():
        measured = MeasuredCompute.load(measured_path)
        timed, hardware = measured.apply(workload, roofline)
        simulated = _simulate(timed, hardware, results)
        lines += [
            f"Compute: measured per op and per layer (`{measured_path}`), rank spread "
            f"{hardware.rank_spread:.3f}.",
            "",
        ]
        lines += [*_table(results, simulated), ""]
        summary.append(_summary(title, "measured compute", results, simulated, score))
    simulated = _simulate(workload, roofline, results)
    lines += ["Compute: the `cpu` preset's FLOP-based roofline (no measurement of the model).", ""]
    lines += [*_table(results, simulated), ""]
    summary.append(_summary(title, "roofline", results, simulated, score))
    return lines, summary


def _summary(
    title: str,
    compute: str,
    results: BenchResults,
    simulated: dict[str, StrategyResult],
    score: Callable[[str], dict[str, list[int]]],
) -> str:
    errors, misses = [], []
    tally = score(compute)

    def count(column: str, error: float) -> None:
        cell = tally.setdefault(column, [0, 0])
        cell[0] += abs(error) <= LIMIT
        cell[1] += 1

    for variant in results.variants:
        result = simulated[variant.name]
        errors.append(abs(_error(result.iteration_s, iteration_stats(variant).median) or 0.0))
        count("iteration", errors[-1])
        for category in BREAKDOWN_CATEGORIES:
            error = _error(result.breakdown[category], variant.breakdown.get(category, 0.0))
            if error is not None:
                count(category, error)
            if error is not None and abs(error) > LIMIT:
                misses.append(category)
    counted = {c: misses.count(c) for c in dict.fromkeys(misses)}
    missed = ", ".join(f"{c} ({n}/{len(results.variants)})" for c, n in counted.items())
    return (
        f"| {title} | {compute} | {100 * statistics.median(errors):.0f}% | "
        f"{100 * max(errors):.0f}% | {missed or 'none'} |"
    )


RUNS_NOTE = (
    "Runs: `benchmarks/reports/validation/` holds four `spdkfac bench` runs taken one after "
    "the other in one session (ResNet-32 and WRN-16-4, loopback and the emulated 1 Gbit/s "
    "cluster); `validation_repeat/` repeats the two loopback runs 30 minutes later (4-7 % "
    "faster) with traces of every iteration, and the one-session set is also simulated "
    "from their profiles; the other runs are from earlier sessions (a 1 Gbit/s run's "
    "forward/backward up to 13 % slower than in its loopback calibration run). Every run "
    "is simulated with "
    "the `cpu` preset, the inverse and α-β fits the run planned with, the 8 MiB all-reduce "
    "bandwidth and the interference of its link (`{interference}`), and three sources of "
    "compute: *profiled* (the spans of the D-KFAC variant of the loopback run in the same "
    "folder: every other row, and all of 1 Gbit/s, is a prediction), *measured compute* "
    "(ops and factor products timed outside a training step, "
    "`benchmarks/sim/measure_sim_compute.py`) and *roofline* (FLOPs and bytes only). "
    "Communication waits are always predicted, never taken from a trace."
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", help="results.json files (default: all)")
    parser.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="measured-compute file of MODEL (repeatable; default "
        "benchmarks/reports/sim_measured_MODEL_bBATCH.json)",
    )
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args()
    measured: dict[str, str] = {}
    for item in args.measured:
        model, _, path = item.partition("=")
        measured[model] = path
    given: tuple[str, str | None, bool] = ("given", None, True)
    paths = [(path, given) for path in args.results] or [
        # Other benchmarks also write results.json; keep those of `spdkfac bench`.
        (path, (label, profiles, all_modes))
        for label, pattern, profiles, all_modes in RUN_SETS
        for path in sorted(glob.glob(pattern))
        if "format" in json.loads(Path(path).read_text())
    ]
    if not paths:
        print("no results.json found", file=sys.stderr)
        return 1
    body: list[str] = []
    summary = [
        "| run | compute | iteration error, median over variants | max | categories off "
        "by > 15 % (variants) |",
        "|---|---|---|---|---|",
    ]
    scores: Score = {}
    for path, run_set in paths:
        lines, rows = _validate(path, measured, scores, run_set)
        body += lines
        summary += rows
    columns = ["iteration", *BREAKDOWN_CATEGORIES]
    scorecard = [
        "| runs | compute | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for (runs, compute), tally in scores.items():
        cells = [f"{tally[c][0]}/{tally[c][1]}" if c in tally else "—" for c in columns]
        scorecard.append(f"| {runs} | {compute} | " + " | ".join(cells) + " |")
    text = "\n".join(
        [
            "# Simulator validation against measured runs",
            "",
            f"command: `python {' '.join(sys.argv)}`",
            "",
            "Each cell: measured / simulated ms per iteration, and the simulation's error; ✗ "
            "marks errors beyond 15 %. Iteration: the measured median and mean of the slowest "
            "rank's time; categories: the profiler's breakdown (mean per iteration over "
            "ranks) against the simulator's.",
            "",
            RUNS_NOTE.format(interference=INTERFERENCE),
            "",
            "## Scorecard",
            "",
            "Cells within 15 % of the measurement / cells compared (variants x runs; a "
            "category is compared where the measurement is not zero).",
            "",
            *scorecard,
            "",
            "## Summary",
            "",
            *summary,
            "",
            "## Tables",
            "",
            *body,
        ]
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
