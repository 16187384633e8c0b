"""What ``spdkfac demo`` leaves behind: its table, its numbers and a plot, in one folder."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from spdkfac.support.optional import optional_import, skip_notice

__all__ = ["EpochResult", "check_out_dir", "format_table", "write_demo_outputs"]

TABLE = "table.md"
NUMBERS = "results.csv"
PLOT = "accuracy.png"


@dataclass(frozen=True)
class EpochResult:
    """One row of the demo's table."""

    optimizer: str
    epoch: int
    train_loss: float
    test_accuracy: float
    seconds: float
    iteration_ms: float


def format_table(results: Sequence[EpochResult]) -> str:
    """A markdown table of the per-epoch results."""
    lines = [
        "| optimizer | epoch | train loss | test acc | seconds | ms/iter |",
        "|---|---|---|---|---|---|",
    ]
    for row in results:
        lines.append(
            f"| {row.optimizer} | {row.epoch} | {row.train_loss:.4f} | "
            f"{row.test_accuracy:.4f} | {row.seconds:.1f} | {row.iteration_ms:.1f} |"
        )
    return "\n".join(lines)


def check_out_dir(out_dir: Path) -> None:
    """Refuse an ``--out-dir`` that cannot hold the outputs, before anything is trained."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileNotFoundError(f"--out-dir {out_dir} is not a directory")


def write_demo_outputs(out_dir: Path, results: Sequence[EpochResult], heading: str) -> list[Path]:
    """Write ``table.md`` (``heading``, then the table), ``results.csv`` and, with
    matplotlib installed, ``accuracy.png`` (test accuracy and training loss per epoch, one
    line per optimizer) under ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TABLE).write_text(f"{heading}\n\n{format_table(results)}\n")
    with (out_dir / NUMBERS).open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in results)
    written = [out_dir / TABLE, out_dir / NUMBERS]
    if _plot(out_dir / PLOT, results):
        written.append(out_dir / PLOT)
    return written


def _plot(path: Path, results: Sequence[EpochResult]) -> bool:
    figure_module = optional_import("matplotlib.figure")
    if figure_module is None:
        print(skip_notice("matplotlib.figure", f"the plot {path}"))
        return False
    figure = figure_module.Figure(figsize=(9.0, 3.6), layout="constrained")
    accuracy, loss = figure.subplots(1, 2)
    for name in dict.fromkeys(row.optimizer for row in results):
        rows = [row for row in results if row.optimizer == name]
        epochs = [row.epoch for row in rows]
        accuracy.plot(epochs, [100 * row.test_accuracy for row in rows], "o-", label=name)
        loss.plot(epochs, [row.train_loss for row in rows], "o-", label=name)
    accuracy.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    loss.set(xlabel="epoch", ylabel="mean training loss", title="training loss")
    for axes in (accuracy, loss):
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.savefig(path, dpi=110)
    return True
