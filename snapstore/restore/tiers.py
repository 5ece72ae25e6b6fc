"""Which tier a restore's chunks come from: the RAM tier, the page cache ("warm"), the device
("cold"); the shared tier ("remote") is known to the Store by the match it restores.

A chunk served by the RAM tier is known as it is taken. For a chunk file the probe is mincore(2)
over an untouched mapping (:func:`snapstore.chunks.direct_io.resident`): it reads nothing, costs a
few microseconds a file, and tells cached from not *before* the read — timing a read and calling
it cold when slow would need a rate to compare against (the very thing being measured), and would
confuse a busy disk with a cold one. posix_fadvise gives no answer at all, and a RWF_NOWAIT read
pulls the page in on this kernel. A file at least half cached counts as warm.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from snapstore._errors import CorruptionError
from snapstore.catalog.queries import ChunkRow
from snapstore.chunks.chunkfile import HEADER_SIZE, open_chunk
from snapstore.chunks.direct_io import resident
from snapstore.plan.restore_plan import PlanItem
from snapstore.restore.ramtier import RamTier

__all__ = ["Tiers", "probe_chunks", "tally_opened"]

Tiers = dict[str, int]  # tier -> chunk bytes


def tally_opened(opened: Sequence[tuple[PlanItem, int, object, object]], tiers: Tiers) -> None:
    """Add the bytes of a restore window's opened chunks (``(item, fd, header, RAM bytes)``, as
    :mod:`snapstore.restore.stream` opens them) to ``tiers``, probing each file once before it is read."""
    cached: dict[int, bool] = {}
    for item, fd, _head, data in opened:
        n = item.chunk.raw_len
        if data is not None:
            tiers["ram"] = tiers.get("ram", 0) + n
            continue
        if fd not in cached:
            cached[fd] = resident(fd, HEADER_SIZE + n)
        key = "warm" if cached[fd] else "cold"
        tiers[key] = tiers.get(key, 0) + n


def probe_chunks(chunks: Iterable[ChunkRow], blob_path: Callable[[bytes], str], ram: RamTier | None) -> Tiers:
    """Where a plan's chunks are now, without reading them (``Store.estimate_restore``). A chunk
    file that cannot be opened counts as cold: the restore itself reports what is wrong with it."""
    tiers: Tiers = {}
    seen: dict[bytes, str] = {}
    for chunk in chunks:
        cid, n = chunk.id, chunk.raw_len
        key = seen.get(cid)
        if key is None:
            key = "ram" if ram is not None and ram.holds(cid) else _probe_file(blob_path, cid, n)
            seen[cid] = key
        tiers[key] = tiers.get(key, 0) + n
    return tiers


def _probe_file(blob_path: Callable[[bytes], str], cid: bytes, n: int) -> str:
    try:
        fd, _ = open_chunk(blob_path(cid))
    except (OSError, CorruptionError):
        return "cold"
    try:
        return "warm" if resident(fd, HEADER_SIZE + n) else "cold"
    finally:
        os.close(fd)
