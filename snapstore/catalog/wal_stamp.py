"""The catalog's commit stamp, read without a statement: the header of SQLite's WAL index.

In WAL mode SQLite keeps a shared-memory file beside the database (``-shm``) whose first 96 bytes
are two copies of the WAL-index header; every committing writer, in any process, rewrites it (its
change counter ``iChange`` moves on every commit, with the WAL's frame count and salts;
https://sqlite.org/walformat.html, "The WAL-Index Header"). Two equal reads of it therefore mean
that no transaction committed in between. A plan kept for repeated restores
(:mod:`snapstore.restore.hot`) reads it — one ``pread``, no SQLite call, no lock — to know that
the catalog it was checked against still stands, and asks the catalog (its generation, one read
transaction) only when it moved.

What does not look like a valid, settled header reads as None, and the caller asks the catalog as
usual: no ``-shm`` (a read-only or immutable catalog), another WAL-index version, the two copies
unequal (a writer mid-update), or a ``-shm`` file SQLite unlinked (the last connection to the
database closed: the next one makes a new file, which this reopens).

What it relies on: the header is rewritten by every commit of a WAL-mode writer, which every
snapstore connection is (``apsw.bestpractice.connection_wal``; none sets ``locking_mode=EXCLUSIVE``,
whose writer keeps its WAL index in private memory). An open store holds a connection (its owner
lease's), so SQLite neither truncates nor unlinks the ``-shm`` under it; should every connection
close, the unlinked file is noticed by its link count.
"""

from __future__ import annotations

import os
import sys
import weakref

from snapstore._forks import ProcessLock

__all__ = ["WalStamp"]

_COPY = 48  # one copy of the WalIndexHdr
_VERSION = 3007000  # iVersion of every WAL index since SQLite 3.7.0
_IS_INIT = 12  # byte offset of isInit in the header


class WalStamp:
    """The WAL-index header of the catalog at ``db_path`` (module docstring)."""

    def __init__(self, db_path: str) -> None:
        self._path = db_path + "-shm"
        self._fd = -1
        self._lock = ProcessLock()
        # every descriptor opened and not closed: an unlinked file's too (another thread may be
        # reading it), closed with the store or by the finalizer
        self._open_fds: list[int] = []
        weakref.finalize(self, _close_fds, self._open_fds)  # a store dropped unclosed releases them too

    def read(self) -> bytes | None:
        """The header now (48 bytes), or None: ask the catalog instead."""
        fd = self._fd
        if fd < 0:
            fd = self._open()
            if fd < 0:
                return None
        try:
            data = os.pread(fd, 2 * _COPY, 0)
            linked = os.fstat(fd).st_nlink > 0
        except OSError:
            return None
        if not linked:  # SQLite removed it (its last connection closed); the next call opens the new one
            self._retire(fd)
            return None
        if (len(data) != 2 * _COPY or data[:_COPY] != data[_COPY:] or data[_IS_INIT] != 1
                or int.from_bytes(data[:4], sys.byteorder) != _VERSION):
            return None
        return data[:_COPY]

    def _open(self) -> int:
        with self._lock:
            if self._fd < 0:
                try:
                    self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    return -1
                self._open_fds.append(self._fd)
            return self._fd

    def _retire(self, fd: int) -> None:
        with self._lock:
            if self._fd == fd:
                self._fd = -1

    def close(self) -> None:
        """Close the descriptors (the store closes: no call is reading them)."""
        with self._lock:
            self._fd = -1
            _close_fds(self._open_fds)


def _close_fds(fds: list[int]) -> None:
    """Close and forget every descriptor in ``fds`` (takes no lock: also a finalizer)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass
