"""``spdkfac train``: argument errors, missing data, a 2-rank run, bit-identical resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed_helper import run_command

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _spdkfac(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_command([sys.executable, "-m", "spdkfac", "train", *args], timeout=timeout, env=ENV)


def _torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "spdkfac", "train"]
    return run_command([*command, *args], timeout=timeout, env=ENV)


@pytest.mark.parametrize(
    "flags",
    [["--epochs", "0"], ["--optimizer", "adam"], ["--strategy", "x"], ["--lr", "-1"],
     ["--label-smoothing", "2"], ["--bogus"]],
)  # fmt: skip
def test_bad_flags_exit_2_before_any_process_group(flags: list[str]) -> None:
    result = _spdkfac(*flags)
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr


def test_bad_config_files_exit_2(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("learning_rate = 0.1\n")
    assert "unknown training option(s): learning_rate" in _spdkfac("--config", str(unknown)).stderr
    assert _spdkfac("--config", str(tmp_path / "missing.toml")).returncode == 2


def test_missing_dataset_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = _spdkfac("--data", str(missing), "--model", "cnn")
    assert result.returncode == 1
    assert str(missing) in result.stderr


def _common_args(data: Path, out: Path) -> list[str]:
    return [
        "--data", str(data), "--model", "cnn", "--epochs", "1", "--batch-size", "16",
        "--out-dir", str(out), "--lr", "0.05", "--damping", "0.3", "--inv-update-steps", "2",
        "--mixup-alpha", "0.4", "--random-erasing", "0.5", "--label-smoothing", "0.1",
        "--weight-rescaling", "--no-tensorboard", "--lr-schedule", "polynomial",
    ]  # fmt: skip


def _final_model(out: Path) -> dict[str, torch.Tensor]:
    name = (out / "checkpoints" / "latest").read_text().strip()
    common = torch.load(out / "checkpoints" / name / "common.pt", weights_only=True)
    return dict(common["model"])


def test_two_ranks_train_and_resume_bit_identically(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # The straight run also evaluates every 2 steps: evaluation changes no training state.
    first = _torchrun(
        *_common_args(tiny_fashion_mnist, straight), "--max-steps", "6", "--eval-every", "2"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (straight / "metrics.csv").read_text().count("\n") == 4  # header + steps 2, 4, 6
    assert "median iteration" in first.stdout
    half = _torchrun(*_common_args(tiny_fashion_mnist, resumed), "--max-steps", "3")
    assert half.returncode == 0, half.stderr[-3000:]
    rest = _torchrun(*_common_args(tiny_fashion_mnist, resumed), "--max-steps", "6", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout
    ours, theirs = _final_model(straight), _final_model(resumed)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # A checkpoint from another configuration is refused with a clear message.
    other = _torchrun(*_common_args(tiny_fashion_mnist, resumed), "--resume", "--lr", "0.01")
    assert other.returncode != 0
    assert "incompatible configuration (differs in lr)" in other.stderr
