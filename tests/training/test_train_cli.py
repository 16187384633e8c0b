"""``spdkfac train``: argument errors, missing data, 2-rank runs (a bit-identical resume, an
osawa checkpoint).

The 2-rank runs call the CLI's ``main`` on two gloo ranks that ``run_distributed`` forks
(what torchrun's workers run, without a launcher and an interpreter per rank to start;
runs under torchrun are in tests/reliability/test_faults.py and tests/cli/test_demo.py).
Argument errors are checked in this process, and once in a subprocess for the exit code
of ``python -m spdkfac``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed_helper import run_command, run_distributed, spdkfac_on_rank

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _spdkfac(*args: str) -> subprocess.CompletedProcess[str]:
    """``spdkfac train *args`` in this process: its exit code and output."""
    code, out, err = spdkfac_on_rank(0, 1, ["train", *args])
    assert not dist.is_initialized()
    return subprocess.CompletedProcess(args, code, out, err)


def _two_ranks(*args: str) -> subprocess.CompletedProcess[str]:
    """``spdkfac train *args`` on 2 gloo ranks: rank 0's exit code and output (every
    rank's exit code must be the same)."""
    results = run_distributed(
        spdkfac_on_rank, 2, ["train", *args], timeout=240, env={"OMP_NUM_THREADS": "1"}
    )
    assert len({code for code, _, _ in results}) == 1, results
    return subprocess.CompletedProcess(args, *results[0])


@pytest.mark.usefixtures("here")
@pytest.mark.parametrize(
    "flags",
    [["--epochs", "0"], ["--optimizer", "adam"], ["--strategy", "x"], ["--lr", "-1"],
     ["--label-smoothing", "2"], ["--bogus"]],
)  # fmt: skip
def test_bad_flags_exit_2_before_any_process_group(flags: list[str]) -> None:
    result = _spdkfac(*flags)
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr


def test_bad_flag_exit_code_in_a_subprocess() -> None:
    command = [sys.executable, "-m", "spdkfac", "train", "--bogus"]
    result = run_command(command, timeout=60, env=ENV)
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr


@pytest.mark.usefixtures("here")
def test_bad_config_files_exit_2(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("learning_rate = 0.1\n")
    assert "unknown training option(s): learning_rate" in _spdkfac("--config", str(unknown)).stderr
    assert _spdkfac("--config", str(tmp_path / "missing.toml")).returncode == 2


@pytest.mark.usefixtures("here")
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
    first = _two_ranks(
        *_common_args(tiny_fashion_mnist, straight), "--max-steps", "6", "--eval-every", "2"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (straight / "metrics.csv").read_text().count("\n") == 4  # header + steps 2, 4, 6
    assert "median iteration" in first.stdout
    half = _two_ranks(*_common_args(tiny_fashion_mnist, resumed), "--max-steps", "3")
    assert half.returncode == 0, half.stderr[-3000:]
    rest = _two_ranks(*_common_args(tiny_fashion_mnist, resumed), "--max-steps", "6", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout
    ours, theirs = _final_model(straight), _final_model(resumed)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # A checkpoint from another configuration is refused with a clear message.
    other = _two_ranks(*_common_args(tiny_fashion_mnist, resumed), "--resume", "--lr", "0.01")
    assert other.returncode != 0
    assert "incompatible configuration (differs in lr)" in other.stderr


def test_train_cli_checkpoints_and_resumes_with_osawa(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    """Checkpoints gather the owners' factors (state_dict() on every rank, no hang)."""
    out = tmp_path / "run"
    common = ["--data", str(tiny_fashion_mnist), "--model", "cnn", "--epochs", "1",
              "--batch-size", "16", "--out-dir", str(out), "--strategy", "osawa",
              "--no-tensorboard"]  # fmt: skip
    first = _two_ranks(*common, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = _two_ranks(*common, "--max-steps", "4", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout
    name = (out / "checkpoints" / "latest").read_text().strip()
    state = torch.load(out / "checkpoints" / name / "common.pt", weights_only=False)
    layers = state["preconditioner"]["layers"]
    assert layers and all(entry["a_factor"] is not None for entry in layers.values())


@pytest.mark.usefixtures("here")
def test_a_fresh_run_never_mixes_with_or_deletes_another_run(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    """Issue 39 item 5: run 2 (no --resume) in run 1's --out-dir deleted its own checkpoint
    (latest dangled) and overwrote run 1's records. Now it is refused, run 1 stays
    resumable, and --overwrite replaces run 1 with a run of its own."""
    out = tmp_path / "out"
    common = ["--data", str(tiny_fashion_mnist), "--model", "mlp", "--epochs", "1",
              "--batch-size", "16", "--out-dir", str(out), "--no-tensorboard", "--threads", "1",
              "--checkpoint-every", "2"]  # fmt: skip
    assert _spdkfac(*common, "--max-steps", "6").returncode == 0
    before = {name: (out / name).read_bytes() for name in ("metrics.csv", "config.toml")}
    second = _spdkfac(*common, "--max-steps", "2")
    assert second.returncode == 1
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume" in lines[0] and "--overwrite" in lines[0], lines
    assert {name: (out / name).read_bytes() for name in before} == before
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    both = _spdkfac(*common, "--max-steps", "2", "--resume", "--overwrite")
    assert both.returncode == 2 and "not both" in both.stderr
    replaced = _spdkfac(*common, "--max-steps", "2", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000002"]
    assert _final_model(out)  # latest names a checkpoint that exists
    assert (out / "metrics.csv").read_text().count("\n") == 2  # header + its own row
    resumed = _spdkfac(*common, "--max-steps", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout


@pytest.mark.usefixtures("here")
def test_an_out_dir_that_is_a_file_exits_2_in_one_line(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    for out in (file, file / "run"):
        result = _spdkfac("--out-dir", str(out), "--model", "mlp")
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].endswith("is not a directory")


def test_output_paths_no_run_could_write_exit_2_in_one_line_before_training(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    """``--resume`` where ``OUT/checkpoints`` is a file (it used to train, then die at the
    first save), and an ``--out-dir`` no file system takes (a name too long: refused also
    to root, whose ``os.access`` says yes to everything; it used to raise a raw OSError)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    long_name = tmp_path / ("x" * 300) / "run"
    data = ("--data", str(tiny_fashion_mnist), "--model", "mlp", "--no-tensorboard")
    for flags, expected in (
        (("--out-dir", str(out), "--resume"), f"{out / 'checkpoints'} exists and is not a "),
        (("--out-dir", str(out)), f"{out / 'checkpoints'} exists and is not a directory"),
        (("--out-dir", str(long_name)), "--out-dir: cannot create"),
    ):
        result = _spdkfac(*data, "--max-steps", "1", *flags)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 2 and expected in lines[1], lines
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # nothing trained


def test_two_ranks_refuse_another_runs_out_dir_alike(
    tiny_fashion_mnist: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")  # what another run left
    result = _two_ranks("--data", str(tiny_fashion_mnist), "--model", "mlp", "--out-dir",
                        str(out), "--no-tensorboard", "--max-steps", "1")  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"--out-dir {out} holds another run (summary.json)" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
