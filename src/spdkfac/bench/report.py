"""The benchmark's outputs: ``report.md``, the Fig. 9 style ``breakdown.png``, Chrome traces."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from spdkfac.bench.link import MeasuredLink, format_bytes
from spdkfac.bench.results import (
    BenchResults,
    exposed_factor_comm,
    iteration_stats,
    ratio_to,
)
from spdkfac.bench.variants import VARIANTS
from spdkfac.profiling import BREAKDOWN_CATEGORIES, Event, Phase, write_chrome_trace
from spdkfac.support.optional import optional_import, skip_notice

__all__ = [
    "BenchOutputs",
    "format_report",
    "last_iterations",
    "record_link",
    "trace_filename",
    "write_bench_outputs",
    "write_breakdown_png",
    "write_outputs",
    "write_traces",
]

_FIG10_GOAL_PERCENT = 50.0
_SPEEDUP_GOAL = 1.2


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _maybe(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}%"


def trace_filename(name: str) -> str:
    """``traces/`` file name of a variant (``:`` is not portable in file names)."""
    return name.replace(":", "_") + ".json"


def _header(results: BenchResults) -> list[str]:
    settings, machine, costs = results.settings, results.machine, results.cost_model
    lines = [
        f"# spdkfac bench: {results.model}, {results.world_size} rank(s) x batch "
        f"{results.batch_size}{' under FSDP2' if results.layout == 'fsdp' else ''}, "
        f"link {results.link}",
        "",
        f"command: `{results.command}`",
        "",
    ]
    if machine:
        lines.append("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "  ")
    lines.append(f"link: {results.link}  ")
    if settings:
        lines.append("settings: " + ", ".join(f"{k} {v}" for k, v in settings.items()) + "  ")
    if costs:
        lines.append("cost model: " + ", ".join(f"{k} {v}" for k, v in costs.items()))
    lines += [
        "",
        "Iteration time is, per iteration, the slowest rank's wall time (zero_grad, forward, "
        "backward, K-FAC step, optimizer step); warm-up iterations are left out of every "
        "number. Breakdown categories are those of the SPD-KFAC paper's Fig. 9, from the "
        "profiler's spans, each moment counted once (communication = time spent waiting). "
        + _grad_comm_note(results.layout),
        "",
    ]
    return lines


def _grad_comm_note(layout: str) -> str:
    if layout == "fsdp":
        return (
            "Every variant's model is sharded by FSDP2 (`fully_shard` of each unit, then the "
            "root, on a 1-D mesh), not wrapped in DDP: its parameter all-gathers and gradient "
            "reduce-scatters run inside forward and backward and count in FF&BP. GradComm "
            "is then only K-FAC's own gradient traffic where it is spanned as such (osawa's "
            "reduce-scatter to the owners and the return of their results); the replicated "
            "strategies' gathers of the sharded gradients count in their step's phases."
        )
    return (
        "GradComm is measured from the launch of DDP's last gradient bucket (a timed "
        "communication hook) to the return of backward()."
    )


def _timing(size: int, seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms ({size / seconds / 1e9:.3f} GB/s)"


def _link_section(results: BenchResults) -> list[str]:
    """The emulated link's setting and what was measured on it (nothing on loopback)."""
    if not results.link_measurement:
        return []
    link = MeasuredLink.from_json(results.link_measurement)
    runs = [("before", link.before)]
    if link.after is not None:
        runs.append(("after", link.after))
    columns = [(f"all-reduce {when}", m.allreduce, m.allreduce_fit) for when, m in runs]
    columns += [(f"broadcast {when}", m.broadcast, m.broadcast_fit) for when, m in runs]
    lines = [
        "## Link",
        "",
        "Each rank ran in its own network namespace, its veth to a shared bridge capped by "
        f"{link.shape.describe()}. Measured with gloo between the namespaces just before "
        f"the benchmark{' and just after it' if link.after is not None else ''}: median "
        "over repeats of the slowest rank's time; GB/s = message bytes / time.",
        "",
        f"| message | {' | '.join(heading for heading, _, _ in columns)} |",
        "|---|" + "---|" * len(columns),
    ]
    for size, _ in link.before.allreduce:
        cells = []
        for _, samples, _ in columns:
            seconds = dict(samples).get(size)
            cells.append("—" if seconds is None else _timing(size, seconds))
        lines.append(f"| {format_bytes(size)} | {' | '.join(cells)} |")
    fits = [f"α {1e3 * fit.alpha:.3f} ms, β {1e9 * fit.beta:.2f} ns/B" for _, _, fit in columns]
    lines.append(f"| α-β fit | {' | '.join(fits)} |")
    return [*lines, ""]


def _time_table(results: BenchResults) -> list[str]:
    lines = [
        "## Iteration time",
        "",
        "| variant | median ms/iter | IQR ms | mean ms/iter | n | ratio to SGD "
        "| ratio to D-KFAC | speed-up over D-KFAC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results.variants:
        stats = iteration_stats(result)
        to_dkfac = ratio_to(results, result.name, "d-kfac")
        lines.append(
            f"| {result.name} | {_ms(stats.median)} | {_ms(stats.q1)}–{_ms(stats.q3)} | "
            f"{_ms(stats.mean)} | {stats.count} | "
            f"{_maybe(ratio_to(results, result.name, 'sgd'), '.2f')} | "
            f"{_maybe(to_dkfac, '.3f')} | {_maybe(None if not to_dkfac else 1 / to_dkfac, '.2f')}"
            " |"
        )
    return [*lines, ""]


def _breakdown_table(results: BenchResults, png: str | None) -> list[str]:
    header = " | ".join(BREAKDOWN_CATEGORIES)
    lines = [
        "## Breakdown (ms per iteration, mean over measured iterations and ranks)",
        "",
        f"| variant | {header} | total |",
        "|---|" + "---|" * (len(BREAKDOWN_CATEGORIES) + 1),
    ]
    for result in results.variants:
        cells = [_ms(result.breakdown.get(c, 0.0)) for c in BREAKDOWN_CATEGORIES]
        total = sum(result.breakdown.get(c, 0.0) for c in BREAKDOWN_CATEGORIES)
        lines.append(f"| {result.name} | {' | '.join(cells)} | {_ms(total)} |")
    lines.append("")
    if png:
        lines += [f"![breakdown per variant]({png})", ""]
    return lines


def _fig10_table(results: BenchResults) -> list[str]:
    rows = exposed_factor_comm(results)
    if not rows:
        return []
    unpack = _ms(results.factor_unpack)
    lines = [
        "## Exposed factor communication (Fig. 10)",
        "",
        "Non-overlapped factor all-reduce time (`FactorComm`) per variant, against the "
        "variant with the same strategy and placement that exchanges factors after "
        "backward; hidden = 100·(1 − exposed / baseline's exposed). `FactorComm` also holds "
        f"the exchange's host work on the reduced triangles (each divided by its weight, all "
        f"checked for finiteness), {unpack} ms per step on rank 0 (timed apart at "
        "start-up), which no policy can hide; the last two columns subtract it.",
        "",
        "| variant | factor exchange | placement | exposed FactorComm ms/iter | baseline "
        "| hidden vs baseline | baseline / this | without host work ms | hidden without it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        variant = VARIANTS[row.name]
        lines.append(
            f"| {row.name} | {variant.factor_exchange} | {variant.placement} | "
            f"{_ms(row.exposed)} | {row.baseline or '—'} | {_percent(row.hidden_percent)} | "
            f"{_maybe(row.reduction, '.2f')} | {_ms(row.communication)} | "
            f"{_percent(row.hidden_communication_percent)} |"
        )
    return [*lines, ""]


def _goals(results: BenchResults) -> list[str]:
    lines: list[str] = []
    rows = {row.name: row for row in exposed_factor_comm(results)}
    optimal = rows.get("fusion:optimal") or rows.get("spd-kfac")
    if optimal is not None and optimal.hidden_percent is not None:
        met = optimal.hidden_percent >= _FIG10_GOAL_PERCENT
        lines.append(
            f"- optimal fusion ({optimal.name}) hides {optimal.hidden_percent:.1f}% of "
            f"{optimal.baseline}'s exposed factor communication "
            f"({_percent(optimal.hidden_communication_percent)} without its host work; goal >= "
            f"{_FIG10_GOAL_PERCENT:.0f}%, judged on the measured value): "
            f"**{'met' if met else 'not met'}**"
        )
    ratio = ratio_to(results, "spd-kfac", "d-kfac")
    if ratio:
        speedup = 1 / ratio
        met = speedup >= _SPEEDUP_GOAL
        lines.append(
            f"- SPD-KFAC is {speedup:.2f}x as fast as D-KFAC per iteration (goal >= "
            f"{_SPEEDUP_GOAL}x): **{'met' if met else 'not met'}**"
        )
    return ["## Goals from the paper", "", *lines, ""] if lines else []


def _plans(results: BenchResults) -> list[str]:
    lines = ["## Variants", ""]
    for result in results.variants:
        variant = VARIANTS[result.name]
        extra = []
        if result.plan:
            extra.append(result.plan)
        if result.fusion_buckets is not None:
            extra.append(f"{result.fusion_buckets} factor all-reduce(s) per step")
        if result.skipped_steps:
            extra.append(f"{result.skipped_steps} skipped K-FAC step(s)")
        detail = f" ({'; '.join(extra)})" if extra else ""
        lines.append(f"- `{result.name}`: {variant.description}{detail}")
    return [*lines, ""]


def format_report(
    results: BenchResults, *, png: str | None = None, traces: str | None = None
) -> str:
    """The markdown report; ``png`` and ``traces`` are paths relative to it, when written."""
    lines = _header(results) + _link_section(results)
    lines += _time_table(results) + _breakdown_table(results, png)
    lines += _fig10_table(results) + _goals(results) + _plans(results)
    if traces:
        names = ", ".join(f"`{traces}/{trace_filename(v.name)}`" for v in results.variants)
        lines += [
            f"Chrome traces (all ranks on one timeline; open in ui.perfetto.dev): {names}.",
            "",
        ]
    return "\n".join(lines)


def write_breakdown_png(
    results: BenchResults, path: str | Path, *, log: Callable[[str], None] = print
) -> bool:
    """Stacked bars of the breakdown per variant (the paper's Fig. 9); False when matplotlib
    is missing or fails to import (after one notice through ``log``)."""
    matplotlib = optional_import("matplotlib")
    if matplotlib is None:
        log(skip_notice("matplotlib", Path(path).name))
        return False
    matplotlib.use("Agg")
    pyplot = optional_import("matplotlib.pyplot")
    if pyplot is None:
        log(skip_notice("matplotlib.pyplot", Path(path).name))
        return False
    names = [v.name for v in results.variants]
    figure, axes = pyplot.subplots(figsize=(max(6.0, 1.1 * len(names) + 2.5), 4.8))
    bottoms = [0.0] * len(names)
    for category in BREAKDOWN_CATEGORIES:
        heights = [1e3 * v.breakdown.get(category, 0.0) for v in results.variants]
        axes.bar(names, heights, bottom=bottoms, label=category, width=0.65)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes.set_ylabel("ms per iteration (mean over ranks)")
    title = (
        f"{results.model}, {results.world_size} ranks x batch {results.batch_size}, "
        f"link {results.link}"
    )
    axes.set_title("\n".join(textwrap.wrap(title, 60)), fontsize="medium")
    pyplot.setp(axes.get_xticklabels(), rotation=30, ha="right")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    figure.savefig(Path(path), dpi=120)
    pyplot.close(figure)
    return True


def last_iterations(events: Sequence[Event], count: int) -> list[Event]:
    """Each rank's events from the start of its last ``count`` iterations on."""
    kept: list[Event] = []
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank]
        starts = sorted(e.start for e in mine if e.phase == Phase.ITERATION)
        cut = starts[-count] if 0 < count < len(starts) else float("-inf")
        kept.extend(e for e in mine if e.start >= cut)
    return sorted(kept, key=lambda e: e.start)


def write_traces(
    events: Mapping[str, Sequence[Event]], directory: str | Path, *, iterations: int
) -> list[Path]:
    """One Chrome trace per variant (its last ``iterations`` iterations, every rank)."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, variant_events in events.items():
        kept = last_iterations(variant_events, iterations)
        labels = {rank: f"{name} rank {rank}" for rank in {e.rank for e in kept}}
        path = target / trace_filename(name)
        write_chrome_trace(path, kept, labels=labels)
        written.append(path)
    return written


@dataclass(frozen=True)
class BenchOutputs:
    """What :func:`write_bench_outputs` wrote: ``report.md`` and, beside it, ``others``
    (names relative to its directory; ``breakdown.png`` only when it was drawn)."""

    report: Path
    others: tuple[str, ...]

    def describe(self) -> str:
        """``wrote DIR/report.md (and results.json, traces/)``: only what is there."""
        return f"wrote {self.report} (and {', '.join(self.others)})"


def write_bench_outputs(
    results: BenchResults,
    events: Mapping[str, Sequence[Event]],
    out_dir: str | Path,
    *,
    trace_iterations: int,
    log: Callable[[str], None] = print,
) -> BenchOutputs:
    """Write ``results.json``, ``breakdown.png`` (when matplotlib works), ``traces/`` and
    ``report.md``; says which were written."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    results.save(directory / "results.json")
    png = (
        "breakdown.png"
        if write_breakdown_png(results, directory / "breakdown.png", log=log)
        else None
    )
    write_traces(events, directory / "traces", iterations=trace_iterations)
    report = directory / "report.md"
    report.write_text(format_report(results, png=png, traces="traces") + "\n")
    others = ("results.json", *((png,) if png else ()), "traces/")
    return BenchOutputs(report, others)


def record_link(out_dir: str | Path, link: MeasuredLink) -> Path:
    """Put ``link`` (its label and measurements) into the ``results.json`` of ``out_dir``
    and write ``report.md`` again from it; the traces and ``breakdown.png`` stay.

    Returns:
        The report's path.

    Raises:
        FileNotFoundError: ``out_dir`` holds no ``results.json``.
    """
    directory = Path(out_dir)
    results = BenchResults.load(directory / "results.json")
    results = replace(results, link=link.label(), link_measurement=link.to_json())
    results.save(directory / "results.json")
    report = directory / "report.md"
    previous = report.read_text() if report.is_file() else ""
    png = "breakdown.png" if "](breakdown.png)" in previous else None
    report.write_text(format_report(results, png=png, traces="traces") + "\n")
    return report


def write_outputs(
    results: BenchResults,
    events: Mapping[str, Sequence[Event]],
    out_dir: str | Path,
    *,
    trace_iterations: int,
    log: Callable[[str], None] = print,
) -> Path:
    """:func:`write_bench_outputs`, returning the report's path."""
    return write_bench_outputs(
        results, events, out_dir, trace_iterations=trace_iterations, log=log
    ).report
