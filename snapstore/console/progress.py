"""A one-line progress meter on stderr (bytes, rate, ETA), shown only on a terminal."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["Meter", "human_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_UNITS[-1]}"  # pragma: no cover


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Meter:
    """Call :meth:`update` (done, total bytes) as often as you like; it redraws at most 10×/s.

    ``enabled`` defaults to "stderr is a terminal"; when disabled every call is a no-op, so
    output piped to a file or a script carries nothing extra.
    """

    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 interval: float = 0.1):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            try:
                enabled = self.stream.isatty() and os.environ.get("TERM") != "dumb"
            except (AttributeError, ValueError):
                enabled = False
        self.enabled = enabled
        self.interval = interval
        self._t0 = time.monotonic()
        self._last = 0.0
        self._width = 0
        self._drawn = False

    def update(self, done: int, total: int) -> None:
        """Record progress; redraw if due."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self._drawn and now - self._last < self.interval and done < total:
            return
        self._last = now
        elapsed = max(now - self._t0, 1e-6)
        rate = done / elapsed
        line = f"{self.label}: {human_bytes(done)} / {human_bytes(total)}"
        if total:
            line += f" ({100 * done / total:3.0f}%)"
        line += f"  {human_bytes(rate)}/s"
        if 0 < done < total and rate > 0:
            line += f"  ETA {_clock((total - done) / rate)}"
        self._draw(line)

    def _draw(self, line: str) -> None:
        pad = max(0, self._width - len(line))
        try:
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False
            return
        self._width = len(line)
        self._drawn = True

    def close(self) -> None:
        """Erase the meter line (the command's own output follows on a clean line)."""
        if self.enabled and self._drawn:
            try:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        self._drawn = False
