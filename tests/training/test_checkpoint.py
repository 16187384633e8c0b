"""Atomic checkpoint files, the latest pointer, and clear errors on bad checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spdkfac.training.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    atomic_torch_save,
    atomic_write_bytes,
    latest_checkpoint,
    load_common,
    load_rank_state,
    publish_latest,
    step_directory,
)


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]


def test_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "common.pt"
    atomic_torch_save(target, {"format": CHECKPOINT_FORMAT, "value": 1})

    class Unpicklable:
        def __reduce__(self) -> object:
            raise RuntimeError("cannot save")

    with pytest.raises(RuntimeError, match="cannot save"):
        atomic_torch_save(target, {"format": CHECKPOINT_FORMAT, "value": Unpicklable()})
    assert torch.load(target, weights_only=True)["value"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["common.pt"]


def test_latest_pointer_is_what_loading_follows(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (3, 6):
        directory = step_directory(tmp_path, step)
        atomic_torch_save(directory / "common.pt", {"format": CHECKPOINT_FORMAT, "step": step})
        atomic_torch_save(directory / "rank-0.pt", {"format": CHECKPOINT_FORMAT})
    # A checkpoint written but not yet published is never selected.
    publish_latest(tmp_path, 3)
    directory = latest_checkpoint(tmp_path)
    assert directory == step_directory(tmp_path, 3)
    assert load_common(directory)["step"] == 3
    assert load_rank_state(directory, 1) is None  # another world size: no rank-1 part


def test_corrupt_truncated_and_wrong_format_checkpoints(tmp_path: Path) -> None:
    directory = step_directory(tmp_path, 1)
    atomic_torch_save(
        directory / "common.pt", {"format": CHECKPOINT_FORMAT, "big": torch.ones(1000)}
    )
    publish_latest(tmp_path, 1)
    data = (directory / "common.pt").read_bytes()
    (directory / "common.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"common\.pt: cannot be read"):
        load_common(directory)
    atomic_torch_save(directory / "common.pt", {"format": 99})
    with pytest.raises(CheckpointError, match="format 99"):
        load_common(directory)
    (tmp_path / "latest").write_text("nonsense")
    with pytest.raises(CheckpointError, match="does not name a checkpoint"):
        latest_checkpoint(tmp_path)
    publish_latest(tmp_path, 7)
    with pytest.raises(CheckpointError, match=r"has no common\.pt"):
        latest_checkpoint(tmp_path)
