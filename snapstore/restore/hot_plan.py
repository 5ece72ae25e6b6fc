"""A kept restore plan (:mod:`snapstore.restore.hot`) and its replay: the header pass, then each
chunk read into its place and checked against the catalog's checksum, from the RAM tier where it
holds the chunk. Which files are cold is found before a header read could bring them in; the small
ones are asked for at once (the module docstring of :mod:`snapstore.restore.hot`).
"""

from __future__ import annotations

import errno
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from snapstore.catalog.chain_cache import Stamp
from snapstore.catalog.queries import ChunkRow, SnapRow
from snapstore.chunks.chunkfile import HEADER_SIZE
from snapstore.chunks.residency import resident
from snapstore.restore.ramtier import RamTier

__all__ = ["AHEAD_MAX", "NOWAIT", "Chunk", "HotPlan", "Unreadable", "ask_ahead", "headers_stand", "read_all"]

NOWAIT = getattr(os, "RWF_NOWAIT", 0)

# per chunk: its file's descriptor, its pieces (file offset, destination index, start, end), its catalog row
Chunk = tuple[int, tuple[tuple[int, int, int, int], ...], ChunkRow]


class Unreadable(Exception):
    """A replay's read failed, came up short or did not match its checksum."""


@dataclass(eq=False)
class HotPlan:
    """One kept restore (module docstring): what to read where, and what the restore returns."""

    key: tuple[Any, ...]
    wal: bytes | None  # the WAL-index header it stands under (None: asks the catalog's generation)
    stamp: Stamp  # the catalog stamp its rows were read under
    dests: tuple[tuple[weakref.ref[np.ndarray], tuple[int, ...], np.dtype[Any]], ...]
    chunks: tuple[Chunk, ...]
    fds: tuple[int, ...]
    heads: tuple[tuple[int, bytes, int], ...]  # (descriptor, the header bytes checked against the row, file size)
    snap: SnapRow
    n_tokens: int
    rows: dict[str, int]
    missing: frozenset[str]
    chain: list[int]
    nbytes: int
    busy: int = 0
    dead: bool = False
    nowait: bool = field(default=bool(NOWAIT))  # the file system takes RWF_NOWAIT (else: probed)


# Cold chunk files up to this size (header included) are asked for all at once before a replay
# reads any (:func:`ask_ahead`); larger ones are brought in by their own reads.
AHEAD_MAX = 128 << 10


def ask_ahead(cold: Iterable[tuple[int, int]]) -> None:
    """Ask the kernel at once for the small files among a replay's cold ones (``(fd, file size)``,
    found before any was read), so their device round trips overlap instead of coming one per file
    in turn: a replay reads on the caller's thread, one file after the other. (The full path reads
    two files at once with its reader thread and asks for nothing: there the hint gained nothing.)

    Only files up to :data:`AHEAD_MAX`: on files of 1 MiB and more POSIX_FADV_WILLNEED made a cold
    replay 1.2-1.6x slower than the files' own readahead, and the warm restores after it too (its
    pages came in slower to copy from); at 256 KiB it gained 0-15% cold in two comparisons and cost
    ~40% on the first warm replay after; at 85 KiB a 12-link chain replayed cold ~1.5x faster with
    it (docs/benchmarks.md, "Issue 48, fourth pass"; issue 31's "Seventh pass" for the full path).
    A hint that fails is of no consequence: the reads follow."""
    for fd, size in cold:
        if size <= AHEAD_MAX:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass


def headers_stand(plan: HotPlan) -> set[int] | None:
    """Is every file of the plan still headed as when it was checked? Each header is read again
    before anything is written, as the full path re-reads a kept file's. Returns the files whose
    pages were not cached (their chunks are "cold"), or None: a header changed, or could not be read
    (the full path opens the file and reports what it finds).

    Which files are cold is known before a header read could bring their pages in (as the full path
    probes them before its header reads): with RWF_NOWAIT, by the header read itself (one that would
    wait reads nothing), else by a residency probe. The small cold files are then asked for at once
    (:func:`ask_ahead`)."""
    cold: set[int] = set()
    unread = list(plan.heads)
    try:
        if plan.nowait:
            buf = bytearray(HEADER_SIZE)
            unread = []
            for head in plan.heads:
                try:
                    got = os.preadv(head[0], [buf], 0, NOWAIT)
                except BlockingIOError:
                    got = 0
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    plan.nowait = False  # this file system does not take the flag: probed from now on
                    return headers_stand(plan)
                if got != HEADER_SIZE:
                    cold.add(head[0])
                    unread.append(head)
                elif buf != head[1]:
                    return None
        else:
            cold = {fd for fd, _, size in plan.heads if not resident(fd, size)}
        if cold:  # a steady replay (every file cached) walks nothing more
            ask_ahead((fd, size) for fd, _, size in plan.heads if fd in cold)
        if any(os.pread(fd, HEADER_SIZE, 0) != raw for fd, raw, _ in unread):
            return None
    except OSError:
        return None
    return cold


