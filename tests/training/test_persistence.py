"""Saving and restoring a run's checkpoint on one rank: round trip, pruning, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from spdkfac.comm import LocalCommunicator
from spdkfac.training.checkpoint import (
    CheckpointError,
    atomic_torch_save,
    latest_checkpoint,
    publish_latest,
    step_directory,
)
from spdkfac.training.config import TrainConfig
from spdkfac.training.persistence import (
    KEEP_CHECKPOINTS,
    CheckpointPayload,
    prune_checkpoints,
    restore_checkpoint,
    save_checkpoint,
)

__all__: list[str] = []


def _parts(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    payload = CheckpointPayload(
        config=TrainConfig(optimizer="sgd"),
        step=step,
        train_seconds=1.5 * step,
        metrics=[{"epoch": 1, "step": step}],
        module=model,
        optimizer=optimizer,
        preconditioner=None,
        rank_state={"mixup": None, "epoch_losses": [0.5, 0.25]},
    )
    save_checkpoint(root, LocalCommunicator(), payload)


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
    common = torch.load(restored.directory / "common.pt", weights_only=True)
    assert list(common) == ["format", "config", "world_size", "step", "train_seconds",
                            "metrics", "model", "optimizer", "preconditioner"]  # fmt: skip
    assert common["config"] == TrainConfig(optimizer="sgd").to_dict()
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


def test_retention_never_deletes_what_latest_names(tmp_path: Path) -> None:
    """Issue 39 item 5: a run whose step names sort below older ones (a second run from
    step 0 in the same directory) kept the two highest names and deleted its own."""
    model, optimizer = _parts(0)
    for step in (2, 4, 6):
        _save(tmp_path, step, model, optimizer)
    _save(tmp_path, 2, model, optimizer)  # latest -> step-00000002, below 4 and 6
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 2)
    assert (step_directory(tmp_path, 2) / "common.pt").is_file()
    # Newer directories than latest are left alone; older ones beyond the kept one go.
    _save(tmp_path, 1, model, optimizer)
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        f"step-{s:08d}" for s in (1, 2, 4, 6)
    ]
    older = [step_directory(tmp_path, s) for s in (3, 5)]
    for directory in older:
        atomic_torch_save(directory / "common.pt", {"format": 1})
    publish_latest(tmp_path, 5)
    assert prune_checkpoints(tmp_path, keep=2) == [step_directory(tmp_path, s) for s in (1, 2, 3)]
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 5)


def test_retention_without_a_usable_latest_deletes_nothing(tmp_path: Path) -> None:
    model, optimizer = _parts(0)
    for step in (1, 2, 3):
        _save(tmp_path, step, model, optimizer)
    (tmp_path / "latest").write_text("garbage\n")
    assert prune_checkpoints(tmp_path, keep=1) == []
    (tmp_path / "latest").unlink()
    assert prune_checkpoints(tmp_path, keep=1) == []
    assert len(list(tmp_path.glob("step-*"))) == 2


def test_numpy_and_tensor_options_are_stored_as_python_numbers(tmp_path: Path) -> None:
    """A numpy or 0-d tensor option is a number (issue 39 item 8), stored as the Python
    number it holds: config.toml and weights_only checkpoints take nothing else."""
    config = TrainConfig(optimizer="sgd", lr=np.float32(0.05), epochs=np.int64(3),
                         momentum=torch.tensor(0.5), milestones=(np.float64(1.0),))  # fmt: skip
    assert (type(config.lr), type(config.epochs), type(config.momentum)) == (float, int, float)
    assert config.milestones == (1.0,) and type(config.milestones[0]) is float
    assert f"lr = {float(np.float32(0.05))!r}" in config.to_toml()
    model, optimizer = _parts(0)
    payload = CheckpointPayload(
        config=config, step=1, train_seconds=0.0, metrics=[], module=model,
        optimizer=optimizer, preconditioner=None, rank_state={},
    )  # fmt: skip
    save_checkpoint(tmp_path, LocalCommunicator(), payload)
    fresh, fresh_optimizer = _parts(1)
    restored = restore_checkpoint(
        tmp_path, LocalCommunicator(), config, module=fresh, optimizer=fresh_optimizer,
        preconditioner=None,
    )  # fmt: skip
    assert restored is not None and restored.step == 1


def test_nothing_to_restore_and_incompatible_configs(tmp_path: Path) -> None:
    model, optimizer = _parts(0)
    comm = LocalCommunicator()
    kwargs = {"module": model, "optimizer": optimizer, "preconditioner": None}
    assert restore_checkpoint(tmp_path, comm, TrainConfig(optimizer="sgd"), **kwargs) is None
    _save(tmp_path, 3, model, optimizer)
    with pytest.raises(CheckpointError, match="differs in lr"):
        restore_checkpoint(tmp_path, comm, TrainConfig(optimizer="sgd", lr=0.5), **kwargs)


def test_a_checkpoint_written_before_the_kfac_options_were_nested_resumes(
    tmp_path: Path,
) -> None:
    # common.pt as written then: its config the flat options of that time (no
    # inverse_method, comm_scheduler, weight_sharing, factor_examples, flush_denormal, ...).
    old = {
        "model": "mlp", "dataset": "fashion-mnist", "epochs": 2, "batch_size": 16,
        "accumulation_steps": 1, "optimizer": "kfac", "lr": 0.05, "momentum": 0.9,
        "nesterov": False, "weight_decay": 0.0005, "lr_schedule": "cosine",
        "warmup_epochs": 0.0, "milestones": [], "lr_gamma": 0.1, "poly_power": 2.0,
        "poly_start_epoch": 0.0, "strategy": "spd-kfac", "damping": 0.3,
        "damping_warmup_steps": 0, "kl_clip": 0.001, "factor_decay": 0.95,
        "factor_update_steps": 1, "inv_update_steps": 3, "stale_factor_update_steps": 10,
        "stale_inv_update_steps": 100, "stale_growth_steps": 0, "batchnorm": "off",
        "batchnorm_damping_multiplier": 1.0, "seed": 0, "out_dir": str(tmp_path),
        "checkpoint_every": 5, "resume": True, "target_accuracy": 0.92, "tensorboard": False,
        "config": None,
    }  # fmt: skip
    model, optimizer = _parts(0)
    directory = step_directory(tmp_path, 5)
    atomic_torch_save(
        directory / "common.pt",
        {"format": 1, "config": old, "world_size": 1, "step": 5, "train_seconds": 2.0,
         "metrics": [], "model": model.state_dict(), "optimizer": optimizer.state_dict(),
         "preconditioner": None},
    )  # fmt: skip
    atomic_torch_save(directory / "rank-0.pt", {"format": 1, "mixup": None})
    publish_latest(tmp_path, 5)
    config = TrainConfig.from_dict(old)
    assert (config.kfac.damping, config.kfac.inv_update_steps) == (0.3, 3)
    comm = LocalCommunicator()
    fresh, fresh_optimizer = _parts(1)
    objects = {"module": fresh, "optimizer": fresh_optimizer, "preconditioner": None}
    restored = restore_checkpoint(tmp_path, comm, config, **objects)
    assert restored is not None and restored.step == 5
    changed = TrainConfig.from_dict({**old, "damping": 0.1, "weight_sharing": "reduce"})
    with pytest.raises(CheckpointError, match="differs in damping, weight_sharing"):
        restore_checkpoint(tmp_path, comm, changed, **objects)
