"""Output paths that cannot be written are named in one line before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spdkfac.support.paths import make_output_dir, output_dir_problem, output_file_problem


def test_output_directories(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    assert output_dir_problem(tmp_path) is None
    assert output_dir_problem(tmp_path / "a" / "b") is None
    assert output_dir_problem(file) == f"{file} exists and is not a directory"
    nested = file / "a" / "b"
    assert output_dir_problem(nested) == f"{file} (in {nested}) is not a directory"


def test_output_files(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    assert output_file_problem(file) is None  # replaced
    assert output_file_problem(tmp_path / "new.json") is None
    assert output_file_problem(tmp_path) == f"{tmp_path} is a directory, expected a file name"
    assert output_file_problem("/") == "/ is a directory, expected a file name"
    missing = tmp_path / "missing" / "x.json"
    assert output_file_problem(missing) == f"directory {missing.parent} of {missing} does not exist"
    assert (
        output_file_problem(file / "x.json") == f"{file} (in {file / 'x.json'}) is not a directory"
    )


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="POSIX permissions, not root"
)
def test_unwritable_directories(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert (
        output_file_problem(locked / "x")
        == f"cannot write {locked / 'x'}: {locked} is not writable"
    )
    assert (
        output_dir_problem(locked / "a")
        == f"cannot create {locked / 'a'}: {locked} is not writable"
    )


def test_make_output_dir_creates_it_or_says_why(tmp_path: Path) -> None:
    assert make_output_dir(tmp_path / "a" / "b") is None and (tmp_path / "a" / "b").is_dir()
    assert make_output_dir(tmp_path / "a" / "b") is None  # there already: left as it is
    problem = make_output_dir(tmp_path / ("x" * 300))  # refused also to root
    assert problem is not None and problem.startswith(f"cannot create {tmp_path}")
    (tmp_path / "file").write_text("x")
    assert make_output_dir(tmp_path / "file" / "run") == (
        f"{tmp_path / 'file'} (in {tmp_path / 'file' / 'run'}) is not a directory"
    )
