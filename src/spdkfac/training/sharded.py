"""Checkpoints of ``spdkfac train --fsdp``: the model, the optimizer and K-FAC through
``torch.distributed.checkpoint`` (DCP), each rank writing its shards; the loop's own state
as in the other checkpoints (:mod:`spdkfac.training.persistence`).

Layout under the checkpoint directory::

    step-00001200/.metadata, __R_0.distcp   DCP: "model", "optimizer", "kfac"
    step-00001200/common.pt                 step, metrics, config ("layout": "dcp")
    step-00001200/rank-R.pt                 per-rank state and the rank's own buffers
    step-00001200/manifest.json             every file's size and CRC-32, verified on load
    latest                                  "step-00001200", written last

Every rank writes into the hidden ``.step-00001200.partial``; once every rank's part is on
disk (a barrier) rank 0 writes the manifest, renames the directory to ``step-00001200``,
then moves ``latest`` and prunes, so a process killed at any moment leaves the previous
checkpoint loadable and never a torn one under a step name. Every rank issues the same
collectives in the same order: barrier, DCP's save, barrier, barrier. On load each rank
verifies its share of the manifest's files before DCP reads any (a damaged file is one
error naming it, on every rank).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spdkfac.comm import Communicator, barrier
from spdkfac.comm.dcp import dcp_load, dcp_save, load_training_state, training_state
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.training.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    atomic_torch_save,
    latest_checkpoint,
    publish_latest,
    step_directory,
)
from spdkfac.training.config import TrainConfig
from spdkfac.training.manifest import verify_manifest, write_manifest
from spdkfac.training.persistence import (
    KEEP_CHECKPOINTS,
    CheckpointPayload,
    Restored,
    agree_on_restore,
    common_record,
    prune_checkpoints,
    read_common,
    read_latest,
    unfit,
)

__all__ = ["PARTIAL_SUFFIX", "restore_sharded_checkpoint", "save_sharded_checkpoint"]

#: The suffix of a checkpoint being written (hidden, renamed once complete).
PARTIAL_SUFFIX = ".partial"
_LAYOUT = "dcp"


def _state(
    module: nn.Module, optimizer: torch.optim.Optimizer, precond: KFACPreconditioner | None
) -> dict[str, Any]:
    """What DCP writes, also the template it loads into."""
    state = training_state(module, optimizer)
    if precond is not None:
        state["kfac"] = precond.dcp_state_dict()
    return state


def _own_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's buffers (BatchNorm running statistics): FSDP2 shards parameters only, so
    each rank keeps its own, which DCP would write once for all."""
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def save_sharded_checkpoint(root: Path, comm: Communicator, payload: CheckpointPayload) -> None:
    """Write the checkpoint of ``payload.step`` under ``root`` (``OUT/checkpoints``) through
    DCP and point ``latest`` at it (see the module's docstring).

    A collective: every rank calls it, with a model sharded by FSDP2 (or, on one process,
    a plain one: the same format).
    """
    directory = step_directory(root, payload.step)
    partial = root / f".{directory.name}{PARTIAL_SUFFIX}"
    if comm.rank == 0:
        for leftover in root.glob(f".step-*{PARTIAL_SUFFIX}"):  # saves killed midway
            shutil.rmtree(leftover)
        partial.mkdir(parents=True)
    barrier(comm)  # the directory exists, empty, before any rank writes into it
    dcp_save(_state(payload.module, payload.optimizer, payload.preconditioner), partial)
    if comm.rank == 0:
        atomic_torch_save(
            partial / "common.pt", {**common_record(payload, comm.world_size), "layout": _LAYOUT}
        )
    rank_state = {**payload.rank_state, "buffers": _own_buffers(payload.module)}
    atomic_torch_save(partial / f"rank-{comm.rank}.pt", {"format": CHECKPOINT_FORMAT, **rank_state})
    barrier(comm)  # every rank's part is on disk before the manifest and the rename
    if comm.rank == 0:
        write_manifest(partial)
        _move_into_place(root, partial, directory)
        publish_latest(root, payload.step)
        prune_checkpoints(root, keep=KEEP_CHECKPOINTS)
    barrier(comm)


def _move_into_place(root: Path, partial: Path, directory: Path) -> None:
    """Rename the complete ``partial`` to ``directory``. A ``directory`` already there is
    a save killed before ``latest`` named it (replaced), or the one ``latest`` names (the
    same step of the same run: kept)."""
    if directory.exists():
        try:
            current = latest_checkpoint(root)
        except CheckpointError:
            current = None
        if current == directory:
            shutil.rmtree(partial)
            return
        shutil.rmtree(directory)
    os.rename(partial, directory)


def restore_sharded_checkpoint(
    root: Path,
    comm: Communicator,
    config: TrainConfig,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None,
) -> Restored | None:
    """Load the latest checkpoint under ``root`` that :func:`save_sharded_checkpoint` wrote
    into the model, optimizer and K-FAC, at any world size (DCP reshards).

    A collective: every rank calls it. First every rank reads ``common.pt`` and its own
    file and the ranks agree (one all-gather); then DCP loads (every rank, or none), and
    the ranks agree again. Returns None when no rank found a checkpoint.

    Raises:
        CheckpointError: The same one on every rank (see
            :func:`~spdkfac.training.persistence.restore_checkpoint`).
    """
    restored = read_latest(root, comm, lambda directory: _read(directory, comm, config))
    if restored is None:
        return None
    error: str | None = None
    try:
        state = _state(module, optimizer, preconditioner)
        dcp_load(state, restored.directory)  # raises on every rank if it fails on one
        load_training_state(module, optimizer, state)
        if preconditioner is not None:
            preconditioner.load_dcp_state_dict(state["kfac"])
        _load_buffers(module, (restored.rank_state or {}).get("buffers"))
    except Exception as exc:  # any local failure must reach the other ranks, not hang them
        error = str(unfit(restored.directory, exc))
    agree_on_restore(comm, restored, bytes(32), error)
    return restored


def _read(directory: Path, comm: Communicator, config: TrainConfig) -> Restored:
    common, restored = read_common(directory, comm, config)  # zip archives: own CRC-32s
    if common.get("layout") != _LAYOUT:
        raise CheckpointError(f"{directory}: not a checkpoint of a sharded (--fsdp) run")
    # Before DCP reads a byte: each rank checks its share of the files, and the ranks
    # agree (read_latest), so a damaged file is one error on every rank.
    verify_manifest(directory, part=comm.rank, parts=comm.world_size)
    return restored


def _load_buffers(module: nn.Module, buffers: Any) -> None:
    if not buffers:  # another world size's rank, or no buffers
        return
    own = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            if name in own and own[name].shape == value.shape:
                own[name].copy_(value)
