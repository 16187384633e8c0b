"""The one table of named strategies (work in progress: filled by the architecture change)."""

from __future__ import annotations

__all__ = ["ALGORITHMS"]

#: Names ``strategy=`` accepts.
ALGORITHMS: tuple[str, ...] = ("d-kfac", "mpd-kfac", "spd-kfac")
