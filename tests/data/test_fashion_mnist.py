"""Tests for the Fashion-MNIST loader on synthetic files and, if present, the real data."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from spdkfac.data import (
    DEFAULT_FASHION_MNIST_DIR,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_fashion_mnist,
)

__all__: list[str] = []

IdxWriter = Callable[[Path, np.ndarray], Path]

TRAIN_SIZE, TEST_SIZE = 6, 4


def _images(count: int, seed: int) -> np.ndarray:
    images = np.random.default_rng(seed).integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[0, 0, 1] = 0, 255  # pin the extremes for the normalization check
    return images


def _write_split(root: Path, writer: IdxWriter, prefix: str, count: int, suffix: str) -> None:
    writer(root / f"{prefix}-images-idx3-ubyte{suffix}", _images(count, seed=count))
    labels = (np.arange(count) % 10).astype(np.uint8)
    writer(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels)


@pytest.fixture(params=[".gz", ""], ids=["gz", "raw"])
def synthetic_root(request: pytest.FixtureRequest, tmp_path: Path, idx_writer: IdxWriter) -> Path:
    suffix: str = request.param
    _write_split(tmp_path, idx_writer, "train", TRAIN_SIZE, suffix)
    _write_split(tmp_path, idx_writer, "t10k", TEST_SIZE, suffix)
    return tmp_path


@pytest.mark.parametrize(("train", "count"), [(True, TRAIN_SIZE), (False, TEST_SIZE)])
def test_shapes_dtypes_and_split(synthetic_root: Path, train: bool, count: int) -> None:
    images, labels = load_fashion_mnist(synthetic_root, train=train).tensors
    assert images.shape == (count, 1, 28, 28)
    assert images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert labels.tolist() == [i % 10 for i in range(count)]


def test_normalization(synthetic_root: Path) -> None:
    images, _ = load_fashion_mnist(synthetic_root, train=True).tensors
    raw = torch.from_numpy(_images(TRAIN_SIZE, seed=TRAIN_SIZE)).float().unsqueeze(1)
    expected = (raw / 255.0 - 0.2860) / 0.3530
    torch.testing.assert_close(images, expected)
    assert images[0, 0, 0, 0].item() == pytest.approx(-0.2860 / 0.3530, abs=1e-6)
    assert images[0, 0, 0, 1].item() == pytest.approx((1 - 0.2860) / 0.3530, abs=1e-6)
    assert (FASHION_MNIST_MEAN, FASHION_MNIST_STD) == (0.2860, 0.3530)


def test_limit_keeps_leading_samples(synthetic_root: Path) -> None:
    full_images, full_labels = load_fashion_mnist(synthetic_root).tensors
    images, labels = load_fashion_mnist(synthetic_root, limit=3).tensors
    assert images.shape[0] == 3
    torch.testing.assert_close(images, full_images[:3])
    torch.testing.assert_close(labels, full_labels[:3])
    assert len(load_fashion_mnist(synthetic_root, limit=100)) == TRAIN_SIZE


@pytest.mark.parametrize("limit", [0, -1])
def test_rejects_bad_limit(synthetic_root: Path, limit: int) -> None:
    with pytest.raises(ValueError, match="limit"):
        load_fashion_mnist(synthetic_root, limit=limit)


def test_missing_directory_explains_how_to_get_data(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        load_fashion_mnist(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--data DIR" in message


def test_missing_file_names_it(tmp_path: Path, idx_writer: IdxWriter) -> None:
    idx_writer(tmp_path / "train-images-idx3-ubyte.gz", _images(2, seed=0))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "train-labels"))):
        load_fashion_mnist(tmp_path)


def test_label_count_mismatch(tmp_path: Path, idx_writer: IdxWriter) -> None:
    idx_writer(tmp_path / "train-images-idx3-ubyte", _images(3, seed=0))
    idx_writer(tmp_path / "train-labels-idx1-ubyte", np.zeros(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="2 labels for 3 images"):
        load_fashion_mnist(tmp_path)


def test_label_out_of_range(tmp_path: Path, idx_writer: IdxWriter) -> None:
    idx_writer(tmp_path / "train-images-idx3-ubyte", _images(2, seed=0))
    idx_writer(tmp_path / "train-labels-idx1-ubyte", np.array([1, 10], dtype=np.uint8))
    with pytest.raises(ValueError, match="label 10 out of range"):
        load_fashion_mnist(tmp_path)


def test_wrong_image_shape(tmp_path: Path, idx_writer: IdxWriter) -> None:
    idx_writer(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 32, 32), dtype=np.uint8))
    idx_writer(tmp_path / "train-labels-idx1-ubyte", np.zeros(2, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[N, 28, 28\]"):
        load_fashion_mnist(tmp_path)


def test_real_dataset() -> None:
    if not DEFAULT_FASHION_MNIST_DIR.is_dir():
        pytest.skip(
            f"{DEFAULT_FASHION_MNIST_DIR} not found (apt-get install dataset-fashion-mnist)"
        )
    train_images, train_labels = load_fashion_mnist(train=True).tensors
    test_images, test_labels = load_fashion_mnist(train=False).tensors
    assert train_images.shape == (60_000, 1, 28, 28)
    assert test_images.shape == (10_000, 1, 28, 28)
    for labels, count in ((train_labels, 60_000), (test_labels, 10_000)):
        assert labels.shape == (count,)
        assert int(labels.min()) == 0
        assert int(labels.max()) == len(FASHION_MNIST_CLASSES) - 1
        # Both splits are exactly class-balanced.
        assert torch.bincount(labels).tolist() == [count // 10] * 10
    # The published mean/std standardize the training split.
    assert train_images.mean().item() == pytest.approx(0.0, abs=0.01)
    assert train_images.std().item() == pytest.approx(1.0, abs=0.01)
