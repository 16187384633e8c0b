"""``spdkfac train --model gpt --dataset text``: a tiny run, K-FAC, resume, errors."""

from __future__ import annotations

import csv
import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from spdkfac.cli import main
from spdkfac.support.optional import optional_import

__all__: list[str] = []

TINY = ["--seq-len", "16", "--gpt-layers", "1", "--gpt-heads", "2", "--gpt-dim", "16",
        "--batch-size", "4", "--threads", "1", "--no-tensorboard"]  # fmt: skip


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    line = b"the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n"
    path = tmp_path / "corpus.txt"
    path.write_bytes(line * 40)  # 3,160 bytes: 158 for validation and test each
    return path


def _train(text: Path, out: Path, *flags: str) -> int:
    args = ["train", "--model", "gpt", "--dataset", "text", "--data", str(text), *TINY]
    return main([*args, "--out-dir", str(out), *flags])


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_adamw_run_reports_validation_loss_and_bits_per_byte(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _train(text_file, out, "--optimizer", "adamw", "--lr", "3e-3", "--max-steps", "3") == 0
    (row,) = _rows(out)
    assert row["step"] == "3" and "test_accuracy" not in row
    assert float(row["val_bits_per_byte"]) == pytest.approx(float(row["val_loss"]) / math.log(2))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["final_val_bits_per_byte"] == pytest.approx(float(row["val_bits_per_byte"]))
    assert summary["test_bits_per_byte"] == pytest.approx(summary["test_loss"] / math.log(2))
    assert 0 < summary["test_bits_per_byte"] < 9  # a byte costs 8 bits at uniform odds
    printed = capsys.readouterr()
    assert "adamw gpt on text" in printed.out and "validation bits/byte" in printed.out
    assert "val bpb" in printed.err  # the progress bar's closing line


@pytest.mark.parametrize("optimizer", ["kfac", "kfac-adamw"])
def test_kfac_preconditions_the_language_model(
    text_file: Path, tmp_path: Path, optimizer: str
) -> None:
    out = tmp_path / optimizer
    code = _train(
        text_file, out, "--optimizer", optimizer, "--strategy", "spd-kfac", "--lr", "3e-3",
        "--inv-update-steps", "1", "--max-steps", "3",
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["final_val_loss"])
    assert summary["metrics"][0]["skipped_steps"] == 0


def _final_model(out: Path) -> dict[str, torch.Tensor]:
    name = (out / "checkpoints" / "latest").read_text().strip()
    common = torch.load(out / "checkpoints" / name / "common.pt", weights_only=True)
    return dict(common["model"])


_HEAVYBALL = pytest.mark.skipif(
    optional_import("heavyball") is None, reason="heavyball is not installed"
)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", pytest.param("soap", marks=_HEAVYBALL)])
def test_resume_is_bit_identical(text_file: Path, tmp_path: Path, optimizer: str) -> None:
    flags = ["--optimizer", optimizer, "--lr", "3e-3", "--gpt-dropout", "0.1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _train(text_file, straight, *flags, "--max-steps", "4") == 0
    assert _train(text_file, resumed, *flags, "--max-steps", "2") == 0
    assert _train(text_file, resumed, *flags, "--max-steps", "4", "--resume") == 0
    ours, theirs = _final_model(straight), _final_model(resumed)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_schedules_in_steps_fit_runs_shorter_than_an_epoch(text_file: Path, tmp_path: Path) -> None:
    # 45 steps per epoch here: a 30-step warm-up is valid although --epochs is 10, and a
    # cosine ending after 4 steps leaves the lr at 0 from then on.
    out = tmp_path / "steps"
    flags = ["--optimizer", "adamw", "--lr", "3e-3", "--warmup-steps", "2"]
    assert _train(text_file, out, *flags, "--lr-schedule-steps", "4", "--max-steps", "5") == 0
    rows = _rows(out)
    assert float(rows[-1]["lr"]) == 0.0
    long_warmup = [*flags[:4], "--warmup-steps", "30", "--max-steps", "2"]
    assert _train(text_file, tmp_path / "long", *long_warmup) == 0
    with pytest.raises(SystemExit) as exit_info:  # a warm-up as long as the schedule
        _train(text_file, tmp_path / "bad", "--warmup-steps", "4", "--lr-schedule-steps", "4")
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "flags",
    [["--dataset", "fashion-mnist"], ["--mixup-alpha", "0.2"], ["--gpt-heads", "3"]],
)
def test_bad_combinations_exit_2(text_file: Path, tmp_path: Path, flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _train(text_file, tmp_path / "bad", *flags)
    assert exit_info.value.code == 2


def test_image_model_on_text_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--model", "cnn", "--dataset", "text"])
    assert "reads image but dataset 'text' holds text" in capsys.readouterr().err


def test_missing_or_short_text_names_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.txt"
    assert _train(missing, tmp_path / "out") == 1
    assert f"{missing} does not exist" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_bytes(b"too short")
    assert _train(short, tmp_path / "out") == 1
    assert f"text corpus {short} has 9 bytes" in capsys.readouterr().err


def test_gcide_reads_a_dict_dz_and_trains(tmp_path: Path) -> None:
    entry = (b"Abuse \\A*buse\"\\, v. t. [F. abuser.]\n   To put to a wrong use; to misapply.\n"
             b"   [1913 Webster]\n\n")  # fmt: skip
    dictionary = tmp_path / "tiny.dict.dz"
    dictionary.write_bytes(gzip.compress(b"00-database-url\n   nowhere\n\n" + entry * 60))
    out = tmp_path / "run"
    args = ["train", "--model", "gpt", "--dataset", "gcide", "--data", str(dictionary), *TINY]
    assert main([*args, "--out-dir", str(out), "--optimizer", "adamw", "--max-steps", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 < summary["test_bits_per_byte"] < 9
    missing = tmp_path / "none.dict.dz"
    args[args.index(str(dictionary))] = str(missing)
    assert main([*args, "--out-dir", str(tmp_path / "other"), "--max-steps", "1"]) == 1
