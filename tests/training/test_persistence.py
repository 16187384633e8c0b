"""Saving and restoring a run's checkpoint on one rank: round trip, pruning, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from spdkfac.comm import LocalCommunicator
from spdkfac.training.checkpoint import CheckpointError, latest_checkpoint, step_directory
from spdkfac.training.config import TrainConfig
from spdkfac.training.persistence import KEEP_CHECKPOINTS, restore_checkpoint, save_checkpoint

__all__: list[str] = []


def _parts(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    save_checkpoint(
        root,
        LocalCommunicator(),
        TrainConfig(optimizer="sgd"),
        step=step,
        train_seconds=1.5 * step,
        metrics=[{"epoch": 1, "step": step}],
        module=model,
        optimizer=optimizer,
        preconditioner=None,
        rank_state={"mixup": None, "epoch_losses": [0.5, 0.25]},
    )


def test_save_then_restore_round_trips(tmp_path: Path) -> None:
    model, optimizer = _parts(0)
    _save(tmp_path, 7, model, optimizer)
    fresh, fresh_optimizer = _parts(1)
    restored = restore_checkpoint(
        tmp_path,
        LocalCommunicator(),
        TrainConfig(optimizer="sgd", epochs=99),  # a resumable change
        module=fresh,
        optimizer=fresh_optimizer,
        preconditioner=None,
    )
    assert restored is not None
    assert (restored.step, restored.world_size, restored.train_seconds) == (7, 1, 10.5)
    assert restored.metrics == [{"epoch": 1, "step": 7}]
    assert restored.rank_state == {"format": 1, "mixup": None, "epoch_losses": [0.5, 0.25]}
    assert restored.directory == step_directory(tmp_path, 7)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert str(optimizer.state_dict()) == str(fresh_optimizer.state_dict())


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    model, optimizer = _parts(0)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, optimizer)
    kept = sorted(p.name for p in tmp_path.glob("step-*"))
    assert kept == [f"step-{s:08d}" for s in range(5 - KEEP_CHECKPOINTS, 5)]
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 4)


def test_nothing_to_restore_and_incompatible_configs(tmp_path: Path) -> None:
    model, optimizer = _parts(0)
    comm = LocalCommunicator()
    kwargs = {"module": model, "optimizer": optimizer, "preconditioner": None}
    assert restore_checkpoint(tmp_path, comm, TrainConfig(optimizer="sgd"), **kwargs) is None
    _save(tmp_path, 3, model, optimizer)
    with pytest.raises(CheckpointError, match="differs in lr"):
        restore_checkpoint(tmp_path, comm, TrainConfig(optimizer="sgd", lr=0.5), **kwargs)
