"""``--eval-every`` / ``--evals-per-epoch``: the schedule, the clock, metrics rows, resume."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import spdkfac.training.evaluation as evaluation
from spdkfac.cli import main
from spdkfac.training.config import TrainConfig
from spdkfac.training.evaluation import EvalSchedule, TrainClock
from spdkfac.training.metrics import epoch_at

__all__: list[str] = []


def _due(schedule: EvalSchedule) -> list[int]:
    return [step for step in range(schedule.total_steps + 1) if schedule.due(step)]


def test_schedules_name_the_steps_that_evaluate() -> None:
    # Default: every epoch's end, and the last step of a run cut short by --max-steps.
    assert _due(EvalSchedule(steps_per_epoch=8, total_steps=20)) == [8, 16, 20]
    assert _due(EvalSchedule(steps_per_epoch=8, total_steps=20, every=3)) == [3, 6, 9, 12, 15,
                                                                              18, 20]  # fmt: skip
    # Four per epoch of 10 steps: after positions ceil(i * 10 / 4) = 3, 5, 8, 10.
    quarter = EvalSchedule(steps_per_epoch=10, total_steps=20, per_epoch=4)
    assert _due(quarter) == [3, 5, 8, 10, 13, 15, 18, 20]
    # More evaluations than steps: every step; the end of a run is not on the schedule.
    assert _due(EvalSchedule(steps_per_epoch=2, total_steps=3, per_epoch=5)) == [1, 2, 3]
    assert not EvalSchedule(steps_per_epoch=8, total_steps=20).scheduled(20)
    config = TrainConfig(evals_per_epoch=4)
    assert EvalSchedule.from_config(config, steps_per_epoch=10, total_steps=20) == quarter
    assert epoch_at(16, 8) == 2 and isinstance(epoch_at(16, 8), int)
    assert epoch_at(3, 8) == 0.375 and epoch_at(1, 3) == 0.3333
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(eval_every=2, evals_per_epoch=2)
    with pytest.raises(ValueError, match="eval_every"):
        TrainConfig(eval_every=0)


def test_clock_leaves_paused_sections_out(monkeypatch: pytest.MonkeyPatch) -> None:
    now = iter([0.0, 1.0, 5.0, 6.5, 7.0, 100.0])
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: next(now))
    clock = TrainClock(elapsed=10.0)
    clock.start()  # t = 0
    with clock.paused():  # 1 s trained; paused from t = 1 to t = 5
        pass
    assert clock.seconds == pytest.approx(12.5)  # t = 6.5: 10 + 1 + 1.5
    clock.stop()  # t = 7
    assert clock.seconds == pytest.approx(13.0)
    with clock.paused():  # a stopped clock stays stopped
        pass
    assert clock.seconds == pytest.approx(13.0)


# ------------------------------------------------------------------ real (tiny) runs
# 256 training images, batch 16: 16 steps per epoch on one process.
FLAGS = ["--model", "mlp", "--batch-size", "16", "--epochs", "2", "--lr", "0.05",
         "--damping", "0.3", "--inv-update-steps", "3", "--threads", "1", "--no-tensorboard",
         "--mixup-alpha", "0.4", "--target-accuracy", "0.05"]  # fmt: skip


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _train(data: Path, out: Path, *flags: str) -> None:
    assert main(["train", "--data", str(data), "--out-dir", str(out), *FLAGS, *flags]) == 0


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def _final(out: Path) -> dict[str, Any]:
    name = (out / "checkpoints" / "latest").read_text().strip()
    common: dict[str, Any] = torch.load(out / "checkpoints" / name / "common.pt", weights_only=True)
    return common


def _untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in r.items() if k not in ("epoch_seconds", "train_seconds")} for r in rows
    ]


@pytest.mark.usefixtures("one_thread")
def test_finer_evaluations_change_nothing_but_the_rows(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    plain, quarters = tmp_path / "plain", tmp_path / "quarters"
    _train(tiny_fashion_mnist, plain, "--max-steps", "20")
    _train(tiny_fashion_mnist, quarters, "--max-steps", "20", "--evals-per-epoch", "4")
    assert [r["step"] for r in _rows(plain)] == ["16", "20"]
    rows = _rows(quarters)
    assert [(r["epoch"], r["step"]) for r in rows] == [
        ("0.25", "4"), ("0.5", "8"), ("0.75", "12"), ("1", "16"), ("1.25", "20")
    ]  # fmt: skip
    seconds = [float(r["train_seconds"]) for r in rows]
    assert seconds == sorted(seconds) and seconds[0] > 0
    # Evaluating changes no training state: the same final model and optimizer, bit for bit.
    ours, theirs = _final(quarters), _final(plain)
    for part in ("model", "optimizer", "preconditioner"):
        assert repr(ours[part].keys()) == repr(theirs[part].keys())
    for key, tensor in ours["model"].items():
        assert torch.equal(tensor, theirs["model"][key]), key
    # The epoch-end rows agree except for timings (train loss: since the last evaluation).
    assert rows[3]["test_accuracy"] == _rows(plain)[0]["test_accuracy"]
    summary = json.loads((quarters / "summary.json").read_text())
    assert summary["epochs_to_target"] == 0.25 and summary["steps_to_target"] == 4
    assert summary["seconds_to_target"] == pytest.approx(seconds[0])
    assert summary["eval_seconds"] > 0 and summary["train_seconds"] >= seconds[-1]


@pytest.mark.usefixtures("one_thread")
def test_resume_keeps_rows_and_weights(tiny_fashion_mnist: Path, tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--eval-every", "5", "--checkpoint-every", "3"]
    _train(tiny_fashion_mnist, straight, *flags, "--max-steps", "12")
    _train(tiny_fashion_mnist, resumed, *flags, "--max-steps", "7")
    _train(tiny_fashion_mnist, resumed, *flags, "--max-steps", "12", "--resume")
    ours, theirs = _final(resumed), _final(straight)
    for key, tensor in ours["model"].items():
        assert torch.equal(tensor, theirs["model"][key]), key
    # The first invocation's end (step 7) adds a row; every scheduled row is the same.
    assert [r["step"] for r in ours["metrics"]] == [5, 7, 10, 12]
    assert [r["step"] for r in theirs["metrics"]] == [5, 10, 12]
    assert _untimed([ours["metrics"][i] for i in (0, 2, 3)]) == _untimed(theirs["metrics"])
