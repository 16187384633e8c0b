"""Simulation results as JSON, markdown tables and Chrome traces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spdkfac.profiling import BREAKDOWN_CATEGORIES, Event, Phase, write_chrome_trace
from spdkfac.sim.simulator import StrategyResult

__all__ = [
    "SimulationRun",
    "inverse_phase_seconds",
    "markdown_report",
    "results_to_json",
    "write_trace",
]


@dataclass(frozen=True)
class SimulationRun:
    """Every strategy simulated for one model at one world size.

    Attributes:
        model: Model name.
        batch_size: Examples per rank.
        workers: World size.
        preset: Hardware preset (and calibration file) used.
        results: Strategy name → result, in the order simulated.
    """

    model: str
    batch_size: int
    workers: int
    preset: str
    results: Mapping[str, StrategyResult]


def _entry(run: SimulationRun, result: StrategyResult) -> dict[str, Any]:
    return {
        "model": run.model,
        "batch_size": run.batch_size,
        "workers": run.workers,
        "preset": run.preset,
        "iteration_s": result.iteration_s,
        "breakdown": dict(result.breakdown),
        "kinds": [
            {
                "factor_step": kind.factor_step,
                "inverse_step": kind.inverse_step,
                "count": kind.count,
                "iteration_s": kind.seconds,
                "simulated_ranks": kind.simulated_ranks,
            }
            for kind in result.kinds
        ],
        "plan": result.plan,
        "factor_buckets": result.factor_buckets,
        "grad_buckets": result.grad_buckets,
        "factor_memory_bytes": result.factor_memory_bytes,
        "comm_scheduler": result.comm_scheduler,
    }


def results_to_json(runs: Sequence[SimulationRun]) -> dict[str, Any]:
    """One object keyed by strategy; each value is ``{"runs": [...]}``, one entry per model
    and worker count simulated (in that order), each with its own ``model``,
    ``batch_size``, ``workers``, ``preset``, ``iteration_s`` (mean over the refresh
    cycle), ``breakdown`` (seconds per category), ``kinds`` (each distinct iteration of
    the cycle), ``plan``, bucket counts, ``factor_memory_bytes`` (running factors and
    inverses on the rank holding the most) and ``comm_scheduler`` (the backward window's
    scheduler, :mod:`spdkfac.sim.window`)."""
    document: dict[str, Any] = {}
    for run in runs:
        for name, result in run.results.items():
            document.setdefault(name, {"runs": []})["runs"].append(_entry(run, result))
    return document


def inverse_phase_seconds(result: StrategyResult) -> float:
    """Wall time of the first inverse phase: from the first ``inverse_*`` span on any rank
    to the last one's end (the slowest rank), as the paper's Fig. 12 measures it."""
    spans = [
        event
        for event in result.events
        if event.phase in (Phase.INVERSE_COMPUTE, Phase.INVERSE_COMM)
        and event.start < (result.kinds[0].seconds if result.kinds else 0.0)
    ]
    if not spans:
        return 0.0
    return max(event.end for event in spans) - min(event.start for event in spans)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def markdown_report(runs: Sequence[SimulationRun], *, title: str, notes: Sequence[str] = ()) -> str:
    """Tables per model: every strategy at every worker count, with the breakdown."""
    lines = [f"# {title}", ""]
    lines += [f"{note}  " for note in notes]
    if notes:
        lines.append("")
    by_model: dict[str, list[SimulationRun]] = {}
    for run in runs:
        by_model.setdefault(run.model, []).append(run)
    header = (
        "| workers | strategy | iteration ms | vs d-kfac | "
        + " | ".join(BREAKDOWN_CATEGORIES)
        + " | factors+inverses MiB/rank"
    )
    rule = "|---" * (5 + len(BREAKDOWN_CATEGORIES)) + "|"
    for model, model_runs in by_model.items():
        first = model_runs[0]
        lines += [
            f"## {model}, batch {first.batch_size} per worker, preset `{first.preset}`",
            "",
            "Breakdown in ms per iteration, averaged over ranks; communication columns are "
            "the time ranks wait (non-overlapped). Memory: running factors and inverses "
            "(float32 squares) on the rank holding the most.",
            "",
            header + " |",
            rule,
        ]
        for run in model_runs:
            reference = run.results.get("d-kfac") or next(
                (r for r in run.results.values() if r.strategy == "d-kfac"), None
            )
            for name, result in run.results.items():
                ratio = ""
                if reference is not None and result.iteration_s > 0:
                    ratio = f"{reference.iteration_s / result.iteration_s:.2f}x"
                cells = " | ".join(_ms(result.breakdown[c]) for c in BREAKDOWN_CATEGORIES)
                memory = f"{result.factor_memory_bytes / 2**20:.1f}"
                lines.append(
                    f"| {run.workers} | {name} | {_ms(result.iteration_s)} | {ratio} | {cells} "
                    f"| {memory} |"
                )
        lines.append("")
        lines.append("Plans:")
        lines.append("")
        for run in model_runs:
            for name, result in run.results.items():
                if result.plan:
                    buckets = (
                        ""
                        if result.factor_buckets is None
                        else f"; {result.factor_buckets} factor bucket(s)"
                    )
                    lines.append(f"- {run.workers} workers, {name}: {result.plan}{buckets}")
        lines.append("")
    return "\n".join(lines)


def write_trace(path: str | Path, runs: Sequence[SimulationRun], *, max_ranks: int = 8) -> Path:
    """A Chrome trace of the first run's strategies: one process per (strategy, rank).

    Ranks beyond ``max_ranks`` are left out to keep the file small.
    """
    events: list[Event] = []
    labels: dict[int, str] = {}
    if runs:
        run = runs[0]
        for index, (name, result) in enumerate(run.results.items()):
            for event in result.events:
                if event.rank < max_ranks:
                    pid = index * 1000 + event.rank
                    labels[pid] = f"{name} rank {event.rank}"
                    events.append(Event(event.name, pid, event.start, event.duration))
    return write_chrome_trace(path, events, labels=labels)
