"""Tests for the CIFAR-10 loader on tiny synthetic pickle and binary batches."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from spdkfac.data import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, load_cifar10

__all__: list[str] = []

PER_BATCH = 3  # images per synthetic training batch; the test batch has 4
TRAIN_STEMS = [f"data_batch_{i}" for i in range(1, 6)]


def _split(seed: int, count: int) -> tuple[np.ndarray, list[int]]:
    """Rows of 3072 bytes in CIFAR's layout: 1024 red, 1024 green, 1024 blue, row-major."""
    data = np.random.default_rng(seed).integers(0, 256, size=(count, 3072), dtype=np.uint8)
    labels = [(seed + i) % 10 for i in range(count)]
    return data, labels


def _short_string(raw: bytes) -> bytes:
    return b"U" + bytes([len(raw)]) + raw  # SHORT_BINSTRING: a Python 2 str


def _python2_pickle(data: np.ndarray, labels: list[int]) -> bytes:
    """The opcodes Python 2's cPickle wrote for the official batches (numpy.core paths)."""
    raw = data.tobytes()
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85"
        + _short_string(b"b")
        + b"\x87R(K\x01J"
        + struct.pack("<i", data.shape[0])
        + b"M\x00\x0c\x86cnumpy\ndtype\n"
        + _short_string(b"u1")
        + b"K\x00K\x01\x87R(K\x03"
        + _short_string(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T"
        + struct.pack("<I", len(raw))
        + raw
        + b"tb"
    )
    label_list = b"](" + b"".join(b"K" + bytes([label]) for label in labels) + b"e"
    return (
        b"\x80\x02}("
        + _short_string(b"data")
        + array
        + _short_string(b"labels")
        + label_list
        + b"u."
    )


def _write_pickle(path: Path, data: np.ndarray, labels: list[int], *, fmt: str) -> None:
    if fmt == "py2":
        path.write_bytes(_python2_pickle(data, labels))
    elif fmt == "py3-proto2":  # bytes keys, written by Python 3 (bytes go via _codecs)
        batch = {b"batch_label": b"x", b"labels": labels, b"data": data, b"filenames": []}
        path.write_bytes(pickle.dumps(batch, protocol=2))
    else:
        path.write_bytes(pickle.dumps({"labels": labels, "data": data}, protocol=5))


def _write_binary(path: Path, data: np.ndarray, labels: list[int]) -> None:
    records = np.concatenate([np.array(labels, dtype=np.uint8)[:, None], data], axis=1)
    path.write_bytes(records.tobytes())


