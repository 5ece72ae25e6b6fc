"""Which tier a restore's chunks come from: the RAM tier, the page cache ("warm"), the device
("cold"); the shared tier ("remote") is known to the Store by the match it restores.

A chunk served by the RAM tier is known as it is taken. For a chunk file the probe is cachestat(2),
or mincore(2) over an untouched mapping (:func:`snapstore.chunks.residency.resident`): it reads
nothing and tells cached from not *before* the read — timing a read and calling it cold when slow
would need a rate to compare against (the very thing being measured), and would confuse a busy
disk with a cold one. posix_fadvise gives no answer at all, and a RWF_NOWAIT read pulls the page
in on this kernel. A file at least half cached counts as warm.

A mincore probe costs about 16 µs a file (a mapping, the call, the unmapping), a cachestat probe
about 2 µs: on a small restore of a 12-link chain, probing every file by mincore cost a sixth of
the restore (issue 31). A chain's files are saved and read together, so they are cached together,
in runs: the first, the middle and the last file are probed, and a stretch between two probed
files that agree takes their tier, while one between two that differ is split at its middle and
probed again (:func:`probe_runs`). A chain all in one tier costs three probes; a warm root below a
cold leaf is found exactly, in a few more. An estimate probes through the store's kept descriptors
(:mod:`snapstore.chunks.open_files`) where it can, and offers those it opened and found cached to be
kept: a scheduler's store, which never restores, then opens none for a prompt it sees again (issue
31, eighth pass). A cold file is not offered: keeping it means reading its header, from the disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from snapstore._errors import CorruptionError
from snapstore.catalog.chain_cache import Stamp
from snapstore.catalog.queries import ChunkRow
from snapstore.chunks.chunkfile import HEADER_SIZE, open_chunk
from snapstore.chunks.open_files import OpenFiles
from snapstore.chunks.residency import resident
from snapstore.plan.restore_plan import PlanItem
from snapstore.restore.ramtier import RamTier

__all__ = ["TierBytes", "probe_chunks", "probe_runs", "probe_window", "tally_opened"]

TierBytes = dict[str, int]  # tier -> chunk bytes


def probe_runs(n: int, probe: Callable[[int], bool]) -> list[bool]:
    """``probe(i)`` of each of ``n`` files in read order, probing only the ends of runs (see the
    module docstring): a stretch whose probed ends agree takes their answer."""
    if n == 0:
        return []
    got: dict[int, bool] = {}

    def at(i: int) -> bool:
        if i not in got:
            got[i] = probe(i)
        return got[i]

    def span(lo: int, hi: int) -> None:
        if hi - lo <= 1:
            return
        if at(lo) == at(hi):
            for i in range(lo + 1, hi):
                got.setdefault(i, got[lo])
            return
        mid = (lo + hi) // 2
        at(mid)
        span(lo, mid)
        span(mid, hi)

    mid = (n - 1) // 2
    ends = at(0), at(mid), at(n - 1)  # all three probed, whatever the first two say
    if ends[0] == ends[1] == ends[2]:
        return [ends[0]] * n  # the usual chain, all in one tier: nothing between to split
    span(0, mid)
    span(mid, n - 1)
    return [got[i] for i in range(n)]


def probe_window(opened: Sequence[tuple[PlanItem, int, object, object]]) -> dict[int, bool]:
    """The residency of a restore window's opened chunk files (``(item, fd, header, RAM bytes)``, as
    :mod:`snapstore.restore.stream` opens them), probed before any is read, per descriptor (probed
    or inferred by :func:`probe_runs`): the tally and the stream reuse it.

    Nothing is asked for ahead: POSIX_FADV_WILLNEED on a cold chain's files (issue 31's third
    pass) shortened no cold restore on the benchmark machine, and the pages it brought in stayed
    slower to copy from for the warm restores after (docs/benchmarks.md, "Seventh pass")."""
    files: dict[int, int] = {}  # fd -> size, in read order
    for item, fd, _head, data in opened:
        if data is None and fd >= 0 and fd not in files:
            files[fd] = HEADER_SIZE + item.chunk.raw_len
    order = list(files.items())
    return dict(zip(files, probe_runs(len(order), lambda i: resident(*order[i]))))


def tally_opened(opened: Sequence[tuple[PlanItem, int, object, object]], warm: dict[int, bool],
                 tiers: TierBytes) -> None:
    """Add the bytes of a restore window's opened chunks to ``tiers`` by the residency ``warm``
    found (:func:`probe_window`) before any was read."""
    for item, fd, _head, data in opened:
        key = "ram" if data is not None else "warm" if warm.get(fd, True) else "cold"
        tiers[key] = tiers.get(key, 0) + item.chunk.raw_len


def probe_chunks(chunks: Iterable[ChunkRow], blob_path: Callable[[bytes], str], ram: RamTier | None,
                 files: OpenFiles | None = None, stamp: Stamp | None = None) -> TierBytes:
    """Where a plan's chunks are now, without reading them (``Store.estimate_restore``, a weighed
    lookup). A chunk file that cannot be opened counts as cold: the restore itself reports what is
    wrong with it. ``files``, ``stamp`` (a plan made from memory): a file kept open under the plan's
    stamp is probed through its kept descriptor, and one opened here and found cached is offered to
    be kept (a cold one is kept by the restore that reads it)."""
    first: dict[bytes, ChunkRow] = {}  # chunk files, in plan order
    in_ram: set[bytes] = set()
    listed = list(chunks)
    for chunk in listed:
        cid = chunk.id
        if cid in first or cid in in_ram:
            continue
        if ram is not None and ram.has(cid):
            in_ram.add(cid)
        else:
            first[cid] = chunk
    order = list(first.values())
    warm = dict(zip(first, probe_runs(len(order), lambda i: _probe_file(blob_path, order[i], files, stamp))))
    tiers: TierBytes = {}
    for chunk in listed:
        key = "ram" if chunk.id in in_ram else "warm" if warm[chunk.id] else "cold"
        tiers[key] = tiers.get(key, 0) + chunk.raw_len
    return tiers


def _probe_file(blob_path: Callable[[bytes], str], chunk: ChunkRow, files: OpenFiles | None,
                stamp: Stamp | None) -> bool:
    """Whether ``chunk``'s file is cached (False when it cannot be opened: the restore reports it)."""
    size = HEADER_SIZE + chunk.raw_len
    got = files.resident(stamp, chunk.id, size) if files is not None else None
    if got is not None:
        return got
    try:
        fd, st = open_chunk(blob_path(chunk.id))
    except (OSError, CorruptionError):
        return False
    try:
        got = resident(fd, size)  # before the header is read: a read would make a cold file look cached
        if got and files is not None:  # only a cached file: its header read reads nothing from the disk
            files.offer(stamp, chunk.id, fd, st.st_size, chunk.raw_len, chunk.checksum)
        return got
    finally:
        os.close(fd)
