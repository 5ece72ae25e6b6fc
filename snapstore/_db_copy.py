"""Private copies of a catalog: an in-memory snapshot of ``snapstore.db`` that a dry run (gc,
inspect, a read-only CLI session) may read or mutate without writing a byte of the store."""

from __future__ import annotations

import os
import time
import urllib.parse

import apsw

from ._db import Database, Raw, translate
from ._errors import StateError, StoreIOError

__all__ = ["MemDatabase", "catalog_copy", "release_wal", "snapshot_catalog"]


def catalog_copy(src: Raw) -> Raw:
    """An in-memory copy of the catalog (one consistent read snapshot), for a dry run to mutate."""
    mem = apsw.Connection(":memory:")
    with mem.backup("main", src, "main") as b:
        b.step(-1)
    mem.pragma("foreign_keys", True)
    return mem


class MemDatabase(Database):
    """A :class:`Database` over one private in-memory connection (a copy of a store's catalog).

    Only :meth:`conn` differs: ``read``/``write`` and every query run unchanged against the copy,
    and nothing on disk is opened or written.
    """

    def __init__(self, mem: Raw, path: str) -> None:
        super().__init__(path, readonly=True)
        self._mem: Raw | None = mem

    def open(self) -> MemDatabase:
        """Bring the private copy of an older catalog up to date (nothing on disk is touched)."""
        self._migrate(self.conn())
        return self

    def conn(self) -> Raw:
        """The one in-memory connection (every thread shares it: the copy is private to one reader)."""
        if self._mem is None:
            raise StateError("the store is closed; open it again")
        return self._mem

    def close(self) -> None:
        """Close the in-memory copy."""
        if self._mem is not None:
            self._mem.close()
            self._mem = None


def snapshot_catalog(db_path: str) -> Raw:
    """A private in-memory copy of the catalog at ``db_path``, taken without writing a byte."""
    had_shm = os.path.exists(db_path + "-shm")
    had_any = had_shm or os.path.exists(db_path + "-wal")
    uri = "file:" + urllib.parse.quote(db_path) + "?mode=ro" + ("&readonly_shm=1" if had_shm else "")
    last: BaseException | None = None
    for attempt in range(20):
        mem = apsw.Connection(":memory:")
        try:
            src = apsw.Connection(uri, flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI
                                  | apsw.SQLITE_OPEN_NOFOLLOW)
            try:
                src.set_busy_timeout(10_000)
                with mem.backup("main", src, "main") as b:
                    b.step(-1)
            finally:
                src.close()
            mem.pragma("foreign_keys", True)
            return mem
        except (apsw.BusyError, apsw.ReadOnlyError, apsw.ProtocolError) as e:  # a writer raced the read
            mem.close()
            last = e
            time.sleep(0.01 * (attempt + 1))
        except apsw.Error as e:
            mem.close()
            raise translate(e) from None
        finally:
            if not had_any:
                release_wal(db_path)
    raise StoreIOError(16, f"could not take a consistent copy of the catalog: {last}")


def release_wal(db_path: str) -> None:
    """Remove the -wal/-shm files a read-only session created, when no other process uses the store.

    A read-only SQLite connection to a WAL database creates ``-wal`` and ``-shm`` but cannot remove
    them. Opening and closing one read-write connection lets SQLite do it: the last connection to
    close deletes them, and only when it gets the exclusive lock (no other process has the store
    open). The database file is not written (the WAL is empty). Errors are ignored.
    """
    try:
        c = apsw.Connection(db_path, flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_NOFOLLOW)
    except apsw.Error:
        return
    try:
        c.pragma("user_version")
    except apsw.Error:
        pass
    finally:
        try:
            c.close()
        except apsw.Error:
            pass