def _write_dataset(folder: Path, fmt: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    splits = [(stem, _split(seed, PER_BATCH)) for seed, stem in enumerate(TRAIN_STEMS)]
    splits.append(("test_batch", _split(42, 4)))
    for stem, (data, labels) in splits:
        if fmt == "bin":
            _write_binary(folder / f"{stem}.bin", data, labels)
        else:
            _write_pickle(folder / stem, data, labels, fmt=fmt)


def _expected(seeds: list[int], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    for seed in seeds:
        data, batch_labels = _split(seed, count)
        for row, label in zip(data, batch_labels, strict=True):
            image = torch.empty(3, 32, 32)
            for channel in range(3):
                for y in range(32):
                    start = channel * 1024 + y * 32
                    values = torch.tensor(row[start : start + 32], dtype=torch.float32) / 255
                    image[channel, y] = (values - CIFAR10_MEAN[channel]) / CIFAR10_STD[channel]
            images.append(image)
            labels.append(label)
    return torch.stack(images), torch.tensor(labels)


@pytest.mark.parametrize("fmt", ["py2", "py3-proto2", "py3-proto5", "bin"])
@pytest.mark.parametrize("layout", ["flat", "archive"])
def test_loads_both_splits(tmp_path: Path, fmt: str, layout: str) -> None:
    folder = f"cifar-10-batches-{'bin' if fmt == 'bin' else 'py'}"
    _write_dataset(tmp_path / folder if layout == "archive" else tmp_path, fmt)
    images, labels = load_cifar10(tmp_path).tensors
    assert images.shape == (15, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    expected_images, expected_labels = _expected(list(range(5)), PER_BATCH)
    torch.testing.assert_close(images, expected_images)
    assert torch.equal(labels, expected_labels)
    test_images, test_labels = load_cifar10(str(tmp_path), train=False).tensors
    expected_images, expected_labels = _expected([42], 4)
    torch.testing.assert_close(test_images, expected_images)
    assert torch.equal(test_labels, expected_labels)


def test_pixel_layout_and_constants(tmp_path: Path) -> None:
    _write_dataset(tmp_path, "bin")
    data = np.zeros((1, 3072), dtype=np.uint8)
    data[0, 1024 + 32 * 5 + 7] = 255  # green, row 5, column 7
    _write_binary(tmp_path / "test_batch.bin", data, [9])
    images, labels = load_cifar10(tmp_path, train=False).tensors
    assert images[0, 1, 5, 7].item() == pytest.approx((1 - 0.4822) / 0.2435, rel=1e-6)
    assert images[0, 0, 5, 7].item() == pytest.approx(-0.4914 / 0.2470, rel=1e-6)
    assert labels.tolist() == [9] and CIFAR10_CLASSES[9] == "truck"


def test_limit_stops_reading(tmp_path: Path) -> None:
    _write_dataset(tmp_path, "py2")
    (tmp_path / "data_batch_5").write_bytes(b"not a pickle")
    images, labels = load_cifar10(tmp_path, limit=7).tensors
    expected_images, expected_labels = _expected([0, 1, 2], PER_BATCH)
    torch.testing.assert_close(images, expected_images[:7])
    assert torch.equal(labels, expected_labels[:7])
    with pytest.raises(ValueError, match=r"data_batch_5: not a readable"):
        load_cifar10(tmp_path)
    for limit in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            load_cifar10(tmp_path, limit=limit)  # type: ignore[arg-type]


def test_missing_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'} does not exist.*kriz"):
        load_cifar10(tmp_path / "nope")
    with pytest.raises(FileNotFoundError) as info:
        load_cifar10(tmp_path)
    message = str(info.value)
    for tried in ("data_batch_1", "cifar-10-batches-py/data_batch_1",
                  "cifar-10-batches-bin/data_batch_1.bin"):  # fmt: skip
        assert str(tmp_path / tried) in message
    _write_dataset(tmp_path / "cifar-10-batches-bin", "bin")
    (tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"incomplete: missing .*data_batch_3\.bin"):
        load_cifar10(tmp_path)
    assert len(load_cifar10(tmp_path, train=False)) == 4


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (os.getcwd, ())


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x80\x02garbage", "not a readable"),
        (pickle.dumps(_Exploit()), "refusing to load global"),
        (pickle.dumps([1, 2]), "expected a dict"),
        (pickle.dumps({b"data": np.zeros((1, 3072), np.uint8)}), "missing key 'labels'"),
        (pickle.dumps({b"data": np.zeros((1, 3072)), b"labels": [0]}), "2-D uint8"),
        (pickle.dumps({b"data": np.zeros((1, 100), np.uint8), b"labels": [0]}), "3072 pixels"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}), "labels for 2"),
        (pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}), r"\[0, 10\)"),
        (pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": ["a"]}), "labels"),
    ],
)
def test_malformed_pickle_names_file(tmp_path: Path, payload: bytes, match: str) -> None:
    (tmp_path / "test_batch").write_bytes(payload)
    with pytest.raises(ValueError, match=match) as info:
        load_cifar10(tmp_path, train=False)
    assert str(tmp_path / "test_batch") in str(info.value)


def test_malformed_binary_names_file(tmp_path: Path) -> None:
    path = tmp_path / "test_batch.bin"
    path.write_bytes(bytes(3073 + 5))
    with pytest.raises(ValueError, match=f"{path}: size 3078 bytes"):
        load_cifar10(tmp_path, train=False)
    path.write_bytes(bytes([10]) + bytes(3072))
    with pytest.raises(ValueError, match=f"{path}: labels must be in"):
        load_cifar10(tmp_path, train=False)
