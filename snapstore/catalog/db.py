"""The SQLite machinery: connections, transactions, migrations (private copies: `catalog/copy.py`;
the shipped migrations and the read-only compatibility views: `catalog/schema.py`).

A :class:`Database` holds one apsw connection per thread (a connection is never shared between
concurrent transactions) and runs functions in IMMEDIATE write or deferred read transactions,
retrying when SQLite reports busy so that "database is locked" never reaches the caller. Each
function gets a :class:`~snapstore.catalog.queries.Txn` (the catalog queries, in ``catalog.queries.py``).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import apsw
import apsw.bestpractice

from snapstore._config import env_int
from snapstore._errors import CorruptionError, StateError, StoreFormatError, StoreIOError
from snapstore._forks import abandon, release_inherited, track
from snapstore.catalog.fence import fenced, inside
from snapstore.catalog.foreign import foreign_connection, foreign_error
from snapstore.catalog.queries import ChunkRow, OwnerRow, PartKind, PartRow, SnapRow, SnapState, Txn
from snapstore.catalog.readonly import FileState, file_state, file_uri, read_only_error, readonly_source
from snapstore.catalog.schema import compat_views, migrations_dir

__all__ = ["APPLICATION_ID", "MIN_SQLITE", "ChunkRow", "Conn", "Database", "OwnerRow", "PartKind", "PartRow",
           "SnapRow", "SnapState", "Txn", "migrations_dir"]

T = TypeVar("T")
APPLICATION_ID = 0x534E5053  # "SNPS"
MIN_SQLITE = (3, 51, 3)
_BUSY_TIMEOUT_MS = 10_000
_BUSY_RETRIES = 50


def _backoff(attempt: int) -> None:
    """Sleep before try ``attempt + 1`` of a statement SQLite answered busy (jittered, at most 0.5 s)."""
    time.sleep(min(0.5, 0.005 * 2**min(attempt, 7)) * random.random())
# The catalog read through a memory map: match() walks a candidate's chain of token blobs, and a
# pread per overflow page doubled that walk (docs/benchmarks.md, "match() fifth pass").
DEFAULT_MMAP_MIB = 256

Conn = Txn  # what a transaction function receives (the name callers have always typed it with)
Raw = apsw.Connection


def translate(e: BaseException) -> BaseException:
    """Map apsw errors onto the snapstore hierarchy with a message an engine author can act on."""
    if isinstance(e, apsw.FullError):
        return StoreIOError(28, f"the store's database could not grow (disk full): {e}")
    if isinstance(e, apsw.NotADBError):
        return CorruptionError("snapstore.db is not an SQLite database (overwritten or damaged at its start); "
                               "move the store directory aside and start a new one")
    if isinstance(e, apsw.CorruptError):
        return CorruptionError(f"the store database is damaged ({e}); `snapstore verify` reports what is "
                               "affected; if SQLite's own integrity check fails, move the store aside")
    if isinstance(e, (apsw.IOError, apsw.CantOpenError, apsw.ReadOnlyError, apsw.PermissionsError)):
        return StoreIOError(5, f"the store database could not be accessed: {e}")
    if isinstance(e, apsw.ConstraintError):
        return CorruptionError(f"the store catalog refused an inconsistent change ({e}); "
                               "run `snapstore verify`")
    if isinstance(e, apsw.BusyError):
        return StoreIOError(16, "the store database stayed locked by another process for too long "
                                f"({e}); retry, or find the process holding it (`fuser snapstore.db`)")
    if isinstance(e, apsw.Error):
        # anything else SQLite reports is still a snapstore error, never a raw apsw one
        return StoreIOError(5, f"the store database failed ({type(e).__name__}: {e}); "
                               "`snapstore verify` reports whether anything is damaged")
    return e


class _Held:
    """One thread's connection; closing it when the thread's locals go keeps threads from leaking
    connections (a server with a thread per request). In a process forked from the one that opened
    it, closing abandons it instead (:func:`._forks.abandon`): CPython frees a parent thread's
    locals inside ``os.fork()``, and SQLite's close there could wait forever on a mutex that
    thread held at the fork."""

    __slots__ = ("__weakref__", "conn", "pid", "state")

    def __init__(self, conn: Raw, state: FileState | None):
        self.conn = conn
        self.state = state  # read as immutable: valid while the database file stays in this state
        self.pid = os.getpid()

    def close(self) -> None:
        if self.pid != os.getpid():  # a forked child's copy: never entered again, never freed
            if self.pid:
                abandon(self.conn)
                self.pid = 0  # abandoned: a later close (or the thread's locals going) has nothing to do
            return
        try:
            with inside():  # a fork waits for the close (SQLite's mutexes: catalog.fence)
                self.conn.close(True)
        except apsw.Error:
            pass

    def __del__(self) -> None:
        self.close()


class Database:
    """Thread-safe access to ``snapstore.db``: a connection per thread, retried transactions.

    ``readonly``: nothing is ever written, not even SQLite's -wal/-shm (:func:`readonly_source`),
    and a write transaction raises StateError.
    """

    _on_disk = True  # a private in-memory copy (snapstore.catalog.copy.MemDatabase) may be written

    def __init__(self, path: str, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._local = threading.local()
        self._all: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        self._forked = False  # the copy a forked child inherited: its connections are the parent's
        track(self)  # a forked child gets a fresh _lock (a parent thread may have held it)
        mib = env_int("SNAPSTORE_SQLITE_MMAP_MIB")  # 0: read through the page cache only (pread)
        self._mmap_bytes = (DEFAULT_MMAP_MIB if mib is None else mib) * (1 << 20)

    @fenced
    def open(self) -> Database:
        """Create the file (0600) if needed, then migrate it (or, read-only, check its version)."""
        path, readonly = self.path, self.readonly
        if apsw.sqlite_lib_version().split(".") and tuple(
            int(x) for x in apsw.sqlite_lib_version().split(".")[:3]
        ) < MIN_SQLITE:
            raise StoreFormatError(
                f"SQLite {apsw.sqlite_lib_version()} is too old; snapstore needs >= "
                f"{'.'.join(map(str, MIN_SQLITE))} (install a newer apsw wheel)"
            )
        if not readonly and not os.path.exists(path):
            try:  # create 0600 before SQLite does (its -wal/-shm files copy these permissions)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            except FileExistsError:
                pass
            except OSError as e:
                raise StoreIOError(e.errno or 5, f"cannot create {path}: {e.strerror}") from None
        conn = self.conn()
        if not readonly:
            self._migrate(conn)
            if self.read(Txn.has_unkeyed):  # rows an older snapstore inserted since migration 0008
                self.write(Txn.backfill_find_keys)
        else:
            self._check_version(conn)
        return self

    # -- connections -------------------------------------------------------------------------
    @fenced
    def conn(self) -> Raw:
        """This thread's connection (opened on first use; closed when the thread ends)."""
        holder: _Held | None = getattr(self._local, "held", None)
        if holder is not None:
            return holder.conn
        if self._forked:
            raise StateError(f"this catalog was opened before a fork(): {self.path} must be opened "
                             "again in this process (Store.open)")
        if self._closed:
            raise StateError("the store is closed; open it again with Store.open()")
        c, state = self._connect()
        holder = _Held(c, state)
        self._local.held = holder  # thread-local: dropped, and the connection closed, when the thread ends
        with self._lock:
            self._all.add(holder)
        return c

    def _connect(self) -> tuple[Raw, FileState | None]:
        """A new, configured connection (and, read as immutable, the file state it relies on);
        "database is locked" while setting it up (another process holds the database exclusively,
        or is recovering it) is retried like a transaction."""
        flags = apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI if self.readonly else apsw.SQLITE_OPEN_READWRITE
        for attempt in range(_BUSY_RETRIES):
            c: Raw | None = None
            state: FileState | None = None
            try:
                if self.readonly:
                    uri, state = readonly_source(self.path)
                else:
                    uri = file_uri(self.path)
                c = apsw.Connection(uri, flags=flags | apsw.SQLITE_OPEN_URI | apsw.SQLITE_OPEN_NOFOLLOW)
                c.set_busy_timeout(_BUSY_TIMEOUT_MS)
                if not self.readonly:
                    if foreign_connection(c, APPLICATION_ID):  # before anything is written (WAL mode is a write)
                        c.close()
                        raise foreign_error(self.path)
                    apsw.bestpractice.connection_wal(c)
                apsw.bestpractice.connection_enable_foreign_keys(c)
                apsw.bestpractice.connection_dqs(c)
                apsw.bestpractice.connection_recursive_triggers(c)
                # FULL: a commit is durable when it returns (WAL fsync per commit), so a save the API
                # reported survives power loss, not only a process crash.
                c.pragma("synchronous", "FULL")
                c.pragma("mmap_size", self._mmap_bytes)
                if self.readonly:
                    compat_views(c)
                return c, state
            except FileNotFoundError:
                raise StoreIOError(errno.ENOENT, f"{self.path} is gone (the store was moved or removed)") from None
            except apsw.BusyError:
                if c is not None:
                    c.close()
                _backoff(attempt)
            except apsw.Error as e:
                if c is not None:
                    c.close()
                raise translate(e) from None
        raise StoreIOError(16, "the store database stayed locked by another process for too long")

    def _after_fork_in_child(self) -> None:
        """Fresh lock; the inherited connections abandoned (never entered, never freed: SQLite's
        process-wide mutexes may be held by a parent thread that is not here) and the child's
        copies of the catalog's descriptors released; no new connection on this copy."""
        self._lock = threading.Lock()
        self._forked = True
        for held in list(self._all):  # the forking thread's (the others' went inside os.fork())
            held.close()
        self._local = threading.local()  # the forking thread's is gone too: conn() opens no copy
        release_inherited(self.path + suffix for suffix in ("", "-wal", "-shm", "-journal"))

    def _stale(self) -> bool:
        """Whether this thread's immutable read connection no longer matches the file (a writer
        came since it opened): closed then, so the next :meth:`conn` reads the store as it is now."""
        holder: _Held | None = getattr(self._local, "held", None)
        if holder is None or holder.state is None:
            return False
        try:
            if file_state(self.path) == holder.state:
                return False
        except OSError:
            pass
        with self._lock:
            self._all.discard(holder)
        del self._local.held
        holder.close()
        return True

    def _refuse_write(self) -> None:
        if self.readonly and self._on_disk:
            raise read_only_error(os.path.dirname(self.path), "be written")

    @fenced
    def close(self) -> None:
        """Close every connection this object opened (all threads)."""
        with self._lock:
            self._closed = True
            held, self._all = list(self._all), weakref.WeakSet()
        for h in held:
            h.close()
        self._local = threading.local()

    # -- transactions ------------------------------------------------------------------------
    def write(self, fn: Callable[[Txn], T], *, durable: bool = True) -> T:
        """Run ``fn`` in an IMMEDIATE transaction, retried while the database is busy.

        ``durable=False`` skips the WAL fsync at commit (synchronous=NORMAL for this transaction):
        for bookkeeping such as last-use times and hit counters, which a power cut may roll back
        without harm; the next durable commit makes them durable too. Chunk ids the transaction
        freed are dropped here: a caller that removes chunk rows writes through
        :meth:`snapstore.chunks.repo.Repo.write`, which unlinks their files after the commit.
        """
        return self.write_collect(fn, durable=durable)[0]

    @fenced
    def write_collect(self, fn: Callable[[Txn], T], *, durable: bool = True) -> tuple[T, list[bytes]]:
        """:meth:`write`, also returning the chunk ids the committed transaction freed."""
        self._refuse_write()
        if durable:
            return self._transact(fn, "BEGIN IMMEDIATE")
        c = self.conn()
        c.pragma("synchronous", "NORMAL")
        try:
            return self._transact(fn, "BEGIN IMMEDIATE")
        finally:
            c.pragma("synchronous", "FULL")

    @contextmanager
    def writing(self) -> Iterator[Txn]:
        """A durable write transaction as a block, opened and committed where its caller reads it (a
        save: its COMMIT is the publish point): BEGIN IMMEDIATE here, COMMIT when the block ends,
        ROLLBACK if it raises. Busy is waited out at BEGIN and COMMIT as :meth:`write` does; the block
        runs once (it holds the write lock: in WAL nothing in it waits on another connection)."""
        self._refuse_write()
        with inside():  # a fork waits for the whole transaction (catalog.fence)
            c = self.conn()
            try:
                self._until_free(c, "BEGIN IMMEDIATE")
                yield Txn(c)
                self._until_free(c, "COMMIT")  # a busy COMMIT leaves the transaction open: tried again
            except BaseException as e:
                self._rollback(c)
                if isinstance(e, apsw.Error):
                    raise translate(e) from None
                raise

    @staticmethod
    def _until_free(c: Raw, sql: str) -> None:
        """Run ``sql`` (no rows), trying again while SQLite answers busy, as :meth:`_transact` does."""
        for attempt in range(_BUSY_RETRIES):
            try:
                c.execute(sql)
                return
            except apsw.BusyError:
                _backoff(attempt)
        raise StoreIOError(16, "the store database stayed locked by another process for too long")

    @fenced
    def try_write(self, fn: Callable[[Txn], T]) -> tuple[bool, T | None]:
        """Run ``fn`` in a write transaction only if the write lock is free now: (ran, result).

        Never waits for another writer (busy timeout 0, no retries) and skips the WAL fsync:
        for bookkeeping a reader records on the way out (last use, hit counts), which must not
        queue a restore behind a long write. Never runs on a read-only store.
        """
        if self.readonly and self._on_disk:
            return False, None
        c = self.conn()
        c.set_busy_timeout(0)
        c.pragma("synchronous", "NORMAL")
        try:
            try:
                c.execute("BEGIN IMMEDIATE")
            except apsw.BusyError:
                return False, None
            except apsw.Error as e:
                raise translate(e) from None
            try:
                result = fn(Txn(c))  # bookkeeping only: it removes no chunk rows
                c.execute("COMMIT")
                return True, result
            except apsw.BusyError:
                self._rollback(c)
                return False, None
            except BaseException as e:
                self._rollback(c)
                if isinstance(e, apsw.Error):
                    raise translate(e) from None
                raise
        finally:
            c.pragma("synchronous", "FULL")
            c.set_busy_timeout(_BUSY_TIMEOUT_MS)

    @fenced
    def read(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a read transaction (a consistent snapshot of the database)."""
        return self._transact(fn, "BEGIN")[0]

    def _transact(self, fn: Callable[[Txn], T], begin: str) -> tuple[T, list[bytes]]:
        for attempt in range(_BUSY_RETRIES):
            self._stale()  # an immutable read connection a writer has overtaken: reopened first
            c = self.conn()
            try:
                c.execute(begin)
            except apsw.BusyError:
                _backoff(attempt)
                continue
            except apsw.Error as e:
                raise translate(e) from None
            try:
                t = Txn(c)  # a fresh one per attempt: a retried transaction frees only what it commits
                result = fn(t)
                c.execute("COMMIT")
                if self._stale():
                    continue  # the file changed under an immutable read: read it again, as it is now
                return result, t.freed
            except apsw.BusyError:
                self._rollback(c)
                _backoff(attempt)
                continue
            except BaseException as e:
                self._rollback(c)
                if isinstance(e, apsw.Error):
                    raise translate(e) from None
                raise
        raise StoreIOError(16, "the store database stayed locked by another process for too long")

    @staticmethod
    def _rollback(c: Raw) -> None:
        if not c.get_autocommit():
            try:
                c.execute("ROLLBACK")
            except apsw.Error:
                pass

    # -- schema ------------------------------------------------------------------------------
    def _check_version(self, c: Raw) -> int:
        try:
            app = c.pragma("application_id")
            ver = c.pragma("user_version")
        except apsw.Error as e:
            raise StoreFormatError(f"{self.path} is not a readable SQLite database: {e}") from None
        known = migrations_dir()
        latest = known[-1][0] if known else 0
        if ver and app != APPLICATION_ID:
            raise StoreFormatError(f"{self.path} is an SQLite database but not a snapstore store")
        if ver > latest:
            raise StoreFormatError(
                f"{self.path} has schema version {ver}, newer than this snapstore ({latest}); upgrade snapstore"
            )
        return int(ver)

    def _migrate(self, c: Raw) -> None:
        ver = self._check_version(c)
        todo = [m for m in migrations_dir() if m[0] > ver]
        if not todo:
            return
        steps: dict[int, Callable[[Txn], object]] = {8: Txn.backfill_find_keys}  # Python a migration needs

        def apply(t: Txn) -> None:
            current = int(str(t.pragma("user_version")))
            for num, _name, sql in todo:
                if num <= current:
                    continue  # another process migrated first
                t.execute(sql)
                if num in steps:
                    steps[num](t)  # in the migrating transaction, before user_version says it is done
                t.pragma("user_version", num)
            t.pragma("application_id", APPLICATION_ID)

        self.write(apply)


# -- private copies of a catalog (dry runs, read-only inspection) ------------------------------
@fenced
def rolled_back(c: Raw, fn: Callable[[Txn], T]) -> tuple[T, list[bytes]]:
    """Run ``fn`` in a transaction on ``c`` and roll it back: what it would do (and free), done nowhere."""
    c.execute("BEGIN")
    try:
        t = Txn(c)
        return fn(t), t.freed
    finally:
        c.execute("ROLLBACK")
