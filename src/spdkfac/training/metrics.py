"""What ``spdkfac train`` reports: a row per evaluation, the run's summary and its files."""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from spdkfac.support.jsonio import write_json
from spdkfac.support.optional import optional_import, skip_notice
from spdkfac.training.checkpoint import atomic_write_bytes

__all__ = ["EpochMetrics", "TrainSummary", "epoch_at", "format_summary", "open_tensorboard",
           "summarize", "write_metrics_csv", "write_outputs"]  # fmt: skip


def epoch_at(step: int, steps_per_epoch: int) -> float:
    """Epochs done after ``step`` optimizer steps: an int at an epoch's end, else a fraction
    (rounded to 4 decimals)."""
    whole, part = divmod(step, steps_per_epoch)
    return whole if part == 0 else round(step / steps_per_epoch, 4)


@dataclass
class EpochMetrics:
    """One row of ``metrics.csv``, written at each evaluation: the task's scores and the
    training numbers up to then.

    Attributes:
        epoch: Epochs done (:func:`epoch_at`: fractional between epoch ends).
        step: Optimizer steps done.
        train_loss: Mean training loss (averaged over ranks) of the steps since the previous
            scheduled evaluation (the end of a run is not one, so a resumed run's rows match
            an uninterrupted run's).
        scores: The task's evaluation (``test_accuracy`` for images; ``val_loss`` and
            ``val_bits_per_byte`` for text); :meth:`row` splices them in after
            ``train_loss``.
        epoch_seconds: Training seconds of the current epoch so far (this process).
        train_seconds: Training wall time of the run so far: evaluations and checkpoints
            excluded.
        lr: The optimizer's learning rate for the next step.
        skipped_steps: Steps K-FAC skipped on non-finite values so far.
    """

    epoch: float
    step: int
    train_loss: float
    scores: dict[str, float]
    epoch_seconds: float
    train_seconds: float
    lr: float
    skipped_steps: int

    def row(self) -> dict[str, Any]:
        """The flat row (CSV, ``summary.json``, checkpoints), scores after ``train_loss``."""
        values = asdict(self)
        scores = values.pop("scores")
        head = {key: values.pop(key) for key in ("epoch", "step", "train_loss")}
        return {**head, **scores, **values}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> EpochMetrics:
        """Inverse of :meth:`row`: every column that is not a field is a score."""
        names = {f.name for f in fields(cls)} - {"scores"}
        known = {key: value for key, value in row.items() if key in names}
        scores = {key: float(value) for key, value in row.items() if key not in names}
        return cls(**known, scores=scores)


@dataclass
class TrainSummary:
    """What a run achieved: its task's headline scores and the common timings.

    ``scores`` holds the task's numbers (images: ``best_accuracy``, ``final_accuracy``,
    ``epochs_to_target``, ``seconds_to_target``; text: the best and final validation bits
    per byte and loss, and the test split's); :meth:`to_dict` puts them first.
    """

    scores: dict[str, Any]
    median_iteration_ms: float
    steps: int
    world_size: int
    metrics: list[EpochMetrics] = field(default_factory=list)
    replicas_identical: bool = True
    train_seconds: float = 0.0
    eval_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The content of ``summary.json``."""
        return {
            **self.scores,
            "median_iteration_ms": self.median_iteration_ms,
            "steps": self.steps,
            "world_size": self.world_size,
            "train_seconds": self.train_seconds,
            "eval_seconds": self.eval_seconds,
            "metrics": [m.row() for m in self.metrics],
            "replicas_identical": self.replicas_identical,
        }


def summarize(
    metrics: list[EpochMetrics],
    *,
    scores: dict[str, Any],
    iteration_seconds: Sequence[float],
    steps: int,
    world_size: int,
    train_seconds: float = 0.0,
    eval_seconds: float = 0.0,
) -> TrainSummary:
    """The summary of a run whose evaluations gave ``metrics`` and whose task scored
    ``scores``; ``train_seconds`` and ``eval_seconds`` are the run's training and
    evaluation wall times."""
    return TrainSummary(
        scores=scores,
        median_iteration_ms=1000 * statistics.median(iteration_seconds)
        if iteration_seconds
        else 0.0,
        steps=steps,
        world_size=world_size,
        metrics=metrics,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
    )


def format_summary(summary: TrainSummary, headline: str) -> str:
    """The final line ``spdkfac train`` prints: the task's ``headline``, then timings."""
    return (
        f"{headline}; median iteration {summary.median_iteration_ms:.1f} ms over "
        f"{summary.steps} steps"
    )


def write_metrics_csv(out: Path, metrics: Sequence[EpochMetrics]) -> None:
    """Write ``metrics.csv`` atomically, one row per evaluation (nothing without one)."""
    rows = [m.row() for m in metrics]
    if not rows:
        return
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0].keys()))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(out / "metrics.csv", text.getvalue().encode())


def write_outputs(out: Path, summary: TrainSummary) -> None:
    """Write ``metrics.csv`` (one row per evaluation) and ``summary.json``."""
    write_metrics_csv(out, summary.metrics)
    write_json(out / "summary.json", summary.to_dict(), allow_nan=True)


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
