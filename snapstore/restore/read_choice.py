"""Which cold-read method a measurement chooses: the candidates (buffered with read-ahead, O_DIRECT
with N reads of S bytes in flight), what a probe found, and the rule that picks one and says why.
``restore.read_path`` measures and keeps the choice; ``snapstore bench`` shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BUFFERED", "CACHED", "CANDIDATES", "DIRECT_EDGE", "RESTORED", "RESTORED_EDGE", "Candidate", "Measured",
           "choose", "rechoose"]

# O_DIRECT is chosen only this much faster than buffered. A buffered read also leaves the pages cached
# (issue 12 measured the next restore 1.9-2.5x slower after a direct read), and the store's direct path
# (bounce pieces in one staging slot, checked in order) reaches less of the raw O_DIRECT rate than its
# buffered path reaches of the raw buffered one: on the issue-48 VM, raw O_DIRECT 1.30x raw buffered
# (probe: 1.59x), yet the store's cold restore 1.55 GB/s direct vs 2.32 GB/s buffered (docs/benchmarks.md).
DIRECT_EDGE = 2.0
# Between the store's own cold restores, one method against the other: both figures are of the store's
# paths, on the data its restores read, so only noise and the page cache a buffered read leaves (a RAM
# tier, which admits direct-read chunks at once, stands in for it) call for a lead.
RESTORED_EDGE = 1.25
RESTORED = "restored: "  # a figures key: the store's own cold restores with that method (median bytes/s)
_BUFFERED_PIECE = 4 << 20  # a buffered read's request, as the restore's buffered path (restore.stream)
_BUFFERED_LANES = 2  # files read at once by the buffered path (restore.stream's reader lanes)


@dataclass(frozen=True)
class Candidate:
    """One way of reading cold chunk files: buffered (page cache, read-ahead) or O_DIRECT with
    ``threads`` reads of ``piece`` bytes in flight (pieces fit one 16 MiB staging slot)."""

    method: str  # "buffered" | "direct"
    threads: int
    piece: int

    @property
    def name(self) -> str:
        """As reports show it: ``buffered`` or ``direct 8x1MiB``."""
        if self.method == "buffered":
            return "buffered"
        return f"direct {self.threads}x{self.piece >> 20}MiB"


BUFFERED = Candidate("buffered", _BUFFERED_LANES, _BUFFERED_PIECE)
CACHED = "buffered, cached"  # the figure of a buffered read straight after one: what O_DIRECT gives up
CANDIDATES: tuple[Candidate, ...] = (BUFFERED, Candidate("direct", 8, 1 << 20), Candidate("direct", 4, 4 << 20))


@dataclass(frozen=True)
class Measured:
    """What :func:`measure` found: each method's median rate (bytes/s; 0: the file system refused it),
    the one chosen and why, and whether the page cache could be dropped (else the figures are of cached reads)."""

    rates: dict[str, float]
    chosen: Candidate
    reason: str
    dropped: bool


def choose(rates: dict[str, float], candidates: Sequence[Candidate] = CANDIDATES) -> tuple[Candidate, str]:
    """The fastest candidate by ``rates`` (name -> bytes/s) and a line saying why; O_DIRECT only when
    :data:`DIRECT_EDGE` ahead of buffered (a buffered read also leaves the pages cached)."""
    buffered = rates.get(BUFFERED.name, 0.0)
    direct = [c for c in candidates if c.method == "direct" and rates.get(c.name, 0.0) > 0.0]
    best = max(direct, key=lambda c: rates[c.name], default=None)

    def gbs(c: Candidate) -> str:
        return f"{c.name} {rates[c.name] / 1e9:.2f} GB/s"

    if best is None:
        return BUFFERED, f"buffered {buffered / 1e9:.2f} GB/s; O_DIRECT refused by this file system"
    if buffered <= 0.0 or rates[best.name] >= DIRECT_EDGE * buffered:
        cached = rates.get(CACHED, 0.0)
        cost = f" ({cached / 1e9:.2f} GB/s from the page cache)" if cached > 0.0 else ""
        return best, (f"{gbs(best)} vs {gbs(BUFFERED)}: O_DIRECT reads {rates[best.name] / max(buffered, 1.0):.2f}x "
                      "as fast here; the cost: it leaves nothing in the page cache, so the next restore of the "
                      f"same chunks reads the device again instead of the cache{cost}, unless the RAM tier holds them")
    x = rates[best.name] / buffered
    lead = "buffered reads are faster here" if x < 1.0 else f"O_DIRECT is not {DIRECT_EDGE:.2f}x ahead"
    return BUFFERED, (f"{gbs(BUFFERED)} vs {gbs(best)}: {lead} (O_DIRECT {x:.2f}x), and buffered reads leave "
                      "the pages cached")


def rechoose(probe: dict[str, float], restored: dict[str, float],
             candidates: Sequence[Candidate] = CANDIDATES) -> tuple[Candidate, str] | None:
    """The method the store's own large cold restores (``restored``: method name -> median bytes/s)
    call for, against the probe's figures (``probe``), and why; None while they say nothing the probe
    did not (no buffered restore timed yet). The probe reads a file it has just written, which a
    cache below the page cache (a VM host's, a disk's) may still hold: there buffered reads looked
    2.5x faster than they ran on data saved seconds earlier, O_DIRECT's nearly the same
    (docs/benchmarks.md, issue 48, fifth pass). So a method the store has timed is judged by its
    restores (:data:`RESTORED_EDGE` ahead of buffered), an untimed direct one by the probe's raw figure
    (:data:`DIRECT_EDGE` ahead)."""
    buffered = restored.get(BUFFERED.name, 0.0)
    if buffered <= 0.0:
        return None
    best: Candidate | None = None
    best_rate = 0.0
    for c in candidates:
        if c.method != "direct":
            continue
        own = restored.get(c.name, 0.0)
        rate, edge = (own, RESTORED_EDGE) if own > 0.0 else (probe.get(c.name, 0.0), DIRECT_EDGE)
        if rate >= edge * buffered and rate > best_rate:
            best, best_rate = c, rate
    timed = ", ".join(f"{name} {rate / 1e9:.2f} GB/s" for name, rate in sorted(restored.items()))
    if best is None:
        return BUFFERED, (f"buffered: this store's own cold restores ({timed}) leave no direct method "
                          f"{RESTORED_EDGE:.2f}x ahead (timed) or {DIRECT_EDGE:.2f}x (probed, "
                          f"{', '.join(f'{k} {v / 1e9:.2f} GB/s' for k, v in sorted(probe.items()))})")
    how = "timed by its restores" if best.name in restored else "probed"
    return best, (f"{best.name} {best_rate / 1e9:.2f} GB/s ({how}) vs this store's own buffered cold restores "
                  f"{buffered / 1e9:.2f} GB/s (restores: {timed}): O_DIRECT {best_rate / buffered:.2f}x; the "
                  "cost: it leaves nothing in the page cache, so the next restore of the same chunks reads the "
                  "RAM tier, which admits them at once")
