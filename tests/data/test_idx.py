"""Tests for the IDX reader: round trips, compression and malformed input."""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from spdkfac.data import read_idx

__all__: list[str] = []

IdxWriter = Callable[[Path, np.ndarray], Path]


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([9, 0, 3, 255, 7], dtype=np.uint8),
        np.array([[1, -2], [70000, -70000]], dtype=np.int32),
        np.array([0.5, -1.25, 3e7], dtype=np.float32),
    ],
    ids=["uint8-3d", "uint8-1d", "int32-2d", "float32-1d"],
)
def test_round_trip(tmp_path: Path, idx_writer: IdxWriter, array: np.ndarray, suffix: str) -> None:
    path = idx_writer(tmp_path / f"data-idx{suffix}", array)
    result = read_idx(path)
    assert result.dtype == array.dtype
    assert result.dtype.isnative
    np.testing.assert_array_equal(result, array)
    assert result.flags.writeable


def test_gzip_detected_by_content_not_name(tmp_path: Path, idx_writer: IdxWriter) -> None:
    array = np.arange(6, dtype=np.uint8)
    compressed = idx_writer(tmp_path / "labels.gz", array)
    renamed = compressed.rename(tmp_path / "labels-idx1-ubyte")
    np.testing.assert_array_equal(read_idx(renamed), array)


def _valid_bytes() -> bytes:
    # uint8, 2-D, shape (2, 3), six data bytes.
    return bytes([0, 0, 0x08, 2]) + (2).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes(6)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "too short"),
        (b"\x00\x00", "too short"),
        (b"\x01" + _valid_bytes()[1:], "bad IDX magic"),
        (_valid_bytes()[:2] + b"\x07" + _valid_bytes()[3:], "bad IDX magic"),
        (_valid_bytes()[:9], "truncated IDX header"),
        (_valid_bytes()[:-1], "truncated"),
        (_valid_bytes() + b"\x00", "trailing bytes"),
        (gzip.compress(_valid_bytes())[:-6], "gzip"),
    ],
    ids=[
        "empty",
        "short",
        "nonzero-magic",
        "unknown-type",
        "short-header",
        "short-data",
        "trailing",
        "truncated-gzip",
    ],
)
def test_malformed_file_names_path(tmp_path: Path, payload: bytes, message: str) -> None:
    path = tmp_path / "broken-idx"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        read_idx(path)
    assert message in str(info.value)


def test_valid_payload_is_accepted(tmp_path: Path) -> None:
    # Guards the malformed-file cases above: the unmodified payload must parse.
    path = tmp_path / "ok-idx"
    path.write_bytes(_valid_bytes())
    assert read_idx(path).shape == (2, 3)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_idx(tmp_path / "absent-idx")
