"""Saving and restoring a run's checkpoint, side by side, every rank taking part.

:func:`save_checkpoint` writes rank 0's common file and every rank's own file, then moves
the ``latest`` pointer once all are on disk (the format and the atomic writes are in
:mod:`spdkfac.training.checkpoint`). :func:`restore_checkpoint` has every rank read the
checkpoint ``latest`` points to and apply it locally; one all-gather of a fixed-size
record (status, step, digest of ``common.pt``, error text) then turns a failure on any
rank, or ranks that found different checkpoints, into the same
:class:`~spdkfac.training.checkpoint.CheckpointError` on every rank, instead of one rank
raising while the others wait in their next collective.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.comm import Communicator, barrier
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.training.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    atomic_torch_save,
    latest_checkpoint,
    load_common,
    load_rank_state,
    publish_latest,
    step_directory,
)
from spdkfac.training.config import TrainConfig, incompatible_fields

__all__ = [
    "KEEP_CHECKPOINTS",
    "CheckpointPayload",
    "Restored",
    "agree_on_restore",
    "common_record",
    "prune_checkpoints",
    "read_common",
    "read_latest",
    "restore_checkpoint",
    "save_checkpoint",
    "unfit",
]

#: How many checkpoints :func:`save_checkpoint` keeps: the one ``latest`` names and the
#: newest ones before it.
KEEP_CHECKPOINTS = 2

_RECORD_BYTES = 1024
_HEADER = struct.Struct("<Bq32s")  # status, step, sha256 of common.pt
_NONE, _LOADED, _FAILED = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class CheckpointPayload:
    """What one checkpoint holds (rank 0's ``common.pt``: all but ``rank_state``).

    Attributes:
        config: The run's configuration, stored for the resume-time compatibility check.
        step: Optimizer steps completed.
        train_seconds: Training time so far.
        metrics: The per-epoch rows so far, as plain dicts.
        module: The model (unwrapped from ``DistributedDataParallel``).
        optimizer: Its optimizer.
        preconditioner: K-FAC, or None.
        rank_state: This rank's own state (plain values and tensors), its ``rank-R.pt``.
    """

    config: TrainConfig
    step: int
    train_seconds: float
    metrics: Sequence[Mapping[str, Any]]
    module: nn.Module
    optimizer: torch.optim.Optimizer
    preconditioner: KFACPreconditioner | None
    rank_state: Mapping[str, Any]


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gave back beyond the state loaded into the model and optimizers."""

    directory: Path
    step: int
    world_size: int
    train_seconds: float
    metrics: list[dict[str, Any]]
    rank_state: dict[str, Any] | None


def common_record(payload: CheckpointPayload, world_size: int) -> dict[str, Any]:
    """The entries of ``common.pt`` besides the model's, the optimizer's and K-FAC's state:
    format, configuration, world size, step, training time and metrics."""
    return {
        "format": CHECKPOINT_FORMAT,
        "config": payload.config.to_dict(),
        "world_size": world_size,
        "step": payload.step,
        "train_seconds": payload.train_seconds,
        "metrics": list(payload.metrics),
    }


def save_checkpoint(root: Path, comm: Communicator, payload: CheckpointPayload) -> None:
    """Write the checkpoint of ``payload.step`` under ``root`` (``OUT/checkpoints``) and
    point ``latest`` at it.

    A collective: every rank calls it. Rank 0 writes ``common.pt`` (model, optimizer,
    preconditioner, counters, config), each rank its ``rank-R.pt`` (``rank_state``); once
    every file is on disk rank 0 moves ``latest`` and deletes older checkpoints (see
    :func:`prune_checkpoints`).
    """
    directory = step_directory(root, payload.step)
    precond = payload.preconditioner
    # Every rank: with strategy="osawa" state_dict() gathers the owners' factors.
    precond_state = None if precond is None else precond.state_dict()
    if comm.rank == 0:
        atomic_torch_save(
            directory / "common.pt",
            {
                **common_record(payload, comm.world_size),
                "model": payload.module.state_dict(),
                "optimizer": payload.optimizer.state_dict(),
                "preconditioner": precond_state,
            },
        )
    atomic_torch_save(
        directory / f"rank-{comm.rank}.pt", {"format": CHECKPOINT_FORMAT, **payload.rank_state}
    )
    barrier(comm)  # every rank's file is on disk before the pointer moves
    if comm.rank == 0:
        publish_latest(root, payload.step)
        prune_checkpoints(root, keep=KEEP_CHECKPOINTS)
    barrier(comm)


def prune_checkpoints(root: Path, *, keep: int) -> list[Path]:
    """Delete the checkpoints under ``root`` older than the ``keep`` newest up to the one
    ``latest`` names; returns the directories deleted.

    What ``latest`` names is never deleted, whatever the step numbers around it; nor is
    anything newer than it (a checkpoint whose pointer was never moved is overwritten
    when the run reaches that step again). Without a readable ``latest`` nothing is.
    """
    try:
        current = latest_checkpoint(root)
    except CheckpointError:
        return []
    if current is None:
        return []
    older = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name < current.name)
    doomed = older[: max(len(older) - (keep - 1), 0)]
    for directory in doomed:
        for item in directory.iterdir():
            item.unlink()
        directory.rmdir()
    return doomed


