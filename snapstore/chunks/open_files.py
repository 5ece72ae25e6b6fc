"""Small chunk files kept open, with their checked headers, while the catalog generation stands.

A repeated small restore (a system prompt's 3K tokens in a dozen chain links, issue 31) spent a
fifth of its time opening files: per link a path built and its fan-out directory checked, an
open, fstat and fcntl, a header read and parsed. :class:`OpenFiles` keeps, for the plans a store
made from memory (:class:`snapstore.catalog.chain_cache.ChainCache`), the descriptor of each small
chunk file it opened and the header it checked against the catalog, under the catalog stamp the
plan was read with. The generation moves in the transaction of every change to a chunk row
(deleted, quarantined, healed, republished), so a kept descriptor is only ever used for the row it
was checked against. A plan under a newer stamp, by any store of the process on the catalog
(:meth:`ChainCache.on_move`), closes every kept descriptor first.

An estimate's probe (:mod:`snapstore.restore.tier_probe`) asks the page cache through a kept
descriptor instead of opening the file, and offers the cached files it did open; one offered a
second time under the same stamp is kept, its header checked against the row as a restore checks
it: a scheduler's store, which looks up and never restores, then probes a prompt it sees again
without opening its files.

A restore takes a duplicate (``os.dup``) and closes it as it closes the files it opened itself,
so dropping a kept descriptor never pulls one from under a reader. Each take reads the header
again (one ``pread``) and compares it with the one checked, and every chunk is still checksummed
as it lands: damage in place is found as before, and the quarantine that follows moves the
generation. A kept descriptor of a file another process unlinked keeps its bytes on disk until
a plan of this process moves to the new generation, or the store closes or is collected: at most
``_MAX_BYTES`` per store, small files only, and at most ``_MAX_FILES`` descriptors in the whole
process (docs/format.md, "Open chunk files"). A forked child closes its copies at once.
"""

from __future__ import annotations

import os
import resource
import weakref
from collections import OrderedDict
from collections.abc import Iterable

from snapstore._errors import CorruptionError
from snapstore._forks import ProcessLock, track
from snapstore.catalog.chain_cache import Stamp, stamp_moves
from snapstore.chunks.chunkfile import HEADER_SIZE, ChunkHeader, header_matches, parse_header
from snapstore.chunks.residency import resident

__all__ = ["OpenFiles", "give_descriptors", "take_descriptors"]

_MAX_FILE = 4 << 20  # only chunk files this small are kept: a large read is not dominated by its open
_MAX_BYTES = 64 << 20  # file bytes one store keeps open at most (what unlinked files hold on disk until dropped)
_MAX_FILES = 128  # descriptors kept in the whole process at most (and a sixteenth of the open-file limit)
_MAX_OFFERED = 1024  # chunk ids a store remembers as offered once (then forgets them all)

_Kept = tuple[int, ChunkHeader, bytes, int]  # descriptor, checked header, its bytes, file size


class _Slots:
    """The process's budget of kept descriptors, shared by every store (each OpenFiles)."""

    def __init__(self) -> None:
        self._lock = ProcessLock()
        self.used = 0
        try:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (OSError, ValueError):
            soft = 0
        self.limit = _MAX_FILES if soft == resource.RLIM_INFINITY else min(_MAX_FILES, soft // 16)

    def take(self, n: int = 1) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int = 1) -> None:
        with self._lock:
            self.used = max(0, self.used - n)

    def give_unlocked(self, n: int) -> None:
        """:meth:`give` from a finalizer or a forked child's hook: those may run while this very
        thread holds the lock (a collection inside a call) or after a parent thread held it; a count
        that races another thread's is off by a few slots at worst (a soft bound)."""
        self.used = max(0, self.used - n)


_SLOTS = _Slots()


def take_descriptors(n: int) -> bool:
    """Take ``n`` of the process's kept-descriptor slots (shared with the replayed restores of
    :mod:`snapstore.restore.hot`); False: none taken, keep nothing."""
    return _SLOTS.take(n)


def give_descriptors(n: int, *, unlocked: bool = False) -> None:
    """Give back ``n`` slots :func:`take_descriptors` took (``unlocked``: from a forked child's hook)."""
    if unlocked:
        _SLOTS.give_unlocked(n)
    else:
        _SLOTS.give(n)


def _close_all(kept: OrderedDict[bytes, _Kept]) -> None:
    """Close every descriptor in ``kept`` and give its slots back, taking no lock (an OpenFiles
    collected unclosed, or a forked child's copies)."""
    n = len(kept)
    while kept:
        try:
            os.close(kept.popitem()[1][0])
        except OSError:
            pass
    _SLOTS.give_unlocked(n)


