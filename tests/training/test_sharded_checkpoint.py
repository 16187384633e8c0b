"""Checkpoints of ``--fsdp`` runs (DCP) on one process: round trip with K-FAC and the rank's
own buffers, a save killed midway (the previous checkpoint stays ``latest``, the torn one
is never selected and is cleared by the next save), a checkpoint without ``--fsdp``'s
layout or with its DCP metadata gone refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from spdkfac import KFACPreconditioner
from spdkfac.comm import LocalCommunicator
from spdkfac.training import sharded
from spdkfac.training.checkpoint import CheckpointError, latest_checkpoint
from spdkfac.training.config import TrainConfig
from spdkfac.training.persistence import CheckpointPayload, Restored, save_checkpoint
from spdkfac.training.replicas import state_tensors
from spdkfac.training.sharded import restore_sharded_checkpoint, save_sharded_checkpoint

__all__: list[str] = []

pytestmark = pytest.mark.filterwarnings("ignore:spdkfac. these layers are not preconditioned")

CONFIG = TrainConfig(fsdp=True, checkpoint_every=2)


class _Run:
    """A tiny BatchNorm model, SGD with momentum and K-FAC, some steps taken."""

    def __init__(self, seed: int, steps: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.precond = KFACPreconditioner(self.model, optimizer=self.optimizer, inv_update_steps=1)
        for _ in range(steps):
            self.optimizer.zero_grad()
            self.model(torch.randn(8, 3)).square().mean().backward()
            self.precond.step()
            self.optimizer.step()

    def payload(self, step: int) -> CheckpointPayload:
        return CheckpointPayload(
            config=CONFIG,
            step=step,
            train_seconds=0.5 * step,
            metrics=[{"epoch": 1, "step": step}],
            module=self.model,
            optimizer=self.optimizer,
            preconditioner=self.precond,
            rank_state={"mixup": None, "losses": [0.25]},
        )

    def restore(self, root: Path) -> Restored | None:
        return restore_sharded_checkpoint(
            root,
            LocalCommunicator(),
            CONFIG,
            module=self.model,
            optimizer=self.optimizer,
            preconditioner=self.precond,
        )


def _assert_same(mine: _Run, other: _Run) -> None:
    torch.testing.assert_close(mine.model.state_dict(), other.model.state_dict())
    ours, theirs = mine.optimizer.state_dict(), other.optimizer.state_dict()
    torch.testing.assert_close(ours["state"], theirs["state"])
    assert ours["param_groups"] == theirs["param_groups"]
    ours_kfac = state_tensors(mine.precond.state_dict())
    theirs_kfac = state_tensors(other.precond.state_dict())
    assert len(ours_kfac) == len(theirs_kfac) > 0
    for a, b in zip(ours_kfac, theirs_kfac, strict=True):
        torch.testing.assert_close(a, b)


def test_round_trip_with_kfac_optimizer_and_buffers(tmp_path: Path) -> None:
    saved = _Run(0, steps=3)
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), saved.payload(3))
    directory = tmp_path / "step-00000003"
    assert latest_checkpoint(tmp_path) == directory
    assert (directory / ".metadata").is_file() and (directory / "rank-0.pt").is_file()
    assert not list(tmp_path.glob(".*"))  # no partial directory left
    fresh = _Run(1, steps=1)
    restored = fresh.restore(tmp_path)
    assert restored is not None
    assert (restored.step, restored.train_seconds, restored.world_size) == (3, 1.5, 1)
    assert restored.rank_state is not None and restored.rank_state["losses"] == [0.25]
    _assert_same(fresh, saved)
    assert fresh.restore(tmp_path / "nothing") is None


def test_a_killed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _Run(0, steps=2)
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(2))
    real = sharded.atomic_torch_save

    def dies_at_the_rank_file(path: Path, obj: Any) -> None:
        if path.name.startswith("rank-"):
            raise KeyboardInterrupt("killed")
        real(path, obj)

    monkeypatch.setattr(sharded, "atomic_torch_save", dies_at_the_rank_file)
    with pytest.raises(KeyboardInterrupt):
        save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(4))
    monkeypatch.undo()
    assert (tmp_path / ".step-00000004.partial" / ".metadata").is_file()
    assert not (tmp_path / "step-00000004").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    restored = _Run(1, steps=1).restore(tmp_path)
    assert restored is not None and restored.step == 2
    # A step directory latest never named (killed after the rename) is replaced too.
    (tmp_path / "step-00000006").mkdir()
    (tmp_path / "step-00000006" / "junk").write_text("x")
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(4))
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000004",
        "step-00000006",
    ]
    assert not (tmp_path / "step-00000006" / "junk").exists()


def test_unusable_checkpoints_are_refused(tmp_path: Path) -> None:
    run = _Run(0, steps=1)
    plain = tmp_path / "plain"
    save_checkpoint(plain, LocalCommunicator(), run.payload(1))  # the format without --fsdp
    with pytest.raises(CheckpointError, match="not a checkpoint of a sharded"):
        run.restore(plain)
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(1))
    (tmp_path / "step-00000001" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"1/\.metadata: checkpoint file is missing"):
        run.restore(tmp_path)


def _damage(path: Path, how: str) -> None:
    """Flip a byte in the middle, cut the file to half, or empty it."""
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]) if how == "truncate" else b"")


@pytest.mark.parametrize(
    ("name", "how", "message"),
    [("__0_0.distcp", "flip", "CRC-32 mismatch"), ("__0_0.distcp", "empty", "0 bytes, not"),
     (".metadata", "truncate", "bytes, not the"), ("rank-0.pt", "flip", "CRC-32 mismatch"),
     ("manifest.json", "truncate", "manifest.json: cannot be read")],
)  # fmt: skip
def test_a_damaged_file_is_refused_naming_it(
    tmp_path: Path, name: str, how: str, message: str
) -> None:
    """Never loaded: the manifest's sizes and CRC-32s are checked before DCP reads a byte."""
    run = _Run(0, steps=1)
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(1))
    _damage(tmp_path / "step-00000001" / name, how)
    other = _Run(1, steps=1)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message) as info:
        other.restore(tmp_path)
    assert str(tmp_path / "step-00000001" / name) in str(info.value)
    torch.testing.assert_close(other.model.state_dict(), before, rtol=0, atol=0)


def test_a_checkpoint_without_its_manifest_is_refused(tmp_path: Path) -> None:
    run = _Run(0, steps=1)
    save_sharded_checkpoint(tmp_path, LocalCommunicator(), run.payload(1))
    (tmp_path / "step-00000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json: missing, so .* cannot be verified"):
        run.restore(tmp_path)
