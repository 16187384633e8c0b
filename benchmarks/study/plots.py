"""Score-vs-wall-time plots of a workload's final runs (when matplotlib imports)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spdkfac.support.optional import optional_import, skip_notice
from study.protocol import Workload

__all__ = ["plot_final_runs", "target_band"]


def plot_final_runs(
    workload: Workload, records: Sequence[dict[str, Any]], targets: Sequence[float], path: Path
) -> bool:
    matplotlib = optional_import("matplotlib")
    if matplotlib is None:
        print(skip_notice("matplotlib", path.name))
        return False
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot")
    if plt is None:
        print(skip_notice("matplotlib.pyplot", path.name))
        return False
    figure, axis = plt.subplots(figsize=(8, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, optimizer in enumerate(workload.spaces):
        runs = [
            r
            for r in records
            if r["workload"] == workload.key
            and r["phase"] == "final"
            and r["optimizer"] == optimizer
            and r.get("status") == "ok"
        ]
        for number, run in enumerate(runs):
            rows = run["summary"]["metrics"]
            axis.plot(
                [row["train_seconds"] for row in rows],
                [row[workload.final_metric] for row in rows],
                color=colours[index % len(colours)],
                alpha=0.8,
                marker="o",
                ms=2,
                label=optimizer if number == 0 else None,
            )
    _targets(axis, workload, targets)
    scores = [
        row[workload.final_metric]
        for r in records
        if r["workload"] == workload.key and r["phase"] == "final" and r.get("status") == "ok"
        for row in r["summary"]["metrics"]
    ]
    zoomed = bool(targets and scores)
    if zoomed:
        axis.set_ylim(*target_band(targets, scores, workload.higher_is_better))
    axis.set_xlabel("training wall time (s), evaluation excluded")
    axis.set_ylabel(workload.final_metric)
    band = ", zoomed on the targets" if zoomed else ""
    axis.set_title(f"{workload.title}: final runs (one line per seed{band})")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _targets(axis: Any, workload: Workload, targets: Sequence[float]) -> None:
    """Dashed target lines, each labelled at its right end ("target 92%")."""
    labels = workload.labels if len(workload.labels) == len(targets) else ("",) * len(targets)
    for target, label in zip(targets, labels, strict=True):
        axis.axhline(target, color="grey", linestyle="--", linewidth=1)
        axis.annotate(
            f"target {label or f'{target:.4g}'}",
            xy=(1, target),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 2),
            textcoords="offset points",
            ha="right",
            va="bottom",
            fontsize=8,
            color="dimgrey",
        )


def target_band(
    targets: Sequence[float], scores: Sequence[float], higher_is_better: bool
) -> tuple[float, float]:
    """The score range a plot shows: from two target spreads short of the weakest target
    to the best score (or the strictest target) plus half a spread. The spread is the
    targets' range, or 2 % of the target when there is one."""
    low, high = min(targets), max(targets)
    spread = (high - low) or 0.02 * abs(high) or 1.0
    if higher_is_better:
        return low - 2 * spread, max(max(scores), high) + spread / 2
    return min(min(scores), low) - spread / 2, high + 2 * spread
