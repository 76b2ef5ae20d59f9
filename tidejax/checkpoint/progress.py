"""A progress bar on stderr (no dependency): items and bytes done over total, and the rate. On a
terminal one line is rewritten in place; in a log (not a tty) a line is written every 10 seconds.
Thread-safe: the loaders advance it from their reading threads."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """`advance(items, nbytes)` as work completes; the final line is printed when all items
    are done or at `close()`."""

    def __init__(self, label: str, total_items: int, total_bytes: int,
                 stream: TextIO | None = None, enabled: bool = True):
        self.label, self.total_items, self.total_bytes = label, total_items, total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = 0.25 if self.tty else 10.0
        self.items = self.nbytes = 0
        self.start = self._shown = time.monotonic()
        self.closed = False
        self._lock = threading.Lock()

    def advance(self, items: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            if self.closed:  # reads after the load (the residency disk tier's) are not shown
                return
            self.items += items
            self.nbytes += nbytes
            if self.items >= self.total_items:
                self._close()
                return
            now = time.monotonic()
            if now - self._shown >= self.every_s:
                self._shown = now
                self._show(now, final=False)

    def leave_out(self, items: int, nbytes: int) -> None:
        """Takes work that is not done here off the totals (rows read later, as needed)."""
        with self._lock:
            self.total_items -= items
            self.total_bytes -= nbytes

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self._show(time.monotonic(), final=True)

    def _show(self, now: float, final: bool) -> None:
        if not self.enabled:
            return
        gb = 1e-9
        frac = self.nbytes / self.total_bytes if self.total_bytes else 1.0
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        line = (f"{self.label} [{bar}] {self.items}/{self.total_items} tensors, "
                f"{self.nbytes * gb:.2f}/{self.total_bytes * gb:.2f} GB, "
                f"{now - self.start:.0f} s, {self.nbytes * gb / max(now - self.start, 1e-9):.2f} GB/s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