class OpenFiles:
    """Descriptors of small chunk files, checked under one catalog stamp (module docstring)."""

    def __init__(self, max_files: int | None = None, max_bytes: int = _MAX_BYTES) -> None:
        self._max_files = _MAX_FILES if max_files is None else max_files
        self._max_bytes = max_bytes
        self._lock = ProcessLock()  # a forked child gets it fresh
        self._stamp: Stamp = (b"", -1)
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()
        self._offered: set[bytes] = set()  # files offered once under the current stamp (:meth:`offer`)
        self._bytes = 0
        self.hits = 0  # opens saved, for tests and benchmarks
        # a store dropped without close() must not hold its files (and unlinked ones' space) for good
        self._finalizer = weakref.finalize(self, _close_all, self._kept)
        track(self)

    def _after_fork_in_child(self) -> None:
        """A forked child closes its copies of the kept descriptors (the parent's stay open): it
        would otherwise hold files the parent has long dropped, unlinked ones' space included."""
        _close_all(self._kept)
        self._bytes = 0
        self._stamp = (b"", -1)

    def advance(self, stamp: Stamp) -> None:
        """A plan of this process read ``stamp``: if it is newer, close everything kept."""
        with self._lock:
            self._current(stamp)

    def take(self, stamp: Stamp | None, cid: bytes, raw_len: int, checksum: bytes) -> tuple[int, ChunkHeader] | None:
        """A duplicate of the descriptor kept for chunk ``cid`` under ``stamp`` and its header, if its
        header matches the row (``raw_len``, ``checksum``) and the file's header bytes are still the
        ones checked; None: open the file as usual (also for a plan not made from memory: ``stamp`` None)."""
        with self._lock:
            kept = self._entry(stamp, cid)
            if kept is None:
                return None
            fd, head, raw, size = kept
            if not header_matches(head, raw_len, checksum, size):
                self._drop(cid)  # never expected under one stamp: the file is opened and checked again
                return None
            self._kept.move_to_end(cid)
            try:
                dup = os.dup(fd)  # under the lock: a drop cannot close it between the lookup and the dup
            except OSError:
                return None  # out of descriptors: the restore opens the file (and reports what fails)
        try:
            same = os.pread(dup, HEADER_SIZE, 0) == raw
        except OSError:
            same = False
        if not same:  # damaged in place since (or unreadable): opened and checked afresh, found as before
            os.close(dup)
            self.forget([cid])
            return None
        self.hits += 1
        return dup, head

    def keep(self, stamp: Stamp | None, cid: bytes, fd: int, head: ChunkHeader, size: int) -> None:
        """Keep a duplicate of ``fd``, the chunk file of ``cid`` whose header ``head`` was just
        checked against its row under ``stamp``, if it is small and the stamp is current."""
        if stamp is None or size > _MAX_FILE or self._max_files <= 0:
            return
        with self._lock:
            if not self._current(stamp) or cid in self._kept or not _SLOTS.take():
                return
            try:
                dup = os.dup(fd)
            except OSError:
                _SLOTS.give()
                return  # out of descriptors: nothing kept, the restore goes on with its own
            self._kept[cid] = (dup, head, head.pack(), size)  # a valid header packs to its own bytes
            self._bytes += size
            while self._kept and (len(self._kept) > self._max_files or self._bytes > self._max_bytes):
                self._drop(next(iter(self._kept)))

    def resident(self, stamp: Stamp | None, cid: bytes, size: int) -> bool | None:
        """Is the file kept for ``cid`` under ``stamp`` in the page cache (:func:`resident`, probed
        on the kept descriptor under the lock, so a drop cannot close it meanwhile)? None: none kept.
        An estimate's probe (restore.tier_probe) then opens nothing."""
        with self._lock:
            kept = self._entry(stamp, cid)
            return None if kept is None else resident(kept[0], size)

    def offer(self, stamp: Stamp | None, cid: bytes, fd: int, size: int, raw_len: int, checksum: bytes) -> None:
        """Keep ``fd``, chunk ``cid``'s file (``size`` bytes) that an estimate's probe opened and
        found cached, the second time it is offered under ``stamp``, if its header describes the row
        (``raw_len``, ``checksum``); a header that does not is left to the restore to find and
        report. A scheduler's store, which never restores, then probes a prompt it looks up again and
        again without opening its files; a file probed once costs no header read (issue 31)."""
        if stamp is None or size > _MAX_FILE or self._max_files <= 0 or cid in self._kept \
                or _SLOTS.used >= _SLOTS.limit:  # (read unlocked: only a hint; keep() takes a slot for sure)
            return
        with self._lock:
            if not self._current(stamp):
                return
            if cid not in self._offered:
                if len(self._offered) >= _MAX_OFFERED:
                    self._offered.clear()
                self._offered.add(cid)
                return
            self._offered.discard(cid)
        try:
            head = parse_header(os.pread(fd, HEADER_SIZE, 0))
        except (OSError, CorruptionError):
            return
        if header_matches(head, raw_len, checksum, size):
            self.keep(stamp, cid, fd, head, size)

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

    def _entry(self, stamp: Stamp | None, cid: bytes) -> _Kept | None:
        """Under the lock: what is kept for ``cid`` under ``stamp`` (None for no stamp, an older one,
        or nothing kept; a newer one closes everything first)."""
        if stamp is None or not self._current(stamp):
            return None
        return self._kept.get(cid)

    def _current(self, stamp: Stamp) -> bool:
        """Move to ``stamp`` if it is newer (closing everything kept); is it the current one?"""
        moved, current = stamp_moves(self._stamp, stamp)
        if moved:
            self._clear()
            self._stamp = stamp
            self._offered.clear()
        return current

    def _drop(self, cid: bytes) -> None:
        fd, _, _, size = self._kept.pop(cid)
        self._bytes -= size
        _SLOTS.give()
        try:
            os.close(fd)
        except OSError:
            pass

    def _clear(self) -> None:
        while self._kept:
            self._drop(next(iter(self._kept)))
