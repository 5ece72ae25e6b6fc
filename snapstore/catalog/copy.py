"""Private copies of a catalog: an in-memory snapshot of ``snapstore.db`` that a dry run (gc,
inspect, a read-only CLI session) may read or mutate without writing a byte of the store."""

from __future__ import annotations

import time

import apsw

from snapstore._errors import StateError, StoreIOError
from snapstore._forks import abandon
from snapstore.catalog.db import Database, Raw, translate
from snapstore.catalog.fence import fenced
from snapstore.catalog.readonly import file_state, readonly_source

__all__ = ["MemDatabase", "catalog_copy", "snapshot_catalog"]


@fenced
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

    _on_disk = False  # the private copy may be written (a dry run plans on it)

    def __init__(self, mem: Raw, path: str) -> None:
        super().__init__(path, readonly=True)
        self._mem: Raw | None = mem

    @fenced
    def open(self) -> MemDatabase:
        """Bring the private copy of an older catalog up to date (nothing on disk is touched)."""
        self._migrate(self.conn())
        return self

    def conn(self) -> Raw:
        """The one in-memory connection (every thread shares it: the copy is private to one reader)."""
        if self._mem is None:
            raise StateError("the store is closed; open it again")
        return self._mem

    def _after_fork_in_child(self) -> None:
        """A forked child's copy: the connection is the parent's (see :meth:`Database._after_fork_in_child`)."""
        super()._after_fork_in_child()
        if self._mem is not None:
            abandon(self._mem)
            self._mem = None

    @fenced
    def close(self) -> None:
        """Close the in-memory copy."""
        if self._mem is not None:
            self._mem.close()
            self._mem = None


@fenced
def snapshot_catalog(db_path: str) -> Raw:
    """A private in-memory copy of the catalog at ``db_path``, taken without writing a byte (the
    read-only connection of :func:`readonly_source`: no -wal, -shm or lock file is ever created)."""
    last: BaseException | None = None
    for attempt in range(20):
        mem = apsw.Connection(":memory:")
        try:
            uri, state = readonly_source(db_path)
            src = apsw.Connection(uri, flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI
                                  | apsw.SQLITE_OPEN_NOFOLLOW)
            try:
                src.set_busy_timeout(10_000)
                with mem.backup("main", src, "main") as b:
                    b.step(-1)
            finally:
                src.close()
            if state is not None and file_state(db_path) != state:
                raise apsw.BusyError("a writer changed the catalog during an immutable read")
            mem.pragma("foreign_keys", True)
            return mem
        except (apsw.BusyError, apsw.ReadOnlyError, apsw.ProtocolError) as e:  # a writer raced the read
            mem.close()
            last = e
            time.sleep(0.01 * (attempt + 1))
        except apsw.Error as e:
            mem.close()
            raise translate(e) from None
        except BaseException:
            mem.close()
            raise
    raise StoreIOError(16, f"could not take a consistent copy of the catalog: {last}")
