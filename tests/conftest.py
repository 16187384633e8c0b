"""Shared fixtures: IDX files written independently of the reader, a tiny Fashion-MNIST."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from idx_data import write_idx, write_tiny_fashion_mnist

__all__ = ["idx_writer", "tiny_fashion_mnist"]

_IdxWriter = Callable[[Path, np.ndarray], Path]


@pytest.fixture
def idx_writer() -> _IdxWriter:
    """Return ``write(path, array)``, gzip-compressing when the name ends in ``.gz``."""
    return write_idx


@pytest.fixture
def tiny_fashion_mnist(tmp_path: Path) -> Path:
    """A directory with random Fashion-MNIST-shaped IDX files: 256 train, 64 test images."""
    return write_tiny_fashion_mnist(tmp_path, seed=0)
