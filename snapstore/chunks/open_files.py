"""Small chunk files kept open, with their checked headers, while the catalog generation stands.

A repeated small restore (a system prompt's 3K tokens in a dozen chain links, issue 31) spent a
fifth of its time opening files: per link a path built and its fan-out directory checked, an
open, fstat and fcntl, a header read and parsed. :class:`OpenFiles` keeps, for the plans a store
made from memory (:class:`snapstore.catalog.chain_cache.ChainCache`), the descriptor of each small
chunk file it opened and the header it checked against the catalog, under the catalog stamp the
plan was read with. The generation moves in the transaction of every change to a chunk row
(deleted, quarantined, healed, republished), so a kept descriptor is only ever used for the row it
was checked against; a plan of a newer stamp closes every kept one first.

A restore takes a duplicate (``os.dup``) and closes it as it closes the files it opened itself,
so dropping a kept descriptor never pulls one from under a reader. Every chunk is still
checksummed as it lands: damage in place is found as before, and the quarantine that follows
moves the generation. A kept descriptor of a file another process unlinked keeps its bytes on
disk until this process plans under the new generation or closes the store: at most
``_MAX_BYTES`` per store, small files only (docs/format.md, "Open chunk files").
"""

from __future__ import annotations

import os
import resource
from collections import OrderedDict
from collections.abc import Iterable

from snapstore._forks import ProcessLock
from snapstore.catalog.chain_cache import Stamp, stamp_moves
from snapstore.chunks.chunkfile import ChunkHeader, header_matches

__all__ = ["OpenFiles"]

_MAX_FILE = 4 << 20  # only chunk files this small are kept: a large read is not dominated by its open
_MAX_BYTES = 64 << 20  # file bytes kept open at most (what an unlinked file holds on disk until dropped)
_MAX_FILES = 128  # descriptors kept at most (and never more than a sixteenth of the open-file limit)

_Kept = tuple[int, ChunkHeader, int]  # descriptor, checked header, file size


def _fd_budget() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 0
    return _MAX_FILES if soft == resource.RLIM_INFINITY else min(_MAX_FILES, soft // 16)


class OpenFiles:
    """Descriptors of small chunk files, checked under one catalog stamp (module docstring)."""

    def __init__(self, max_files: int | None = None, max_bytes: int = _MAX_BYTES) -> None:
        self._max_files = _fd_budget() if max_files is None else max_files
        self._max_bytes = max_bytes
        self._lock = ProcessLock()  # a forked child gets it fresh (its descriptors are its own copies)
        self._stamp: Stamp = (b"", -1)
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()
        self._bytes = 0
        self.hits = 0  # opens saved, for tests and benchmarks

    def take(self, stamp: Stamp | None, cid: bytes, raw_len: int, checksum: bytes) -> tuple[int, ChunkHeader] | None:
        """A duplicate of the descriptor kept for chunk ``cid`` under ``stamp`` and its header, if its
        header matches the row (``raw_len``, ``checksum``); None: open the file as usual (also for
        a plan not made from memory: ``stamp`` None)."""
        if stamp is None:
            return None
        with self._lock:
            if not self._current(stamp):
                return None
            kept = self._kept.get(cid)
            if kept is None:
                return None
            fd, head, size = kept
            if not header_matches(head, raw_len, checksum, size):
                self._drop(cid)  # never expected under one stamp: the file is opened and checked again
                return None
            self._kept.move_to_end(cid)
            dup = os.dup(fd)  # under the lock: a drop cannot close it between the lookup and the dup
            self.hits += 1
        return dup, head

    def keep(self, stamp: Stamp | None, cid: bytes, fd: int, head: ChunkHeader, size: int) -> None:
        """Keep a duplicate of ``fd``, the chunk file of ``cid`` whose header ``head`` was just
        checked against its row under ``stamp``, if it is small and the stamp is current."""
        if stamp is None or size > _MAX_FILE or self._max_files <= 0:
            return
        with self._lock:
            if not self._current(stamp) or cid in self._kept:
                return
            try:
                dup = os.dup(fd)
            except OSError:
                return  # out of descriptors: nothing kept, the restore goes on with its own
            self._kept[cid] = (dup, head, size)
            self._bytes += size
            while self._kept and (len(self._kept) > self._max_files or self._bytes > self._max_bytes):
                self._drop(next(iter(self._kept)))

    def forget(self, cids: Iterable[bytes]) -> None:
        """Close the descriptors kept for ``cids`` (a restore failed reading or checking one of them:
        its file is opened and checked afresh next time)."""
        with self._lock:
            for cid in cids:
                if cid in self._kept:
                    self._drop(cid)

    def close(self) -> None:
        """Close every kept descriptor (the store closes)."""
        with self._lock:
            self._clear()

    def __len__(self) -> int:
        return len(self._kept)

    def _current(self, stamp: Stamp) -> bool:
        """Move to ``stamp`` if it is newer (closing everything kept); is it the current one?"""
        moved, current = stamp_moves(self._stamp, stamp)
        if moved:
            self._clear()
            self._stamp = stamp
        return current

    def _drop(self, cid: bytes) -> None:
        fd, _, size = self._kept.pop(cid)
        self._bytes -= size
        try:
            os.close(fd)
        except OSError:
            pass

    def _clear(self) -> None:
        while self._kept:
            self._drop(next(iter(self._kept)))
