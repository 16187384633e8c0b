"""Fashion-MNIST loader reading the IDX files shipped by Debian's dataset package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from spdkfac.data.idx import read_idx

__all__ = [
    "DEFAULT_FASHION_MNIST_DIR",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "load_fashion_mnist",
]

DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs the files."""

FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

_IMAGE_SIZE = 28
_HOW_TO_GET = (
    "install it with `apt-get install dataset-fashion-mnist` or pass the directory holding "
    "the IDX files with `--data DIR`"
)


def load_fashion_mnist(
    root: str | Path | None = None, *, train: bool = True, limit: int | None = None
) -> TensorDataset:
    """Load one Fashion-MNIST split as normalized tensors.

    Args:
        root: Directory with ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` files, each
            either gzip-compressed (``.gz``) or raw. Defaults to
            :data:`DEFAULT_FASHION_MNIST_DIR`.
        train: Load the 60,000-image training split if true, else the 10,000-image test
            split.
        limit: Keep only the first ``limit`` samples.

    Returns:
        A dataset of float32 images ``[N, 1, 28, 28]`` standardized with
        :data:`FASHION_MNIST_MEAN` and :data:`FASHION_MNIST_STD`, and int64 labels ``[N]``.

    Raises:
        FileNotFoundError: If the directory or a file is missing; the message names the
            path and how to get the data.
        ValueError: If ``limit`` is not positive or the files are malformed or inconsistent.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    directory = DEFAULT_FASHION_MNIST_DIR if root is None else Path(root)
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(f"Fashion-MNIST directory {directory} {state}; {_HOW_TO_GET}")
    prefix = "train" if train else "t10k"
    images_path = _find_file(directory, f"{prefix}-images-idx3-ubyte")
    labels_path = _find_file(directory, f"{prefix}-labels-idx1-ubyte")
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    _check_split(images, labels, images_path, labels_path)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    pixels = torch.from_numpy(images).to(torch.float32).div_(255.0).unsqueeze(1)
    pixels.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD)
    targets = torch.from_numpy(labels).to(torch.int64)
    return TensorDataset(pixels, targets)


def _find_file(directory: Path, stem: str) -> Path:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file {directory / stem}.gz (or {directory / stem}) not found; {_HOW_TO_GET}"
    )


def _check_split(
    images: np.ndarray, labels: np.ndarray, images_path: Path, labels_path: Path
) -> None:
    if images.dtype != np.uint8 or images.shape[1:] != (_IMAGE_SIZE, _IMAGE_SIZE):
        raise ValueError(
            f"{images_path}: expected uint8 images of shape [N, 28, 28], "
            f"got {images.dtype} {list(images.shape)}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(
            f"{labels_path}: expected 1-D uint8 labels, got {labels.dtype} {list(labels.shape)}"
        )
    if labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"{labels_path}: {labels.shape[0]} labels for {images.shape[0]} images in {images_path}"
        )
    if labels.size and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"{labels_path}: label {int(labels.max())} out of range [0, 10)")
