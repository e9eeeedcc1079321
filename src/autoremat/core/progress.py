"""A progress line on stderr for the long steps (profiling, benchmarks), only on a terminal."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``label [#####.....] k/n what`` on stderr, redrawn at most every 0.1 s, only when
    stderr is a terminal (logs and pipes stay clean)."""

    def __init__(self, label: str, total: int, what: str = "") -> None:
        self.label, self.total, self.what = label, total, what
        self.done, self.last = 0, 0.0
        self.on = sys.stderr.isatty() and total > 0

    def step(self, note: str = "") -> None:
        """One more of ``total`` done; ``note`` is shown after the count."""
        self.done += 1
        now = time.monotonic()
        if not self.on or (now - self.last <= 0.1 and self.done < self.total):
            return
        self.last = now
        width = 30
        filled = width * min(self.done, self.total) // self.total
        tail = f" {note}" if note else ""
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total} {self.what}{tail}\033[K"
        )
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
