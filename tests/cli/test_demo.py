"""The ``spdkfac demo`` verb: a tiny end-to-end run, argument errors, missing data."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from process_helper import run_command
from spdkfac.cli import main
from spdkfac.support.optional import optional_import


def test_demo_runs_end_to_end(
    tiny_fashion_mnist: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "demo-out"
    code = main(["demo", "--data", str(tiny_fashion_mnist), "--epochs", "1", "--batch-size",
                 "64", "--threads", "1", "--out-dir", str(out_dir)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "256 train / 64 test images" in out
    rows = [line for line in out.splitlines() if line.startswith(("| sgd", "| spd-kfac"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and 0.0 <= float(cells[3]) <= 1.0
    # The table, its numbers and the plot stay in the named folder.
    table = (out_dir / "table.md").read_text()
    assert all(row in table for row in rows) and "256 train / 64 test images" in table
    with (out_dir / "results.csv").open() as stream:
        numbers = list(csv.DictReader(stream))
    assert [row["optimizer"] for row in numbers] == ["sgd", "spd-kfac"]
    assert [float(row["test_accuracy"]) for row in numbers] == pytest.approx(
        [float(r.strip("|").split("|")[3]) for r in rows], abs=1e-4
    )
    if optional_import("matplotlib.figure") is not None:
        assert (out_dir / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out_dir / 'table.md'}" in out


def test_demo_refuses_an_out_dir_that_is_a_file(
    tiny_fashion_mnist: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["demo", "--data", str(tiny_fashion_mnist), "--out-dir", str(file)]) == 1
    assert f"--out-dir {file} is not a directory" in capsys.readouterr().err


def test_demo_under_torchrun_with_two_workers(tiny_fashion_mnist: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "spdkfac", "demo"]
    args = ["--data", str(tiny_fashion_mnist), "--epochs", "1", "--batch-size", "32",
            "--out-dir", str(tmp_path / "out")]  # fmt: skip
    result = run_command(command + args, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 worker(s) x batch 32" in result.stdout
    assert result.stdout.count("| spd-kfac | 1 |") == 1  # printed by rank 0 only


def test_missing_data_directory_names_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    assert main(["demo", "--data", str(missing)]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "dataset-fashion-mnist" in err
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["demo", "--data", str(file)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"directory {file} is not a directory" in lines[0]


@pytest.mark.parametrize(
    "flag", [["--epochs", "0"], ["--damping", "-1"], ["--model", "vgg"], ["--bogus"]]
)
def test_bad_flags_exit_with_code_2(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", *flag])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_bad_flag_exit_code_in_a_subprocess() -> None:
    result = run_command([sys.executable, "-m", "spdkfac", "demo", "--bogus"], timeout=60)
    assert result.returncode == 2
    assert "usage:" in result.stderr
