"""What ``spdkfac train`` reports: per-epoch rows, the run's summary and the files it writes."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spdkfac.jsonio import write_json
from spdkfac.optional import optional_import, skip_notice

__all__ = ["EpochMetrics", "TrainSummary", "format_summary", "open_tensorboard", "summarize",
           "write_outputs"]  # fmt: skip


@dataclass
class EpochMetrics:
    """One row of ``metrics.csv``."""

    epoch: int
    step: int
    train_loss: float
    test_accuracy: float
    epoch_seconds: float
    train_seconds: float
    lr: float
    skipped_steps: int


@dataclass
class TrainSummary:
    """What a run achieved."""

    best_accuracy: float
    final_accuracy: float
    epochs_to_target: int | None
    seconds_to_target: float | None
    median_iteration_ms: float
    steps: int
    world_size: int
    metrics: list[EpochMetrics] = field(default_factory=list)
    replicas_identical: bool = True


def summarize(
    metrics: list[EpochMetrics],
    *,
    target_accuracy: float,
    iteration_seconds: Sequence[float],
    steps: int,
    world_size: int,
) -> TrainSummary:
    """The summary of a run whose epochs gave ``metrics``."""
    accuracies = [m.test_accuracy for m in metrics]
    reached = [m for m in metrics if m.test_accuracy >= target_accuracy]
    return TrainSummary(
        best_accuracy=max(accuracies, default=0.0),
        final_accuracy=accuracies[-1] if accuracies else 0.0,
        epochs_to_target=reached[0].epoch if reached else None,
        seconds_to_target=reached[0].train_seconds if reached else None,
        median_iteration_ms=1000 * statistics.median(iteration_seconds)
        if iteration_seconds
        else 0.0,
        steps=steps,
        world_size=world_size,
        metrics=metrics,
    )


def format_summary(summary: TrainSummary, target: float) -> str:
    """The final line ``spdkfac train`` prints."""
    reached = (
        f"reached {target:.2%} at epoch {summary.epochs_to_target} after "
        f"{summary.seconds_to_target:.1f} s of training"
        if summary.epochs_to_target is not None
        else f"did not reach {target:.2%}"
    )
    return (
        f"best test accuracy {summary.best_accuracy:.4f}, final {summary.final_accuracy:.4f}; "
        f"{reached}; median iteration {summary.median_iteration_ms:.1f} ms over "
        f"{summary.steps} steps"
    )


def write_outputs(out: Path, summary: TrainSummary) -> None:
    """Write ``metrics.csv`` (one row per epoch; needs one at least) and ``summary.json``."""
    with (out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(summary.metrics[0]).keys()))
        writer.writeheader()
        for row in summary.metrics:
            writer.writerow(asdict(row))
    write_json(out / "summary.json", asdict(summary), allow_nan=True)


def open_tensorboard(out: Path, log: Callable[[str], None]) -> Any:
    """A TensorBoard ``SummaryWriter`` under ``out/tensorboard``, or None without the package.

    A missing or broken tensorboard package turns logging off with one notice through
    ``log``; the run goes on.
    """
    board = optional_import("torch.utils.tensorboard")
    if board is None:
        log(skip_notice("torch.utils.tensorboard", "TensorBoard logging"))
        return None
    return board.SummaryWriter(log_dir=str(out / "tensorboard"))
