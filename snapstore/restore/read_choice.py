"""Which cold-read method a measurement chooses: the candidates (buffered with read-ahead, O_DIRECT
with N reads of S bytes in flight), what a probe found, and the rule that picks one and says why.
``restore.read_path`` measures and keeps the choice; ``snapstore bench`` shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BUFFERED", "CACHED", "CANDIDATES", "DIRECT_EDGE", "RESTORED", "RESTORED_EDGE", "STAY_EDGE", "Candidate",
           "Measured", "candidate", "choose", "rechoose"]

# O_DIRECT is chosen only this much faster than buffered. A buffered read also leaves the pages cached
# (issue 12 measured the next restore 1.9-2.5x slower after a direct read), and the store's direct path
# (bounce pieces in one staging slot, checked in order) reaches less of the raw O_DIRECT rate than its
# buffered path reaches of the raw buffered one: on the issue-48 VM, raw O_DIRECT 1.30x raw buffered
# (probe: 1.59x), yet the store's cold restore 1.55 GB/s direct vs 2.32 GB/s buffered (docs/benchmarks.md).
DIRECT_EDGE = 2.0
# Between the store's own cold restores, one method against the other: both figures are of the store's
# path on the data its restores read, so only noise and the page cache a buffered read leaves (with a
# RAM tier, which admits a direct-read chunk at once, standing in for it) call for a lead: O_DIRECT is
# taken RESTORED_EDGE ahead of buffered, and kept while STAY_EDGE ahead (no flapping near the edge).
RESTORED_EDGE = 1.25
STAY_EDGE = 1.1
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
        size = f"{self.piece >> 20}MiB" if self.piece % (1 << 20) == 0 else f"{self.piece >> 10}KiB"
        return f"direct {self.threads}x{size}"


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


def candidate(method: str, threads: int, piece: int) -> Candidate:
    """The candidate a kept method names (buffered: its one way; an unknown method reads buffered)."""
    return Candidate("direct", threads, piece) if method == "direct" else BUFFERED


def rechoose(timed: dict[str, float], in_force: Candidate) -> tuple[Candidate, str] | None:
    """The method the store's own large cold restores call for (``timed``: method name -> median
    bytes/s) and why, or None until they timed buffered and an O_DIRECT method both. The probe reads
    a file it has just written, which a cache below the page cache (a VM host's, a disk's) may still
    hold: there buffered reads looked 2.5x faster than they ran on data saved seconds earlier, O_DIRECT
    the same either way (docs/benchmarks.md, issue 48, fifth pass). So once both are timed, the
    restores decide: O_DIRECT taken :data:`RESTORED_EDGE` ahead of buffered, kept while
    :data:`STAY_EDGE` ahead."""
    buffered = timed.get(BUFFERED.name, 0.0)
    direct = [c for c in CANDIDATES if c.method == "direct" and timed.get(c.name, 0.0) > 0.0]
    if in_force.method == "direct" and timed.get(in_force.name, 0.0) > 0.0 and in_force not in direct:
        direct.append(in_force)
    if buffered <= 0.0 or not direct:
        return None
    best = max(direct, key=lambda c: timed[c.name])
    figures = ", ".join(f"{name} {rate / 1e9:.2f} GB/s" for name, rate in sorted(timed.items()))
    if timed[best.name] >= RESTORED_EDGE * buffered:
        pick = best
    elif in_force.method == "direct" and timed.get(in_force.name, 0.0) >= STAY_EDGE * buffered:
        pick = in_force
    else:
        return BUFFERED, (f"buffered: this store's own cold restores ({figures}) put no O_DIRECT method "
                          f"{RESTORED_EDGE:.2f}x ahead of buffered")
    return pick, (f"{pick.name}: this store's own cold restores ({figures}) ran O_DIRECT "
                  f"{timed[pick.name] / buffered:.2f}x buffered; the cost: it leaves nothing in the page cache, so "
                  "the next restore of the same chunks reads the RAM tier, which admits them at once")