def read_all(plan: HotPlan, views: list[memoryview], tiers: dict[str, int], held: list[memoryview | None] | None,
              ram: RamTier | None, cold: set[int]) -> None:
    """Write every chunk of ``plan`` into ``views``: from the RAM tier where ``held`` has it, else read
    from its file and checked; Unreadable or OSError on failure. ``cold``: the files found not
    cached, whose bytes count "cold". The chunks read from files are offered to ``ram`` once all are
    written (one lock); a replay that fails offers none (the full path that follows does)."""
    digest = xxhash.xxh3_128_digest
    asked = [bool(cold)]  # the later small files were asked for (cold ones found, or a read that waited)
    read: list[ChunkRow] = []  # chunks read from their files: offered to the RAM tier at the end
    for i, (fd, pieces, row) in enumerate(plan.chunks):
        data = held[i] if held is not None else None
        if data is not None:
            for _, d, start, end in pieces:
                at = start - pieces[0][2]
                views[d][start:end] = data[at:at + end - start]
            tiers["ram"] += row.raw_len
            continue
        # a file found cold is read blocking; a cached one without waiting (or, without RWF_NOWAIT,
        # blocking and counted warm: the header pass probed it)
        kind = "cold" if fd in cold else "" if plan.nowait else "warm"
        if len(pieces) == 1:
            off, d, start, end = pieces[0]
            view = views[d][start:end]
            _read(plan, i, fd, view, off, tiers, kind, asked)
            if digest(view) != row.checksum:
                raise Unreadable("checksum")
        else:
            h = xxhash.xxh3_128()
            for off, d, start, end in pieces:
                view = views[d][start:end]
                _read(plan, i, fd, view, off, tiers, kind, asked)
                h.update(view)
            if h.digest() != row.checksum:
                raise Unreadable("checksum")
        read.append(row)
    if ram is not None and read:  # admitted off this thread, from the file tier, as the full path offers them
        ram.offer_all(read)


def _read(plan: HotPlan, i: int, fd: int, view: memoryview, off: int, tiers: dict[str, int], kind: str,
          asked: list[bool]) -> None:
    """Read ``view``: from the page cache without waiting where the file system takes RWF_NOWAIT (those
    bytes are "warm"); what would wait is read blocking ("cold"). The first such read, in a replay
    that found no file cold (a file whose header was cached but not its payload), asks for the later
    small files at once, as the header pass does for cold ones. ``kind``: the tier of a file read
    without the flag."""
    if kind:
        _fill(fd, view, off, tiers, kind)
        return
    try:
        got = os.preadv(fd, [view], off, NOWAIT)
    except BlockingIOError:
        got = 0
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        plan.nowait = False  # this file system does not take the flag: probed from the next replay on
        _fill(fd, view, off, tiers, "warm")
        return
    tiers["warm"] += got
    if got == len(view):
        return
    if not asked[0]:
        asked[0] = True
        later = {c[0] for c in plan.chunks[i + 1:]}
        ask_ahead((f, size) for f, _, size in plan.heads if f in later)
    _fill(fd, view[got:], off + got, tiers, "cold")


def _fill(fd: int, view: memoryview, off: int, tiers: dict[str, int], kind: str) -> None:
    """Read all of ``view`` from ``fd`` at ``off`` (blocking), its bytes counted as ``kind``;
    Unreadable if the file ends first."""
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:] if done else view], off + done)
        if got <= 0:
            raise Unreadable("short read")
        done += got
    tiers[kind] += n
