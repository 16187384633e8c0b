"""The byte-level text corpus: reading rules, positional splits, windows, errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spdkfac.data.text import (
    DEFAULT_TEXT_PATH,
    TextCorpusError,
    TextWindows,
    corpus_files,
    load_text_corpus,
    read_corpus_bytes,
    split_bounds,
)

__all__: list[str] = []


def _write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_split_bounds_are_90_5_5_by_position() -> None:
    assert split_bounds(1000) == [(0, 900), (900, 950), (950, 1000)]
    assert split_bounds(101) == [(0, 90), (90, 95), (95, 101)]


def test_a_file_is_split_by_position(tmp_path: Path) -> None:
    content = bytes(range(256)) * 4  # 1024 bytes
    corpus = load_text_corpus(_write(tmp_path / "t.txt", content), seq_len=8)
    assert corpus.train.dtype == torch.uint8
    assert bytes(corpus.train.tolist()) == content[:921]
    assert bytes(corpus.validation.tolist()) == content[921:972]
    assert bytes(corpus.test.tolist()) == content[972:]


def test_a_directory_joins_its_regular_files_sorted_by_path(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    _write(root / "b", b"BBB")
    _write(root / "a", b"AAA")
    _write(root / "sub" / "c", b"CCC")
    _write(root / "a.dat", b"index")  # fortune's index files are left out
    _write(tmp_path / "outside" / "d", b"DDD")
    os.symlink(root / "a", root / "z-link")  # symbolic links too, to files
    os.symlink(tmp_path / "outside", root / "linked-dir")  # and to directories
    assert [p.relative_to(root).as_posix() for p in corpus_files(root)] == ["a", "b", "sub/c"]
    assert read_corpus_bytes(root) == b"AAA\nBBB\nCCC"


def test_missing_or_empty_paths_name_themselves(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"{missing} does not exist.*fortunes"):
        load_text_corpus(missing, seq_len=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TextCorpusError, match="holds no text"):
        read_corpus_bytes(tmp_path / "empty")


def test_too_short_a_text_names_the_path_and_the_split(tmp_path: Path) -> None:
    path = _write(tmp_path / "short.txt", b"x" * 100)  # test split: 5 bytes
    assert load_text_corpus(path, seq_len=4).test.numel() == 5
    with pytest.raises(ValueError, match=f"{path} has 100 bytes: its validation split gets 5"):
        load_text_corpus(path, seq_len=5)


def test_evaluation_windows_are_consecutive_and_shifted_by_one() -> None:
    data = torch.arange(23, dtype=torch.uint8)
    windows = TextWindows(data, seq_len=5)
    assert len(windows) == 4  # (23 - 1) // 5
    inputs, targets = windows.tensors()
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (4, 5)
    assert inputs[:, 0].tolist() == [0, 5, 10, 15]
    assert torch.equal(targets, inputs + 1)
    x, y = windows[3]
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        windows[4]


def test_training_windows_start_at_seeded_random_offsets_within_their_stretch() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    windows = TextWindows(data, seq_len=8)
    indices = list(range(len(windows))) * 20
    starts = windows.starts(indices, torch.Generator().manual_seed(1))
    base = torch.tensor(indices) * 8
    assert (starts >= base).all() and (starts < base + 8).all()
    assert int(starts.max()) <= windows.max_start == 200 - 9
    assert len(set((starts - base).tolist())) == 8  # every alignment is drawn
    again = windows.starts(indices, torch.Generator().manual_seed(1))
    other = windows.starts(indices, torch.Generator().manual_seed(2))
    assert torch.equal(starts, again) and not torch.equal(starts, other)
    inputs, targets = windows.batch([0, 5], torch.Generator().manual_seed(3))
    assert inputs.shape == (2, 8) and torch.equal(targets, inputs + 1)


def test_windows_need_one_window_of_text() -> None:
    with pytest.raises(TextCorpusError):
        TextWindows(torch.zeros(4, dtype=torch.uint8), seq_len=4)
    with pytest.raises(ValueError, match="seq_len"):
        TextWindows(torch.zeros(4, dtype=torch.uint8), seq_len=0)


@pytest.mark.skipif(not DEFAULT_TEXT_PATH.is_dir(), reason="Debian's fortunes not installed")
def test_the_fortunes_corpus() -> None:
    files = corpus_files(DEFAULT_TEXT_PATH)
    assert files and not any(f.name.endswith(".dat") or f.is_symlink() for f in files)
    corpus = load_text_corpus(seq_len=128)
    total = corpus.train.numel() + corpus.validation.numel() + corpus.test.numel()
    assert total > 100_000
    assert corpus.train.numel() == int(total * 0.9)
    assert b"\n" in bytes(corpus.validation[:2000].tolist())
