"""How fast this store restores, per tier, measured from its own restores (issue 32, part 1).

Each successful restore reports the chunk bytes it read per tier (:mod:`snapstore.restore.tier_probe`)
and the seconds it took. Per tier the model keeps exponentially decayed sums (five numbers, see
:class:`TierFit`) and fits ``seconds = a + b × bytes`` to them, least relative error — a fixed cost
per restore (plan, file opens) plus a rate — or, when the sizes seen are too alike to separate the
two (or the fit is not sensible), the mean seconds per byte. Decayed sums follow a drifting
machine (a neighbour's load, a page cache that fills).

A restore spanning tiers (a chain whose root sits in the RAM tier and leaf on disk) is estimated as
the largest fixed cost of its tiers plus each tier's bytes at that tier's rate; its measured time is
shared among its tiers in proportion to what the model predicted for each before it is added.

Before a tier has been seen its estimate is a stated guess (:data:`GUESS_BYTES_PER_S`, and
:data:`GUESS_FIXED_S` per restore) and the estimate says so (``measured=False``).

The sums live in the catalog (``restore_rates``, :mod:`snapstore.catalog.rate_queries`): loaded at open
(read-only stores too), and handed to the store's bookkeeping (:class:`snapstore.lifecycle.bookkeeping.Ledger`)
at most every :data:`STAGE_EVERY_S` seconds and at close, so a restore never writes for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping

from snapstore._results import RestoreEstimate
from snapstore.catalog.rate_queries import RateRow

__all__ = ["DECAY", "DISK_TIERS", "GUESS_BYTES_PER_S", "GUESS_FIXED_S", "LOCAL_TIERS", "STAGE_EVERY_S", "TIERS",
           "RestoreRates", "TierFit"]

TIERS = ("ram", "warm", "cold", "remote")
LOCAL_TIERS = ("ram", "warm", "cold")  # where a local snapshot's chunks can be
DISK_TIERS = ("warm", "cold")  # ... in a store without a RAM tier
# The guesses before a tier is measured: below what docs/benchmarks.md measured on the 2-vCPU
# reference machine (a restore into fresh pages is bound by page faults at ~1.3-2 GB/s, even warm;
# a cold read ~2.2 GB/s; the shared tier depends on the network), so a first guess leans to recompute
# only where recomputing is clearly faster.
GUESS_BYTES_PER_S: dict[str, float] = {"ram": 4e9, "warm": 2e9, "cold": 1e9, "remote": 1e8}
GUESS_FIXED_S = 0.001
DECAY = 0.9  # the weight an earlier restore keeps at each new one of its tier (about the last 10 count)
STAGE_EVERY_S = 30.0  # persisted at most this often (and at close)
# Once a tier has _SETTLED samples, a restore counts as at most _CLAMP times faster or slower than
# predicted: one 13 s stall of a 0.5 s cold read (seen on the shared benchmark VM) otherwise held
# every cold estimate 4x high for the next ten restores; a real change still converges (about 10% a restore).
_SETTLED = 3
_CLAMP = 2.0
_SPREAD = 0.25  # 1/size must vary by this fraction of its mean (std dev) before a fixed cost is fitted


class TierFit:
    """One tier's decayed sums and the line fitted to them.

    The fit minimises the *relative* error of ``seconds = a + b × bytes`` (each restore weighs the
    same whatever its size): with ``u = 1 / bytes`` and ``v = seconds / bytes`` it is the ordinary
    least-squares line ``v = b + a × u``, kept as the sums of ``u``, ``v``, ``u²`` and ``u·v``.
    An absolute fit let the big restores decide alone, and a small one's estimate was off by 5×.
    """

    __slots__ = ("samples", "su", "suu", "suv", "sv", "w")

    def __init__(self, w: float = 0.0, su: float = 0.0, sv: float = 0.0, suu: float = 0.0, suv: float = 0.0,
                 samples: int = 0) -> None:
        self.w, self.su, self.sv, self.suu, self.suv, self.samples = w, su, sv, suu, suv, samples

    def add(self, x: float, y: float) -> None:
        """One restore of ``x`` bytes in ``y`` seconds; earlier ones decay by :data:`DECAY`."""
        d, u, v = DECAY, 1.0 / x, y / x
        self.w = self.w * d + 1.0
        self.su = self.su * d + u
        self.sv = self.sv * d + v
        self.suu = self.suu * d + u * u
        self.suv = self.suv * d + u * v
        self.samples += 1

    def line(self) -> tuple[float, float]:
        """``(a, b)``: fixed seconds per restore and seconds per byte."""
        if self.w <= 0.0:
            return 0.0, 0.0
        mu, mv = self.su / self.w, self.sv / self.w
        var = self.suu / self.w - mu * mu
        cov = self.suv / self.w - mu * mv
        if var > (_SPREAD * mu) ** 2 and cov > 0.0:
            a = cov / var
            b = mv - a * mu
            if b > 0.0:
                return a, b
        return 0.0, mv  # sizes too alike (or no sensible line): the mean seconds per byte

    def bytes_per_s(self) -> float:
        """The measured rate: bytes per second of the mean seconds per byte."""
        return self.w / self.sv if self.sv > 0.0 else 0.0


def _guess(tier: str) -> tuple[float, float]:
    return GUESS_FIXED_S, 1.0 / GUESS_BYTES_PER_S[tier]


class RestoreRates:
    """A store's restore model: observe restores, estimate them, hand changes over for persisting."""

    def __init__(self, rows: Iterable[RateRow] = ()) -> None:
        self._lock = threading.Lock()
        self._fits: dict[str, TierFit] = {}
        self._dirty: set[str] = set()
        self._staged_at = 0.0  # monotonic time of the last hand-over (0: none yet, the first is at once)
        self.load(rows)

    def load(self, rows: Iterable[RateRow]) -> None:
        """Take the sums a catalog holds (unknown tier names are ignored: a newer version's)."""
        with self._lock:
            for r in rows:
                if r.tier in TIERS and r.w > 0.0:
                    self._fits[r.tier] = TierFit(r.w, r.su, r.sv, r.suu, r.suv, r.samples)

    def _line(self, tier: str) -> tuple[tuple[float, float], bool]:
        fit = self._fits.get(tier)
        if fit is None or fit.samples == 0:
            return _guess(tier), False
        return fit.line(), True

    def estimate(self, tiers: Mapping[str, int]) -> RestoreEstimate:
        """The estimate for a restore reading ``tiers`` (tier -> chunk bytes)."""
        with self._lock:
            return self._estimate(tiers)

    def bound(self, nbytes: int, tiers: Iterable[str] = LOCAL_TIERS) -> RestoreEstimate:
        """An upper bound on a local restore of ``nbytes`` chunk bytes wherever they are among
        ``tiers`` (a store without a RAM tier leaves "ram" out): the largest fixed cost of those tiers
        plus the bytes at the slowest rate (``bound=True``, nothing probed; ``measured``: every one
        of them measured). No mix of them costs more, by :meth:`estimate`'s sum."""
        with self._lock:
            lines = {t: self._line(t) for t in tiers}
        fixed = max(a for (a, _), _ in lines.values())
        slowest = max(lines, key=lambda t: lines[t][0][1])
        return RestoreEstimate(fixed + lines[slowest][0][1] * nbytes, slowest, nbytes,
                               all(seen for _, seen in lines.values()), {}, True)

    def _estimate(self, tiers: Mapping[str, int]) -> RestoreEstimate:
        present = {t: int(n) for t, n in tiers.items() if n > 0}
        if not present:
            return RestoreEstimate(0.0, "ram", 0, all(self._line(t)[1] for t in tiers), dict(tiers))
        fixed, total, measured = 0.0, 0.0, True
        slowest, worst = "", -1.0
        for t, n in present.items():
            (a, b), seen = self._line(t)
            measured &= seen
            fixed = max(fixed, a)
            cost = a + b * n
            total += b * n
            if cost > worst:
                slowest, worst = t, cost
        return RestoreEstimate(fixed + total, slowest, sum(present.values()), measured, present)

    def observe(self, tiers: Mapping[str, int], seconds: float) -> None:
        """A successful restore that read ``tiers`` (tier -> chunk bytes) in ``seconds``."""
        present = {t: n for t, n in tiers.items() if n > 0 and t in TIERS}
        if not present or seconds <= 0.0:
            return
        with self._lock:
            predicted = {}
            for t, n in present.items():
                (a, b), _ = self._line(t)
                predicted[t] = a + b * n
            whole = sum(predicted.values())
            for t, n in present.items():
                share = predicted[t] / whole if whole > 0.0 else n / sum(present.values())
                fit = self._fits.setdefault(t, TierFit())
                y = seconds * share
                if fit.samples >= _SETTLED:  # an outlier (a neighbour's burst of I/O) moves the figure, boundedly
                    y = min(max(y, predicted[t] / _CLAMP), predicted[t] * _CLAMP)
                fit.add(float(n), y)
                self._dirty.add(t)

    def staged(self, *, force: bool = False, now: float | None = None) -> list[RateRow]:
        """The rows to persist now: the tiers changed since the last hand-over, if :data:`STAGE_EVERY_S`
        passed since it (or ``force``); [] otherwise. Call :meth:`unstage` if they were not written."""
        t = time.monotonic() if now is None else now
        with self._lock:
            if not self._dirty or (not force and self._staged_at and t - self._staged_at < STAGE_EVERY_S):
                return []
            wall = time.time()
            rows = [RateRow(k, f.w, f.su, f.sv, f.suu, f.suv, f.samples, wall)
                    for k, f in sorted(self._fits.items()) if k in self._dirty]
            self._dirty.clear()
            self._staged_at = t
            return rows

    def flush_next(self) -> None:
        """Hand what changed over at the next :meth:`staged` call, however recent the last (close())."""
        with self._lock:
            self._staged_at = 0.0

    def unstage(self, rows: Iterable[RateRow]) -> None:
        """Rows :meth:`staged` handed over that were not written: persisted with the next hand-over."""
        with self._lock:
            self._dirty.update(r.tier for r in rows)

    def rates(self) -> dict[str, float]:
        """Measured bytes per second per tier seen (for ``Store.stats().restore_rates``)."""
        with self._lock:
            return {t: f.bytes_per_s() for t, f in sorted(self._fits.items()) if f.samples}
