"""A dependency-free progress bar that redraws at most a few times per second."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``[#####.....] 50/100 loss 0.42`` on one line of a terminal; silent when disabled.

    Args:
        total: Number of steps.
        label: Text before the bar.
        enabled: False on non-zero ranks.
        stream: Where to draw (default ``sys.stderr``).
        interval: Minimum seconds between redraws.
        width: Characters of the bar.
        live: Redraw in place; default: when ``stream`` is a terminal (a launcher that
            pipes a worker's stderr to a terminal passes True).
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.2,
        width: int = 30,
        live: bool | None = None,
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.width = width
        self._last = 0.0
        # Redrawing with \r only makes sense on a terminal; elsewhere print the final line.
        self._live = enabled and (self.stream.isatty() if live is None else live)

    def update(self, done: int, suffix: str = "") -> None:
        """Show ``done`` of ``total`` steps with an optional suffix."""
        if not self._live:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < self.interval:
            return
        self._last = now
        self.stream.write("\r" + self._render(done, suffix))
        self.stream.flush()

    def close(self, suffix: str = "") -> None:
        """Draw the finished bar and end the line."""
        if not self.enabled:
            return
        prefix = "\r" if self._live else ""
        self.stream.write(prefix + self._render(self.total, suffix) + "\n")
        self.stream.flush()

    def _render(self, done: int, suffix: str) -> str:
        filled = int(self.width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        return f"{self.label} [{bar}] {done}/{self.total} {suffix}".rstrip()
