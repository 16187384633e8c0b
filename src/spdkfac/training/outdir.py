"""A run's output directory: one run per directory, never two mixed.

``spdkfac train`` writes ``config.toml``, ``metrics.csv``, ``summary.json``,
``tensorboard/`` and ``checkpoints/`` under ``--out-dir``. A fresh run (no ``--resume``)
in a directory holding another run's files would mix the two (and its retention used to
delete its own checkpoint), so :func:`claim_out_dir` refuses it unless ``--overwrite``
asks for the old files to go; :func:`clear_previous_run` then moves them aside in one
rename each and deletes them, so the directory never holds a mixture of the two runs.
The decision is agreed by one all-reduce, so every rank makes the same one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from spdkfac.comm import Communicator
from spdkfac.support.paths import output_dir_problem

__all__ = [
    "RUN_FILES",
    "OutDirError",
    "claim_out_dir",
    "clear_previous_run",
    "previous_run_files",
]

#: What a run writes under its output directory (files and directories).
RUN_FILES: tuple[str, ...] = (
    "checkpoints",
    "config.toml",
    "metrics.csv",
    "summary.json",
    "tensorboard",
)
_TRASH_PREFIX = ".spdkfac-overwritten-"


class OutDirError(ValueError):
    """An output directory that cannot take this run (not a directory, or another run's)."""


def _holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def previous_run_files(path: str | os.PathLike[str]) -> list[str]:
    """The names of :data:`RUN_FILES` that ``path`` holds (empty directories aside)."""
    directory = Path(path)
    if not directory.is_dir():
        return []
    return [name for name in RUN_FILES if _holds_something(directory / name)]


def claim_out_dir(
    path: str | os.PathLike[str], comm: Communicator, *, resume: bool, overwrite: bool
) -> bool:
    """Whether this run may use ``path``: True when another run's files must be cleared
    first (``overwrite``; rank 0 calls :func:`clear_previous_run`), False when there are
    none or the run resumes them.

    A collective: every rank calls it, before the run reads or writes anything there.
    What every rank sees is all-reduced (max), so a file one rank sees counts on all.

    Raises:
        OutDirError: The same one on every rank: ``path`` is not a directory (or cannot
            be created), or it holds another run and neither ``resume`` nor ``overwrite``
            is set (the message names both flags).
    """
    problem = output_dir_problem(path)
    found = previous_run_files(path)
    local = [float(problem is not None)] + [float(name in found) for name in RUN_FILES]
    seen = comm.all_reduce_max(torch.tensor(local, device=comm.device)).wait().tolist()
    if seen[0]:
        raise OutDirError(problem or f"--out-dir {path}: not a directory on every rank")
    held = [name for name, flag in zip(RUN_FILES, seen[1:], strict=True) if flag]
    if not held or resume:
        return False
    if overwrite:
        return True
    raise OutDirError(
        f"--out-dir {path} holds another run ({', '.join(held)}); pass --resume to "
        "continue it, --overwrite to delete it and start afresh, or another --out-dir"
    )


def clear_previous_run(path: str | os.PathLike[str]) -> list[str]:
    """Delete the :data:`RUN_FILES` under ``path``; returns the names removed.

    Each one is first renamed into a hidden directory of ``path`` (``checkpoints`` first,
    so its ``latest`` and its step directories go in one rename), which is then deleted
    with what an earlier, interrupted clearing left. A process killed midway leaves some
    of the old run's files in place (so a fresh run is refused again) and none of the new
    run's: the two are never mixed. Other files under ``path`` are left alone.
    """
    directory = Path(path)
    names = previous_run_files(directory)
    trash = Path(tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=directory))
    for name in RUN_FILES:
        if (directory / name).exists() or (directory / name).is_symlink():
            os.rename(directory / name, trash / name)
    for leftover in directory.glob(_TRASH_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return names
