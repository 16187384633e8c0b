"""Datasets and augmentations: IDX, Fashion-MNIST, CIFAR-10, image folders, byte-level text
(a corpus or the GCIDE dictionary), batch transforms."""

from __future__ import annotations

from spdkfac.data.augment import (
    RunningMixup,
    random_crop_flip,
    random_erasing,
    soft_cross_entropy,
)
from spdkfac.data.cifar10 import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, load_cifar10
from spdkfac.data.fashion_mnist import (
    DEFAULT_FASHION_MNIST_DIR,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_fashion_mnist,
)
from spdkfac.data.gcide import DEFAULT_GCIDE_PATH, load_gcide_corpus
from spdkfac.data.idx import read_idx
from spdkfac.data.imagefolder import (
    IMAGE_EXTENSIONS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    load_image_folder,
)
from spdkfac.data.text import (
    DEFAULT_TEXT_PATH,
    TextCorpus,
    TextCorpusError,
    TextWindows,
    load_text_corpus,
)

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DEFAULT_FASHION_MNIST_DIR",
    "DEFAULT_GCIDE_PATH",
    "DEFAULT_TEXT_PATH",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "RunningMixup",
    "TextCorpus",
    "TextCorpusError",
    "TextWindows",
    "load_cifar10",
    "load_fashion_mnist",
    "load_gcide_corpus",
    "load_image_folder",
    "load_text_corpus",
    "random_crop_flip",
    "random_erasing",
    "read_idx",
    "soft_cross_entropy",
]
