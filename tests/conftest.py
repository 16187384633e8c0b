"""Shared fixtures: IDX files written independently of the reader, a tiny Fashion-MNIST."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from idx_data import write_idx, write_tiny_fashion_mnist

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Under pytest-xdist each worker gets its share of the cores (set before the tests
    # import torch): without it every worker's torch would use them all.
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))

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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fork server of ``run_distributed`` (tests/distributed_helper.py) when the
    collected tests import it: it imports torch while the first tests run."""
    helper = sys.modules.get("distributed_helper")
    if helper is not None and not session.config.option.collectonly:
        helper.start_fork_server()
