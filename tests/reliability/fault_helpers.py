"""Shared pieces of the fault and resume tests: tiny data, run options, state comparison."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from idx_data import write_tiny_fashion_mnist

__all__ = [
    "as_flags",
    "assert_bitwise_equal",
    "final_checkpoint",
    "train_options",
    "write_tiny_data",
]


def write_tiny_data(root: Path) -> Path:
    """Random Fashion-MNIST-shaped IDX files under ``root``: 256 train, 64 test images."""
    return write_tiny_fashion_mnist(root, seed=1)


def train_options(data: Path, out: Path, **changes: Any) -> dict[str, Any]:
    """Flat TrainConfig options of a tiny K-FAC run that checkpoints every 5 steps and resumes."""
    options: dict[str, Any] = {
        "data": str(data), "model": "mlp", "epochs": 2, "batch_size": 16, "out_dir": str(out),
        "lr": 0.05, "damping": 0.3, "inv_update_steps": 3, "mixup_alpha": 0.4,
        "random_erasing": 0.5, "label_smoothing": 0.1, "tensorboard": False, "threads": 1,
        "checkpoint_every": 5, "resume": True, "max_steps": 12,
    }  # fmt: skip
    options.update(changes)
    return options


def as_flags(options: dict[str, Any]) -> list[str]:
    """The ``spdkfac train`` flags giving ``options``."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def final_checkpoint(out: Path) -> dict[str, Any]:
    """The common part of the checkpoint ``latest`` points to under ``out``."""
    name = (out / "checkpoints" / "latest").read_text().strip()
    common: dict[str, Any] = torch.load(out / "checkpoints" / name / "common.pt", weights_only=True)
    return common


def assert_bitwise_equal(ours: Any, theirs: Any, where: str = "") -> None:
    """Nested dicts, lists and tensors are equal, tensors bit for bit and in dtype."""
    if isinstance(ours, torch.Tensor):
        assert isinstance(theirs, torch.Tensor), where
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            assert_bitwise_equal(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_bitwise_equal(a, b, f"{where}[{index}]")
    else:
        assert ours == theirs, where


@pytest.fixture
def one_thread() -> Iterator[None]:
    """In-process runs set one intra-op thread (as launched ones do); restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
