"""Tests for the image-folder loader on a few generated PNG and JPEG files."""

from __future__ import annotations

import builtins
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spdkfac.data import IMAGENET_MEAN, IMAGENET_STD, load_image_folder

Image = pytest.importorskip("PIL.Image")

__all__: list[str] = []

RAW = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def _solid(
    path: Path, color: tuple[int, int, int], *, size: tuple[int, int] = (6, 4), mode: str = "RGB"
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, color)
    image.convert(mode).save(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _solid(tmp_path / "dog" / "b.png", (0, 255, 0))
    _solid(tmp_path / "dog" / "a.PNG", (255, 0, 0), size=(3, 9))
    _solid(tmp_path / "dog" / "c.jpg", (0, 0, 255))
    _solid(tmp_path / "cat" / "z.png", (200, 200, 200), mode="L")
    _solid(tmp_path / "cat" / "y.png", (10, 20, 30), mode="RGBA")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    _solid(tmp_path / ".hidden" / "x.png", (1, 2, 3))
    (tmp_path / "README").write_text("a file at the top level")
    return tmp_path


def test_loads_classes_labels_and_pixels(tree: Path) -> None:
    dataset, classes = load_image_folder(tree, size=5, **RAW)
    images, labels = dataset.tensors
    assert classes == ("cat", "dog")
    assert labels.tolist() == [0, 0, 1, 1, 1]
    assert images.shape == (5, 3, 5, 5) and images.dtype == torch.float32
    expected = [(10, 20, 30), (200, 200, 200), (255, 0, 0), (0, 255, 0), (0, 0, 255)]
    for image, color in zip(images, expected, strict=True):
        center = image[:, 2, 2] * 255
        # JPEG is lossy; the PNGs are exact (a solid color survives the resize)
        torch.testing.assert_close(center, torch.tensor(color, dtype=torch.float32), atol=6, rtol=0)
    torch.testing.assert_close(
        images[2] * 255, torch.tensor([255.0, 0, 0]).view(3, 1, 1).expand(3, 5, 5)
    )


def test_normalizes_with_imagenet_statistics(tree: Path) -> None:
    raw, _ = load_image_folder(tree, size=4, **RAW)
    normalized, _ = load_image_folder(tree, size=4)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(normalized.tensors[0], (raw.tensors[0] - mean) / std)


def test_resize_matches_pillow(tmp_path: Path) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    (tmp_path / "only").mkdir()
    Image.fromarray(pixels).save(tmp_path / "only" / "img.jpeg")
    dataset, classes = load_image_folder(tmp_path, size=8, **RAW)
    with Image.open(tmp_path / "only" / "img.jpeg") as decoded:  # JPEG is lossy: compare
        expected = np.array(decoded.resize((8, 8), Image.Resampling.BILINEAR))
    torch.testing.assert_close(
        dataset.tensors[0][0] * 255,
        torch.from_numpy(expected).permute(2, 0, 1).float(),
        atol=1e-4,
        rtol=0,
    )
    assert classes == ("only",)


def test_limit_is_round_robin_over_classes(tree: Path) -> None:
    for limit, expected in [
        (1, [0]),
        (2, [0, 1]),
        (3, [0, 0, 1]),
        (4, [0, 0, 1, 1]),
        (5, [0, 0, 1, 1, 1]),
        (99, [0, 0, 1, 1, 1]),
    ]:
        dataset, _ = load_image_folder(tree, size=2, limit=limit, **RAW)
        assert dataset.tensors[1].tolist() == expected
    dataset, _ = load_image_folder(tree, size=4, limit=3, **RAW)
    assert dataset.tensors[0][2, 0, 0, 0].item() == pytest.approx(1.0)  # dog/a.PNG: red


def test_errors_name_the_problem(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_image_folder(missing, size=4)
    with pytest.raises(ValueError, match="no class sub-directories"):
        load_image_folder(tmp_path, size=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape("no .png/.jpg/.jpeg files")):
        load_image_folder(tmp_path, size=4)
    broken = tmp_path / "empty" / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match=re.escape(f"{broken}: cannot decode image")):
        load_image_folder(tmp_path, size=4)
    for kwargs, name in [
        ({"size": 0}, "size"),
        ({"size": 4, "limit": 0}, "limit"),
        ({"size": 4, "std": (1.0, 0.0, 1.0)}, "std"),
        ({"size": 4, "mean": (0.5, 0.5)}, "mean"),
    ]:
        with pytest.raises(ValueError, match=name):
            load_image_folder(tmp_path, **kwargs)


def test_missing_pillow_is_a_clear_import_error(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_pil(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(ImportError, match="pip install pillow"):
        load_image_folder(tree, size=4)
