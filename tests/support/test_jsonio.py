"""JSON files: atomic writes, and read errors that name the file and the fault."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest

from spdkfac.support.jsonio import atomic_write_bytes, read_json, write_json


def test_round_trip_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    document = {"a": [1, 2.5, None], "b": {"c": "é"}}
    assert write_json(path, document) == path
    assert read_json(path, "test file") == document
    assert path.read_text(encoding="utf-8").endswith("}\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    write_json(path, [1], indent=None)  # replaces the old file
    assert path.read_text() == "[1]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_nan_is_refused_before_the_file_is_touched(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    write_json(path, {"x": 1})
    with pytest.raises(ValueError):
        write_json(path, {"x": math.nan})
    assert read_json(path, "test file") == {"x": 1}
    write_json(path, {"x": math.nan}, allow_nan=True)
    assert math.isnan(read_json(path, "test file")["x"])


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    write_json(path, {"x": 1})
    with pytest.raises(TypeError):
        write_json(path, {"x": object()})
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "missing" / "doc.json", b"{}")
    assert read_json(path, "test file") == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"", "not JSON"), (b'{"a": ', "not JSON"), (b"\xff\xfe\x00", "not UTF-8 text")],
)
def test_bad_files_are_value_errors_naming_file_and_fault(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"bad\.json: corrupt test file \({reason}") as caught:
        read_json(path, "test file")
    assert str(path) in str(caught.value)


def test_a_missing_file_names_what_was_expected(tmp_path: Path) -> None:
    path = tmp_path / "none.json"
    with pytest.raises(FileNotFoundError, match="test file not found") as caught:
        read_json(path, "test file")
    assert caught.value.filename == str(path)
