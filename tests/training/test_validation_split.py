"""Tuning options of ``spdkfac train``: ``--val-split`` (a validation split carved from the
training data), ``--lr-schedule-steps`` and ``--warmup-steps``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from spdkfac.cli import main
from spdkfac.data.text import TextCorpusError, TextWindows, load_text_corpus
from spdkfac.training.config import TrainConfig
from spdkfac.training.setup import build_schedules, load_datasets, split_validation
from spdkfac.training.tasks import ImageTask, TextTask

__all__: list[str] = []


def test_split_validation_holds_out_a_fixed_disjoint_subset(tiny_fashion_mnist: Path) -> None:
    full, *_ = load_datasets(TrainConfig(data=str(tiny_fashion_mnist)))
    train, held = split_validation(full, 0.25)
    assert (len(train), len(held)) == (192, 64)
    rows = {tuple(image.flatten().tolist()) for image in full.tensors[0]}
    kept = {tuple(image.flatten().tolist()) for image in train.tensors[0]}
    out = {tuple(image.flatten().tolist()) for image in held.tensors[0]}
    assert kept | out == rows and not kept & out
    # Not simply the tail: a random subset, the same on every call.
    assert not torch.equal(held.tensors[0], full.tensors[0][-64:])
    _, held_again = split_validation(full, 0.25)
    assert torch.equal(held_again.tensors[0], held.tensors[0])
    with pytest.raises(ValueError, match=r"val_split 0\.001 of 256 training examples holds out 0"):
        split_validation(full, 0.001)


def test_image_runs_evaluate_on_the_held_out_images(tiny_fashion_mnist: Path) -> None:
    config = TrainConfig(data=str(tiny_fashion_mnist), val_split=0.25, seed=3)
    data = ImageTask().load(config)
    full, *_ = load_datasets(config)
    _, held = split_validation(full, 0.25)
    assert data.evaluation_name == "val" and len(data.train) == 192  # type: ignore[arg-type]
    assert torch.equal(data.evaluation[0], held.tensors[0])
    plain = ImageTask().load(TrainConfig(data=str(tiny_fashion_mnist)))
    assert plain.evaluation_name == "test" and len(plain.evaluation[0]) == 64


def test_text_val_split_is_the_tail_of_the_training_split(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes: 9,216 for training
    config = TrainConfig(model="gpt", dataset="text", data=str(corpus), seq_len=16)
    plain = TextTask().load(config)
    carved = TextTask().load(TrainConfig.from_dict({**config.to_dict(), "val_split": 0.25}))
    train = load_text_corpus(corpus, seq_len=16).train
    assert len(train) == 9216
    cut = 9216 - 2304
    assert len(carved.train) == len(TextWindows(train[:cut], 16))  # type: ignore[arg-type]
    assert len(carved.train) < len(plain.train)  # type: ignore[arg-type]
    # The held-out windows start at the cut, in order, like the validation split's.
    assert torch.equal(carved.evaluation[0][0], train[cut : cut + 16].long())
    assert torch.equal(carved.evaluation[0][1], train[cut + 16 : cut + 32].long())
    assert torch.equal(carved.final[0], plain.final[0])  # type: ignore[index]
    with pytest.raises(TextCorpusError, match=r"val_split 0\.999 of the 9216-byte training split"):
        TextTask().load(TrainConfig.from_dict({**config.to_dict(), "val_split": 0.999}))


def test_a_training_run_with_val_split_reports_validation_accuracy(
    tiny_fashion_mnist: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main([
        "train", "--data", str(tiny_fashion_mnist), "--model", "mlp", "--optimizer", "sgd",
        "--epochs", "1", "--batch-size", "64", "--val-split", "0.25", "--evals-per-epoch", "2",
        "--no-tensorboard", "--threads", "1", "--out-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    with (out / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["step"] for row in rows] == ["2", "3"]  # 192 images, batch 64: 3 steps
    assert all("val_accuracy" in row and "test_accuracy" not in row for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] == pytest.approx(float(rows[-1]["val_accuracy"]))
    assert "best validation accuracy" in capsys.readouterr().out


def test_lr_schedule_steps_and_warmup_steps_shape_the_schedule() -> None:
    config = TrainConfig(lr=0.4, lr_schedule="cosine", epochs=10, lr_schedule_steps=30,
                         warmup_steps=10)  # fmt: skip
    lr, *_ = build_schedules(config, steps_per_epoch=7)
    assert lr(5) == pytest.approx(0.2)  # half-way through the warm-up
    assert lr(10) == pytest.approx(0.4)
    assert lr(20) == pytest.approx(0.2)  # half-way through the cosine
    assert lr(30) == 0.0 and lr(69) == 0.0
    default, *_ = build_schedules(TrainConfig(lr=0.4, epochs=10), steps_per_epoch=7)
    assert default(30) > 0.1  # without it the cosine spans all 10 epochs (70 steps)
    polynomial = TrainConfig(lr=0.4, lr_schedule="polynomial", lr_schedule_steps=14)
    assert build_schedules(polynomial, steps_per_epoch=7)[0](14) == 0.0


@pytest.mark.parametrize(
    ("values", "message"),
    [({"warmup_steps": 5, "warmup_epochs": 1.0}, "give warmup_epochs"),
     ({"val_split": 1.0}, "val_split must be"), ({"lr_schedule_steps": 0}, "lr_schedule_steps"),
     ({"warmup_steps": -1}, "warmup_steps")],
)  # fmt: skip
def test_bad_tuning_options_name_themselves(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values)  # type: ignore[arg-type]
