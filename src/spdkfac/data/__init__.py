"""Datasets: an IDX reader and the Fashion-MNIST loader."""

from __future__ import annotations

from spdkfac.data.fashion_mnist import (
    DEFAULT_FASHION_MNIST_DIR,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_fashion_mnist,
)
from spdkfac.data.idx import read_idx

__all__ = [
    "DEFAULT_FASHION_MNIST_DIR",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "load_fashion_mnist",
    "read_idx",
]
