"""A byte-progress line (done/total, rate, ETA) for long weight transfers; no dependencies.

On a terminal the line redraws in place; elsewhere (logs, pipes) it prints a new line at most every
`log_interval` seconds so a log of a multi-hour conversion stays short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ByteProgress:
    """`update(n)` after each chunk; `close()` prints the final line. Silent when not `enabled`."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, enabled: bool = True,
                 tty_interval: float = 0.2, log_interval: float = 10.0) -> None:
        self.label, self.total, self.done = label, max(int(total), 0), 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = tty_interval if self.tty else log_interval
        self.start = time.perf_counter()
        self._last = self.start

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.perf_counter()) - self.start, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = human_seconds(eta) if eta != float("inf") else "?"
        return (f"{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} ({pct:5.1f}%) "
                f"{human_bytes(rate)}/s ETA {eta_text}")

    def update(self, n: int) -> None:
        self.done += int(n)
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._emit(self.line(now), final=False)

    def close(self) -> float:
        """Print the last line; returns the elapsed seconds."""
        elapsed = time.perf_counter() - self.start
        if self.enabled:
            self._emit(self.line() + f" in {human_seconds(elapsed)}", final=True)
        return elapsed

    def _emit(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
