"""Loader for a ``root/<class>/<image>`` tree of PNG/JPEG files, decoded with Pillow."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import TensorDataset

from spdkfac.support.optional import require

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_EXTENSIONS", "load_image_folder"]

#: Per-channel mean and standard deviation of ImageNet, in [0, 1]: the usual defaults.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: File name endings read as images (case-insensitive); other files are ignored.
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg")


def load_image_folder(
    root: str | Path,
    *,
    size: int,
    limit: int | None = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[TensorDataset, tuple[str, ...]]:
    """Load every image under ``root/<class>/`` as one normalized tensor dataset.

    Classes are the sub-directories of ``root`` in sorted order (label ``i`` is the
    ``i``-th name); hidden entries are skipped, and so are files not ending in
    :data:`IMAGE_EXTENSIONS`. Images are converted to RGB and resized to ``size × size``
    with bilinear filtering, ignoring the aspect ratio (as Osawa et al. do for ImageNet).

    Args:
        root: Directory with one sub-directory per class.
        size: Output height and width in pixels, an int >= 1.
        limit: Keep at most ``limit`` images, taken round-robin over the classes (each in
            file-name order) so that a small limit still covers every class.
        mean: Per-channel mean subtracted from pixels in [0, 1].
        std: Per-channel standard deviation the pixels are divided by; pass
            ``mean=(0, 0, 0), std=(1, 1, 1)`` for raw [0, 1] pixels.

    Returns:
        A dataset of float32 images ``[N, 3, size, size]`` and int64 labels ``[N]``,
        ordered by class then file name, and the class names.

    Raises:
        ImportError: If Pillow is missing or fails to import (an
            :class:`~spdkfac.support.optional.OptionalPackageError` naming the package).
        FileNotFoundError: If ``root`` is not a directory.
        ValueError: If an argument is out of range, ``root`` has no class directory or no
            image, or an image cannot be decoded (the message names the file).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    mean_t = _channel_stats("mean", mean, positive=False)
    std_t = _channel_stats("std", std, positive=True)
    image_module = _import_pillow()
    directory = Path(root)
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder {directory} does not exist or is not a directory")
    classes = tuple(
        sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    )
    if not classes:
        raise ValueError(f"image folder {directory} has no class sub-directories")
    per_class = [_image_files(directory / name) for name in classes]
    chosen = _select(per_class, limit)
    if not any(chosen):
        raise ValueError(
            f"image folder {directory} has no {'/'.join(IMAGE_EXTENSIONS)} files in its "
            "class sub-directories"
        )
    images: list[torch.Tensor] = []
    labels: list[int] = []
    for label, files in enumerate(chosen):
        for path in files:
            images.append(_decode(image_module, path, size))
            labels.append(label)
    pixels = torch.stack(images).to(torch.float32).div_(255.0)
    pixels.sub_(mean_t.view(1, 3, 1, 1)).div_(std_t.view(1, 3, 1, 1))
    return TensorDataset(pixels, torch.tensor(labels, dtype=torch.int64)), classes


def _import_pillow() -> ModuleType:
    return require("PIL.Image", "load_image_folder (decoding PNG/JPEG images)")


def _channel_stats(name: str, values: Sequence[float], *, positive: bool) -> torch.Tensor:
    try:
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be three numbers, got {values!r}") from None
    bad = not bool(torch.isfinite(tensor).all()) or (positive and bool((tensor <= 0).any()))
    if tensor.shape != (3,) or bad:
        bound = "positive " if positive else ""
        raise ValueError(f"{name} must be three finite {bound}numbers, got {values!r}")
    return tensor


def _image_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )


def _select(per_class: list[list[Path]], limit: int | None) -> list[list[Path]]:
    if limit is None:
        return per_class
    taken = [0] * len(per_class)
    remaining = limit
    while remaining:
        progressed = False
        for index, files in enumerate(per_class):
            if remaining and taken[index] < len(files):
                taken[index] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            break
    return [files[:count] for files, count in zip(per_class, taken, strict=True)]


def _decode(image_module: ModuleType, path: Path, size: int) -> torch.Tensor:
    try:
        with image_module.open(path) as image:
            rgb = image.convert("RGB").resize((size, size), image_module.Resampling.BILINEAR)
            array = np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow raises all three on bad data
        raise ValueError(f"{path}: cannot decode image ({exc})") from exc
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
