"""CIFAR-10 loader reading the official python (pickle) or binary batch files."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["CIFAR10_CLASSES", "CIFAR10_MEAN", "CIFAR10_STD", "load_cifar10"]

CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

#: Per-channel mean and standard deviation of the 50,000 training images, in [0, 1].
CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)

_BatchReader = Callable[[Path], tuple[np.ndarray, np.ndarray]]
_PIXELS = 3 * 32 * 32
_RECORD = 1 + _PIXELS  # binary format: one label byte, then the pixels
_HOW_TO_GET = (
    "download cifar-10-python.tar.gz or cifar-10-binary.tar.gz from "
    "https://www.cs.toronto.edu/~kriz/cifar.html, extract it, and pass the directory "
    "with `--data DIR`"
)
# What unpickling a CIFAR batch may construct: numpy arrays and dtypes, nothing else
# (``_codecs.encode`` is how Python 3 writes bytes at protocol 2; it only encodes text).
_ALLOWED_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}


def load_cifar10(
    root: str | Path, *, train: bool = True, limit: int | None = None
) -> TensorDataset:
    """Load one CIFAR-10 split as normalized tensors.

    Looks for the python batches (``data_batch_1`` … ``data_batch_5``, ``test_batch``) and
    then the binary ones (``data_batch_1.bin`` …, ``test_batch.bin``), in ``root`` itself,
    then in ``root/cifar-10-batches-py`` and ``root/cifar-10-batches-bin`` (the folders the
    official archives extract to). Pickles are read with an unpickler that can build only
    numpy arrays, so a tampered file cannot run code.

    Args:
        root: Directory holding the batches or the extracted archive folder.
        train: Load the 50,000-image training split if true, else the 10,000-image test
            split.
        limit: Keep only the first ``limit`` samples (later files are not read).

    Returns:
        A dataset of float32 images ``[N, 3, 32, 32]`` standardized per channel with
        :data:`CIFAR10_MEAN` and :data:`CIFAR10_STD`, and int64 labels ``[N]``.

    Raises:
        FileNotFoundError: If ``root`` or the batch files are missing; the message names the
            paths tried and how to get the data.
        ValueError: If ``limit`` is not positive or a file is malformed (the message names
            the file).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    directory = Path(root)
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(f"CIFAR-10 directory {directory} {state}; {_HOW_TO_GET}")
    files, reader = _find_batches(directory, train)
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    count = 0
    for path in files:
        if limit is not None and count >= limit:
            break
        batch_images, batch_labels = reader(path)
        images.append(batch_images)
        labels.append(batch_labels)
        count += len(batch_labels)
    pixels = np.concatenate(images)[:limit]
    targets = np.concatenate(labels)[:limit]
    tensor = torch.from_numpy(pixels).reshape(-1, 3, 32, 32).to(torch.float32).div_(255.0)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    tensor.sub_(mean).div_(std)
    return TensorDataset(tensor, torch.from_numpy(targets).to(torch.int64))


def _find_batches(directory: Path, train: bool) -> tuple[list[Path], _BatchReader]:
    stems = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    tried: list[Path] = []
    for folder in (
        directory,
        directory / "cifar-10-batches-py",
        directory / "cifar-10-batches-bin",
    ):
        formats: tuple[tuple[str, _BatchReader], ...] = (
            ("", _read_pickle_batch),
            (".bin", _read_binary_batch),
        )
        for suffix, reader in formats:
            files = [folder / f"{stem}{suffix}" for stem in stems]
            present = [path.is_file() for path in files]
            if all(present):
                return files, reader
            if any(present):
                missing = ", ".join(str(p) for p, ok in zip(files, present, strict=True) if not ok)
                raise FileNotFoundError(
                    f"CIFAR-10 split in {folder} is incomplete: missing {missing}; {_HOW_TO_GET}"
                )
            tried.append(files[0])
    split = "training" if train else "test"
    raise FileNotFoundError(
        f"CIFAR-10 {split} batches not found; tried {', '.join(str(p) for p in tried)}; "
        f"{_HOW_TO_GET}"
    )


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def _read_pickle_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as stream:
            # The official batches were pickled by Python 2: keys come back as bytes.
            batch = _ArrayUnpickler(stream, encoding="bytes").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
        ImportError,
        OverflowError,
    ) as exc:
        raise ValueError(f"{path}: not a readable CIFAR-10 pickle batch ({exc})") from exc
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a dict, got {type(batch).__name__}")
    data = _field(batch, "data", path)
    raw_labels = _field(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"{path}: 'data' must be a 2-D uint8 array, got {_describe(data)}")
    if data.shape[1] != _PIXELS:
        raise ValueError(f"{path}: 'data' rows must hold {_PIXELS} pixels, got {data.shape[1]}")
    try:
        labels = np.asarray(raw_labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: 'labels' is not a list of ints ({exc})") from exc
    return data, _check_labels(labels, data.shape[0], path)


def _field(batch: dict[Any, Any], key: str, path: Path) -> Any:
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    raise ValueError(f"{path}: missing key {key!r}")


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def _read_binary_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % _RECORD:
        raise ValueError(
            f"{path}: size {raw.size} bytes is not a positive multiple of the "
            f"{_RECORD}-byte CIFAR-10 record"
        )
    records = raw.reshape(-1, _RECORD)
    return records[:, 1:], _check_labels(records[:, 0].astype(np.int64), len(records), path)


def _check_labels(labels: np.ndarray, count: int, path: Path) -> np.ndarray:
    if labels.shape != (count,):
        raise ValueError(f"{path}: {list(labels.shape)} labels for {count} images")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CIFAR10_CLASSES)):
        raise ValueError(f"{path}: labels must be in [0, 10), got [{labels.min()}, {labels.max()}]")
    return labels
