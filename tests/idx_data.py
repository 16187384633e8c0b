"""IDX files written independently of the reader, and a tiny random Fashion-MNIST."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

__all__ = ["write_idx", "write_tiny_fashion_mnist"]

_TYPE_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}


def write_idx(path: Path, array: np.ndarray) -> Path:
    header = bytes([0, 0, _TYPE_CODES[array.dtype], array.ndim])
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if path.suffix == ".gz":
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


def write_tiny_fashion_mnist(root: Path, seed: int) -> Path:
    """Random Fashion-MNIST-shaped IDX files under ``root``: 256 train, 64 test images."""
    generator = np.random.default_rng(seed)
    for prefix, count in (("train", 256), ("t10k", 64)):
        images = generator.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = generator.integers(0, 10, size=(count,), dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels)
    return root
