"""A byte-level text corpus (vocabulary 256) split by position, as windows of next-byte pairs.

The default corpus is Debian's ``fortunes`` package (``/usr/share/games/fortunes``,
fortune-mod's BSD-licensed cookie files; ``apt-get install fortunes``). Any text file or
directory works: a directory contributes every regular file under it, sorted by path,
except ``.dat`` files (fortune's indexes) and symbolic links, joined by newlines.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "DEFAULT_TEXT_PATH",
    "TEXT_SPLITS",
    "VOCAB_SIZE",
    "TextCorpus",
    "TextCorpusError",
    "TextWindows",
    "corpus_files",
    "load_text_corpus",
    "read_corpus_bytes",
    "split_bounds",
]

DEFAULT_TEXT_PATH = Path("/usr/share/games/fortunes")
"""Where the Debian package ``fortunes`` installs its cookie files."""

VOCAB_SIZE = 256
"""One token per byte value."""

TEXT_SPLITS: tuple[str, ...] = ("train", "validation", "test")
_TRAIN_END, _VALIDATION_END = 0.90, 0.95  # fractions of the bytes: 90 %, 5 %, 5 %
_HOW_TO_GET = (
    "install Debian's fortunes package (`apt-get install fortunes`, or "
    "scripts/ensure_fortunes.sh) or pass a text file or directory with `--data PATH`"
)


class TextCorpusError(ValueError):
    """The corpus path is missing, holds no text, or is too short for the windows."""


def corpus_files(root: Path) -> list[Path]:
    """The files a directory contributes: regular files under it, sorted by path.

    Skips symbolic links (to files or directories) and files whose name ends in ``.dat``.
    """
    found: list[Path] = []
    for directory, _, names in os.walk(root, followlinks=False):
        for name in names:
            path = Path(directory) / name
            if not name.endswith(".dat") and not path.is_symlink() and path.is_file():
                found.append(path)
    return sorted(found)


def read_corpus_bytes(path: str | Path | None = None) -> bytes:
    """The corpus as bytes: a file's content, or a directory's files joined by ``b"\\n"``.

    Args:
        path: A file or directory; None: :data:`DEFAULT_TEXT_PATH`.

    Raises:
        TextCorpusError: The path does not exist or holds no bytes (the message names it).
    """
    source = DEFAULT_TEXT_PATH if path is None else Path(path)
    if source.is_file():
        raw = source.read_bytes()
    elif source.is_dir():
        raw = b"\n".join(f.read_bytes() for f in corpus_files(source))
    else:
        raise TextCorpusError(f"text corpus {source} does not exist; {_HOW_TO_GET}")
    if not raw:
        raise TextCorpusError(f"text corpus {source} holds no text; {_HOW_TO_GET}")
    return raw


def split_bounds(
    length: int, ends: tuple[float, float] = (_TRAIN_END, _VALIDATION_END)
) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of the train (90 %), validation and test (5 % each) splits
    (``ends``: where train and validation end, as fractions of the length)."""
    train_end = int(length * ends[0])
    validation_end = int(length * ends[1])
    return [(0, train_end), (train_end, validation_end), (validation_end, length)]


@dataclass(frozen=True)
class TextCorpus:
    """The three splits of a corpus as ``uint8`` tensors, in text order."""

    path: Path
    train: Tensor
    validation: Tensor
    test: Tensor


def load_text_corpus(path: str | Path | None = None, *, seq_len: int) -> TextCorpus:
    """Read a corpus and split it by position: first 90 % train, next 5 %, last 5 %.

    Args:
        path: A text file or directory (see :func:`read_corpus_bytes`); None: the
            ``fortunes`` package.
        seq_len: Window length; every split must hold at least ``seq_len + 1`` bytes.

    Raises:
        TextCorpusError: The path is missing or empty, or a split is shorter than one
            window (the message names the path, its size and the split).
    """
    source = DEFAULT_TEXT_PATH if path is None else Path(path)
    raw = read_corpus_bytes(source)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    parts = [data[start:end] for start, end in split_bounds(len(data))]
    for name, part in zip(TEXT_SPLITS, parts, strict=True):
        if len(part) < seq_len + 1:
            raise TextCorpusError(
                f"text corpus {source} has {len(data)} bytes: its {name} split gets "
                f"{len(part)}, fewer than one window of --seq-len + 1 = {seq_len + 1}; use a "
                "longer text or a shorter --seq-len"
            )
    return TextCorpus(source, *parts)


class TextWindows(Dataset[tuple[Tensor, Tensor]]):
    """Windows of ``seq_len + 1`` bytes of one split: ``x = b[s:s+T]``, ``y = b[s+1:s+T+1]``.

    Window ``i`` starts at ``i·T`` (``T = seq_len``), so consecutive windows' inputs do not
    overlap and together cover the split (but for a tail shorter than ``T``):
    ``len = (bytes - 1) // T``. :meth:`batch` with a generator instead starts window ``i``
    at a random offset in ``[i·T, i·T + T)`` (clipped to the split), so training sees every
    alignment while a sampler still visits each stretch of text once per epoch. With
    ``random_offsets=False`` every window keeps its fixed start: windows then share no
    byte they predict, so an epoch trains on each byte of the split at most once (a corpus
    larger than a run's reading never repeats text within the run).

    Raises:
        TextCorpusError: ``data`` is shorter than ``seq_len + 1`` bytes.
        ValueError: ``seq_len`` is not a positive int.
    """

    def __init__(self, data: Tensor, seq_len: int, *, random_offsets: bool = True) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if data.dim() != 1 or len(data) < seq_len + 1:
            raise TextCorpusError(
                f"need a 1-D text of at least seq_len + 1 = {seq_len + 1} bytes, "
                f"got shape {list(data.shape)}"
            )
        self.data = data
        self.seq_len = seq_len
        self.random_offsets = random_offsets
        self.max_start = len(data) - seq_len - 1
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.max_start // self.seq_len + 1

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        x, y = self.batch([index % len(self)])
        return x[0], y[0]

    def starts(
        self, indices: Sequence[int] | Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        """First byte of each window; random within its stretch when ``generator`` is given
        (and ``random_offsets``)."""
        base = torch.as_tensor(indices, dtype=torch.int64) * self.seq_len
        if generator is None or not self.random_offsets:
            return base
        span = (self.max_start - base + 1).clamp(max=self.seq_len)
        draw = torch.rand(len(base), generator=generator, dtype=torch.float64)
        return base + (draw * span).to(torch.int64).clamp(max=span - 1)

    def batch(
        self, indices: Sequence[int] | Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Inputs and next-byte targets ``[len(indices), seq_len]``, int64."""
        windows = self.data[self.starts(indices, generator)[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def tensors(self) -> tuple[Tensor, Tensor]:
        """Every window at its fixed start (evaluation): inputs and targets, int64."""
        return self.batch(torch.arange(len(self)))
