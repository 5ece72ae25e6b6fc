"""Write admission: which saves may write at all, before a byte is written (issue 32, part 2).

Two independent rules, each skipping a save with a reason (counted as ``skipped:<reason>``, never
blocking the caller):

- **The write rate** (``Budget(write_bytes_per_hour=N)``, ``$SNAPSTORE_WRITE_BYTES_PER_HOUR``): a
  token bucket over the bytes saves actually store. It holds at most ``N`` bytes of credit (one
  hour's worth) and refills at ``N / 3600`` bytes a second. A save is admitted while the bucket
  holds credit (level > 0); when it commits, the bytes it newly stored are taken from the bucket
  (chunks deduplicated against the store, and a snapshot that already existed, cost nothing), which
  may leave it in debt until the refill pays it back. So over any interval of ``T`` seconds the
  store commits at most ``N + N·T/3600`` bytes plus the size of the saves in flight when the credit
  ran out. The bucket is one catalog row, shared by every process of the store (each refills it at
  its own configured rate). Skipped saves: ``write_budget``.
- **Second hit** (``Store.open(admit="second_hit")``): a prefix is written only the second time
  a save of it is seen within a window (``$SNAPSTORE_ADMIT_WINDOW_S``, 3600 s); the first sighting
  is remembered in the catalog (8 bytes of key and a time, bounded to ``MAX_SIGHTINGS`` rows,
  oldest dropped first). A save naming a ``session`` is always admitted: the caller said the
  conversation continues, so its own chain is worth writing. Skipped saves: ``first_sighting``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from snapstore._config import Budget, env_seconds
from snapstore._errors import ConfigError
from snapstore.catalog.queries import Txn

__all__ = ["ADMIT_MODES", "DEFAULT_WINDOW_S", "MAX_SIGHTINGS", "Admission", "WriteRate", "admission_of",
           "sighting_key"]

log = logging.getLogger("snapstore")

ADMIT_MODES = ("always", "second_hit")
DEFAULT_ADMIT = "always"  # docs/api.md "Write admission": measured in docs/benchmarks.md
DEFAULT_WINDOW_S = 3600.0
# 100,000 sightings: ~2-3 MB of catalog at most, and a window's worth of one-off prompts at ~28 a second
MAX_SIGHTINGS = 100_000
HOUR_S = 3600.0


@dataclass(frozen=True)
class WriteRate:
    """The rate rule as arithmetic (no I/O): a token bucket of ``per_hour`` bytes refilled over an hour."""

    per_hour: int

    @property
    def capacity(self) -> float:
        return float(self.per_hour)

    def level(self, state: tuple[float, float] | None, now: float) -> float:
        """The credit at ``now`` of a bucket that held ``level`` at ``at`` (a new bucket starts full;
        a clock that went back refills nothing)."""
        if state is None:
            return self.capacity
        level, at = state
        return min(self.capacity, level + self.per_hour * max(0.0, now - at) / HOUR_S)

    @staticmethod
    def admits(level: float) -> bool:
        """A save may start while any credit is left (it may then take the bucket into debt)."""
        return level > 0


def sighting_key(identity_key: str, namespace: str, prefix_key: bytes) -> int:
    """The catalog key of one prefix of one identity and namespace: 8 bytes of BLAKE2b, signed
    (an SQLite integer). A collision only admits a save early; it never loses data."""
    h = hashlib.blake2b(digest_size=8)
    for piece in (identity_key.encode(), namespace.encode(), prefix_key):
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(frozen=True)
class Admission:
    """One store's admission rules: the mode, the window of a sighting, and the write rate (or None)."""

    mode: str = DEFAULT_ADMIT
    rate: WriteRate | None = None
    window_s: float = DEFAULT_WINDOW_S
    max_sightings: int = MAX_SIGHTINGS
    clock: Callable[[], float] = field(default=time.time, compare=False)

    def first_sighting(self, t: Txn, key: int) -> bool:
        """Under ``second_hit``: True when this is the first sighting of ``key`` in the window
        (remembered now; the save is skipped), False when it was seen before (forgotten; admitted)."""
        if self.mode != "second_hit":
            return False
        now = self.clock()
        not_before = now - self.window_s
        if t.sighting(key, not_before):
            t.forget_sighting(key)
            return False
        t.record_sighting(key, now)
        t.prune_sightings(not_before, self.max_sightings)
        return True

    def over_rate(self, t: Txn) -> bool:
        """True when the shared write bucket holds no credit (the save is skipped: ``write_budget``)."""
        if self.rate is None:
            return False
        level = self.rate.level(t.write_bucket(), self.clock())
        if self.rate.admits(level):
            return False
        log.info("snapstore: save skipped (write_budget): the write rate of %d bytes an hour is spent "
                 "(%.0f bytes in debt)", self.rate.per_hour, -level)
        return True

    def debit(self, t: Txn, nbytes: int) -> None:
        """Take the bytes a committing save newly stored from the bucket (in its transaction)."""
        if self.rate is None:
            return
        now = self.clock()
        t.set_write_bucket(self.rate.level(t.write_bucket(), now) - nbytes, now)


def admission_of(admit: str | None, budget: Budget) -> Admission:
    """Store.open's admission: ``admit`` (else ``$SNAPSTORE_ADMIT``, else "always"), the window
    (``$SNAPSTORE_ADMIT_WINDOW_S``) and the resolved budget's write rate. ConfigError when malformed."""
    mode = admit if admit is not None else (os.environ.get("SNAPSTORE_ADMIT", "").strip() or DEFAULT_ADMIT)
    if mode not in ADMIT_MODES:
        raise ConfigError(f"admit must be one of {list(ADMIT_MODES)} (or $SNAPSTORE_ADMIT), got {mode!r}")
    per_hour = budget.write_bytes_per_hour
    rate = WriteRate(int(per_hour)) if per_hour else None
    return Admission(mode, rate, env_seconds("SNAPSTORE_ADMIT_WINDOW_S", DEFAULT_WINDOW_S))