def restore_checkpoint(
    root: Path,
    comm: Communicator,
    config: TrainConfig,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None,
) -> Restored | None:
    """Load the latest checkpoint under ``root`` into the model and optimizers.

    A collective: every rank calls it. Returns None when no rank found a checkpoint.

    Raises:
        CheckpointError: The same one on every rank when a rank could not read or apply
            its checkpoint (naming the rank, the file and the reason) or when ranks found
            different checkpoints.
    """
    return read_latest(
        root,
        comm,
        lambda directory: _apply(directory, comm, config, module, optimizer, preconditioner),
    )


def read_latest(
    root: Path, comm: Communicator, read: Callable[[Path], Restored]
) -> Restored | None:
    """``read`` the checkpoint ``latest`` names under ``root`` on every rank, then agree.

    A collective (one all-gather): every rank calls it. Returns None when no rank found a
    checkpoint.

    Raises:
        CheckpointError: The same one on every rank when ``read`` failed on a rank (naming
            the rank and the reason) or when ranks found different checkpoints.
    """
    restored: Restored | None = None
    digest = bytes(32)
    error: str | None = None
    try:
        directory = latest_checkpoint(root)
        if directory is not None:
            digest = hashlib.sha256((directory / "common.pt").read_bytes()).digest()
            restored = read(directory)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # any local failure must reach the other ranks, not hang them
        error = f"{type(exc).__name__}: {exc}"
    agree_on_restore(comm, restored, digest, error)
    return restored


def read_common(
    directory: Path, comm: Communicator, config: TrainConfig
) -> tuple[dict[str, Any], Restored]:
    """The checkpoint in ``directory``'s ``common.pt`` and what it gives back beside the
    model's and optimizers' state (this rank's file read too), its configuration checked
    against ``config``.

    Raises:
        CheckpointError: Unreadable, written by an incompatible configuration, or missing
            this rank's file at the same world size.
    """
    common = load_common(directory)
    try:
        world_size = int(common["world_size"])
        differing = incompatible_fields(common["config"], config)
        if differing:
            raise CheckpointError(
                f"{directory}: written by an incompatible configuration (differs in "
                f"{', '.join(differing)}); start a new --out-dir or use the same options"
            )
        restored = Restored(
            directory=directory,
            step=int(common["step"]),
            world_size=world_size,
            train_seconds=float(common["train_seconds"]),
            metrics=list(common["metrics"]),
            rank_state=load_rank_state(directory, comm.rank),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise unfit(directory / "common.pt", exc) from None
    if restored.rank_state is None and world_size == comm.world_size:
        raise CheckpointError(
            f"{directory / f'rank-{comm.rank}.pt'}: checkpoint file is missing "
            f"(the checkpoint was written by {world_size} ranks)"
        )
    return common, restored


def unfit(path: Path, exc: BaseException) -> CheckpointError:
    """The error of a checkpoint at ``path`` whose state ``exc`` refused."""
    reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return CheckpointError(f"{path}: does not fit this model and optimizer ({reason})")


def _apply(
    directory: Path,
    comm: Communicator,
    config: TrainConfig,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None,
) -> Restored:
    common, restored = read_common(directory, comm, config)
    try:
        module.load_state_dict(common["model"])
        optimizer.load_state_dict(common["optimizer"])
        saved = common["preconditioner"]
        if (preconditioner is None) != (saved is None):
            raise ValueError("it has no K-FAC state" if saved is None else "it has K-FAC state")
        if preconditioner is not None:
            preconditioner.load_state_dict(saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise unfit(directory / "common.pt", exc) from None
    return restored


def _encode(status: int, step: int, digest: bytes, error: str) -> Tensor:
    message = error.encode()[: _RECORD_BYTES - _HEADER.size]
    record = bytearray(_HEADER.pack(status, step, digest) + message)
    record.extend(bytes(_RECORD_BYTES - len(record)))
    return torch.frombuffer(record, dtype=torch.uint8)


def _decode(record: Tensor) -> tuple[int, int, bytes, str]:
    raw = bytes(record.cpu().tolist())
    status, step, digest = _HEADER.unpack_from(raw)
    message = raw[_HEADER.size :].rstrip(b"\0").decode(errors="replace")
    return status, step, digest, message


def agree_on_restore(
    comm: Communicator, restored: Restored | None, digest: bytes, error: str | None
) -> None:
    """Turn a failure on any rank (``error``), or ranks holding different checkpoints
    (``restored``'s step, ``digest`` of its ``common.pt``), into the same
    :class:`CheckpointError` on every rank (one all-gather; a no-op check on one rank)."""
    if comm.world_size == 1:
        if error is not None:
            raise CheckpointError(error)
        return
    status = _FAILED if error is not None else _NONE if restored is None else _LOADED
    step = -1 if restored is None else restored.step
    local = _encode(status, step, digest, error or "").to(comm.device)
    records = [_decode(r) for r in comm.all_gather(local).wait()]
    failed = [rank for rank, record in enumerate(records) if record[0] == _FAILED]
    if failed:
        first = failed[0]
        others = f" (rank(s) {failed[1:]} failed too)" if len(failed) > 1 else ""
        raise CheckpointError(f"cannot resume: rank {first}: {records[first][3]}{others}")
    if any(record[:3] != records[0][:3] for record in records):
        found = ", ".join(
            f"rank {rank}: "
            + (f"step {step} (sha256 {digest.hex()[:12]})" if status == _LOADED else "none")
            for rank, (status, step, digest, _) in enumerate(records)
        )
        raise CheckpointError(
            f"ranks disagree on the checkpoint to resume from ({found}); give every rank "
            "the same --out-dir on a shared file system"
        )
