"""JSON files written atomically and read back with errors that name the file and the fault.

Every saved document of the package (cost models, benchmark results, traces) goes through
:func:`write_json`, and the loaders through :func:`read_json`, so a crash mid-write never
leaves a torn file and a bad file always fails with the same kind of message.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "read_json", "write_json"]


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; some file systems cannot fsync a directory."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def atomic_write_bytes(
    path: str | os.PathLike[str], payload: bytes, *, mode: int | None = 0o644
) -> Path:
    """Write ``payload`` so that readers see the old file or the new one, never a part.

    The bytes go to a temporary file in the same directory, are fsynced, and the file is
    renamed over ``path``; the directory is then fsynced too. The directory must exist.

    Args:
        path: The file to write.
        payload: Its new contents.
        mode: Permission bits of the new file (``mkstemp`` makes it 0600); None keeps 0600.

    Returns:
        The path written.
    """
    target = Path(path)
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(target.parent)
    return target


def write_json(
    path: str | os.PathLike[str],
    document: Any,
    *,
    indent: int | None = 2,
    allow_nan: bool = False,
) -> Path:
    """Write ``document`` as UTF-8 JSON with a final newline, atomically.

    Args:
        path: The file to write (its directory must exist).
        document: Anything :func:`json.dumps` accepts.
        indent: Passed to :func:`json.dumps` (None: one line).
        allow_nan: Whether NaN and infinities may be written (as the non-standard
            ``NaN`` / ``Infinity``); when False they raise ``ValueError`` before the file
            is touched.

    Returns:
        The path written.
    """
    text = json.dumps(document, indent=indent, allow_nan=allow_nan) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON document in ``path``.

    Args:
        path: The file to read.
        what: What the file should be, for messages (e.g. ``"cost-model file"``).

    Raises:
        FileNotFoundError: No file at ``path`` (``"<what> not found"``, naming the path).
        ValueError: ``"<path>: corrupt <what> (not UTF-8 text: ...)"`` or
            ``"<path>: corrupt <what> (not JSON: ...)"``.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{what} not found", str(source)) from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{source}: corrupt {what} (not UTF-8 text: {error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: corrupt {what} (not JSON: {error})") from None
