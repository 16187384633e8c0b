"""Atomic, sharded training checkpoints: a common file, one file per rank, a pointer last.

Layout under the checkpoint directory::

    step-00001200/common.pt      model, optimizer, preconditioner, counters, config
    step-00001200/rank-0.pt      per-rank state (running-mixup batch, …)
    latest                       "step-00001200", written last

Every file is written to a temporary name in the same directory, fsynced and renamed, and
the ``latest`` pointer is replaced only after every rank has written its part, so a
process killed at any moment leaves the previous checkpoint loadable and never selects a
torn one (the pattern of torch.distributed.checkpoint's ``.metadata``).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from spdkfac.support import jsonio

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "atomic_torch_save",
    "atomic_write_bytes",
    "latest_checkpoint",
    "load_common",
    "load_rank_state",
    "publish_latest",
    "step_directory",
]

CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt or from another configuration."""


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so that readers see the old file or the new one.

    Creates the directory; the file is private to the user (0600), like ``mkstemp``'s.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    jsonio.atomic_write_bytes(path, payload, mode=None)


def atomic_torch_save(path: Path, obj: Any) -> None:
    """``torch.save`` through :func:`atomic_write_bytes`."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def step_directory(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives."""
    return root / f"step-{step:08d}"


def publish_latest(root: Path, step: int) -> None:
    """Point ``latest`` at ``step`` (call after every rank's files are written)."""
    atomic_write_bytes(root / "latest", f"step-{step:08d}\n".encode())


def latest_checkpoint(root: Path) -> Path | None:
    """The directory ``latest`` points to, or None when there is no checkpoint yet.

    Raises:
        CheckpointError: When ``latest`` is unreadable or points to a missing directory.
    """
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text(errors="replace").strip()
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: does not name a checkpoint directory ({name!r})")
    directory = root / name
    if not (directory / "common.pt").is_file():
        raise CheckpointError(f"{pointer}: points to {directory}, which has no common.pt")
    return directory


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing")
    try:
        # torch.load does not check the archive's CRC-32s: flipped bytes in tensor data
        # would load silently as wrong values, so they are checked first.
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise CheckpointError(f"{path}: cannot be read (CRC-32 mismatch in {damaged})")
        value = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as error:  # torch raises many types for truncated/corrupt files
        raise CheckpointError(f"{path}: cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(value, dict) or value.get("format") != CHECKPOINT_FORMAT:
        found = value.get("format") if isinstance(value, dict) else type(value).__name__
        raise CheckpointError(f"{path}: format {found!r} is not {CHECKPOINT_FORMAT}")
    return value


def load_common(directory: Path) -> dict[str, Any]:
    """The common part of a checkpoint (validated format)."""
    return _load(directory / "common.pt")


def load_rank_state(directory: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s part, or None when the checkpoint has none (other world size)."""
    path = directory / f"rank-{rank}.pt"
    return _load(path) if path.exists() else None
