"""The store's own large cold restores, timed per read method (issue 48): what the read path follows
once they have timed buffered and O_DIRECT both (:func:`snapstore.restore.read_choice.rechoose`).

A restore is timed only when it read at least ``PROBE_AFTER`` bytes, nearly all of them cold, and
is filed under the method its cold bytes were actually read with (compressed, small or writer-bound
chunks go buffered whatever is in force; a restore that read both ways is not timed). Each method
keeps its last :data:`KEEP` rates. The method not in force is tried on one such restore after the
first timing, and again every :data:`TRIAL_EVERY` timings: a choice rests on the store's own
figures, and a change of the storage under it shows. A new probe starts the figures afresh.
"""

from __future__ import annotations

import statistics
from collections import deque

from snapstore.restore.read_choice import RESTORED

__all__ = ["ALL_COLD", "KEEP", "TRIAL_EVERY", "Timings"]

KEEP = 3  # a method's last this many timed restores count (their median)
TRIAL_EVERY = 16  # the method not in force is tried again after this many timed restores
ALL_COLD = 0.9  # a restore is timed only when at least this share of its bytes read cold


class Timings:
    """Rates (bytes/s) of the store's large cold restores per method name; not thread-safe (the
    read path holds its lock around every call)."""

    __slots__ = ("_by", "_since_trial", "_tried")

    def __init__(self) -> None:
        self._by: dict[str, deque[float]] = {}
        self._since_trial = 0  # timed restores since the last trial
        self._tried: set[str] = set()  # methods a trial began for (one that read otherwise waits its turn)

    def seed(self, figures: dict[str, float]) -> None:
        """A kept row's figures of the store's restores (:data:`RESTORED` keys), for methods not timed here."""
        for name, rate in figures.items():
            method = name[len(RESTORED):]
            if name.startswith(RESTORED) and rate > 0.0 and method not in self._by:
                self._by[method] = deque([rate], maxlen=KEEP)

    def clear(self) -> None:
        """Start afresh (a new probe: the storage may have changed)."""
        self._by.clear()
        self._tried.clear()
        self._since_trial = 0

    def add(self, method: str, rate: float) -> None:
        """One timed restore read with ``method``."""
        self._by.setdefault(method, deque(maxlen=KEEP)).append(rate)
        self._since_trial += 1

    def medians(self) -> dict[str, float]:
        """Each timed method's median of its last restores."""
        return {k: statistics.median(v) for k, v in self._by.items() if v}

    def trial_due(self, other: str) -> bool:
        """Whether the method ``other`` (not in force) should be tried on the next large cold restore:
        never timed nor tried, or :data:`TRIAL_EVERY` timings since the last trial. Counts the trial as begun."""
        if self._since_trial < TRIAL_EVERY and (other in self._by or other in self._tried):
            return False
        self._tried.add(other)
        self._since_trial = 0
        return True
