"""A checkpoint directory's manifest: every file's size and CRC-32, checked before loading.

``torch.distributed.checkpoint`` (DCP) reads its ``.distcp`` shards and ``.metadata``
without checking them: a flipped byte in a tensor loads as a wrong value. The checkpoints
of ``spdkfac train --fsdp`` therefore carry ``manifest.json``, written atomically by rank 0
once every rank's files are on disk and before the directory gets its step name, and
verified before DCP reads anything (the plain checkpoints' zip archives carry their own
CRC-32s, checked by :mod:`spdkfac.training.checkpoint`).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from spdkfac.training.checkpoint import CheckpointError, atomic_write_bytes

__all__ = ["MANIFEST", "verify_manifest", "write_manifest"]

#: The manifest's file name in a checkpoint directory.
MANIFEST = "manifest.json"
_CHUNK = 1 << 22


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path) -> None:
    """Record the size and CRC-32 of every file in ``directory`` (itself aside) in its
    ``manifest.json``, atomically. Call once every file is complete."""
    files = {
        path.name: {"bytes": path.stat().st_size, "crc32": _crc32(path)}
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST
    }
    atomic_write_bytes(directory / MANIFEST, json.dumps({"files": files}, indent=1).encode())


def _listed(directory: Path) -> dict[str, dict[str, int]]:
    """The files ``directory``'s manifest lists; a missing or unreadable one refused."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing, so the checkpoint cannot be verified (written before "
            "--fsdp checkpoints carried one, or damaged); start a new --out-dir"
        )
    try:
        files = json.loads(path.read_bytes())["files"]
        listed = {
            str(name): {"bytes": int(entry["bytes"]), "crc32": int(entry["crc32"])}
            for name, entry in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: cannot be read ({type(error).__name__})") from None
    if not listed or any(Path(name).name != name for name in listed):
        raise CheckpointError(f"{path}: does not list the checkpoint's files")
    return listed


def verify_manifest(directory: Path, *, part: int = 0, parts: int = 1) -> None:
    """Check the files ``directory``'s manifest lists: every ``parts``-th one from index
    ``part`` in name order (ranks may split the reading; each reads the manifest whole).

    Raises:
        CheckpointError: Naming the first file that is missing, of another size (truncated,
            emptied) or of another CRC-32 (a changed byte), or a missing or unreadable
            manifest.
    """
    listed = _listed(directory)
    for name in sorted(listed)[part::parts]:
        expected, path = listed[name], directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: checkpoint file is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, not the {expected['bytes']} written (truncated or "
                "overwritten)"
            )
        if _crc32(path) != expected["crc32"]:
            raise CheckpointError(f"{path}: cannot be read (CRC-32 mismatch: corrupted)")
