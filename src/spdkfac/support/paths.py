"""Output paths checked before any work: one line saying why a path cannot be written."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["make_output_dir", "output_dir_problem", "output_file_problem"]


def _first_existing(path: Path) -> Path:
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    return ancestor


def output_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be (or be created as) a directory to write into, or None.

    A regular file at ``path`` or at its first existing ancestor is a problem, so is an
    ancestor this process may not write into.
    """
    directory = Path(path)
    try:
        exists = directory.exists()
    except OSError as error:  # e.g. a name too long for the file system
        return f"cannot create {directory}: {error.strerror or error}"
    if exists:
        return None if directory.is_dir() else f"{directory} exists and is not a directory"
    ancestor = _first_existing(directory.parent)
    if not ancestor.is_dir():
        return f"{ancestor} (in {directory}) is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create {directory}: {ancestor} is not writable"
    return None


def make_output_dir(path: str | os.PathLike[str]) -> str | None:
    """Create directory ``path`` (and its parents) now, or say why it cannot be, or None.

    Creating it is the one check every file system answers truly: ``os.access`` says yes
    to root whatever the mount, and a name too long or a directory that takes no new
    entries (``/sys``) only shows when a directory is made. An existing directory is left
    as it is; several processes may call it at once.
    """
    problem = output_dir_problem(path)
    if problem is not None:
        return problem
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create {path}: {error.strerror or error}"
    return None


def output_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be written at ``path`` (its directory is not created), or None."""
    target = Path(path)
    if target.is_dir():
        return f"{target} is a directory, expected a file name"
    parent = target.parent
    if not parent.exists():
        return f"directory {parent} of {target} does not exist"
    if not parent.is_dir():
        return f"{parent} (in {target}) is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write {target}: {parent} is not writable"
    return None
