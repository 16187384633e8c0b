"""Score-vs-wall-time plots of a workload's final runs (when matplotlib imports)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spdkfac.support.optional import optional_import, skip_notice
from study.protocol import Workload

__all__ = ["plot_final_runs"]


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
    for target in targets:
        axis.axhline(target, color="grey", linestyle="--", linewidth=1)
    axis.set_xlabel("training wall time (s), evaluation excluded")
    axis.set_ylabel(workload.final_metric)
    axis.set_title(f"{workload.title}: final runs (one line per seed)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
