"""The one data-access module: every SQL statement of snapstore lives here (and in migrations/).

A :class:`Database` holds one apsw connection per thread (a connection is never shared between
concurrent transactions) and runs functions in IMMEDIATE write or deferred read transactions,
retrying when SQLite reports busy so that "database is locked" never reaches the caller.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import apsw
import apsw.bestpractice

from ._errors import CorruptionError, StateError, StoreFormatError, StoreIOError
from ._tokens import BLOCK

__all__ = ["APPLICATION_ID", "MIN_SQLITE", "ChunkRow", "Database", "OwnerRow", "PartRow", "SnapRow"]

T = TypeVar("T")
APPLICATION_ID = 0x534E5053  # "SNPS"
MIN_SQLITE = (3, 51, 3)
_BUSY_TIMEOUT_MS = 10_000
_BUSY_RETRIES = 50
_ANCHOR_BATCH = 2048  # anchors bound per match statement: far below SQLite's 32766-variable limit

Conn = apsw.Connection

_CHUNK_COLS = "id, raw_len, stored_len, codec, checksum, refs, created, scope, quarantined"
_SNAP_COLS = ("id, identity_id, namespace, parent_id, depth, n_tokens, base_tokens, token_width, tokens, "
              "anchor, prefix_key, content_key, session, state, owner, matchable, created, last_used, "
              "hits, logical_bytes")


@dataclass(frozen=True)
class SnapRow:
    """One row of ``snapshots``."""

    id: int
    identity_id: int
    namespace: str
    parent_id: int | None
    depth: int
    n_tokens: int
    base_tokens: int
    token_width: int
    tokens: bytes
    anchor: bytes
    prefix_key: bytes
    content_key: bytes
    session: str | None
    state: int
    owner: str | None
    matchable: int
    created: float
    last_used: float
    hits: int
    logical_bytes: int


@dataclass(frozen=True)
class PartRow:
    """One row of ``parts``: a fixed part whole, or a row-stream segment."""

    snapshot_id: int
    name: str
    kind: int
    dtype: str
    shape: tuple[int, ...]
    component: str | None
    row_start: int
    row_end: int
    nbytes: int


@dataclass(frozen=True)
class ChunkRow:
    """One row of ``chunks``."""

    id: bytes
    raw_len: int
    stored_len: int
    codec: int
    checksum: bytes
    refs: int
    created: float
    scope: bytes
    quarantined: float | None = None  # when a restore found the file damaged; None: healthy


@dataclass(frozen=True)
class OwnerRow:
    """One row of ``owners``: an open Store that may own pending captures, and its lease."""

    id: str
    kernel: str
    host: str
    pid: int
    lease: float
    renewed: float
    created: float


def _int(c: Conn, sql: str, args: tuple[Any, ...] = ()) -> int:
    """The integer a one-row, one-column aggregate query returns."""
    row = c.execute(sql, args).fetchone()
    assert row is not None
    return int(row[0])


def _snap(row: Sequence[Any]) -> SnapRow:
    return SnapRow(*row)


def _part(row: Sequence[Any]) -> PartRow:
    sid, name, kind, dtype, shape, comp, rs, re_, nb = row
    try:
        dims = json.loads(shape)
        if not isinstance(dims, list) or not all(isinstance(d, int) and d >= 0 for d in dims):
            raise ValueError(shape)
    except ValueError:
        raise CorruptionError(f"snapshot {sid} part {name!r} has a malformed shape {shape!r}") from None
    return PartRow(sid, name, kind, dtype, tuple(dims), comp, rs, re_, nb)


def migrations_dir() -> list[tuple[int, str, str]]:
    """The shipped migrations as (number, name, sql), in order."""
    found: list[tuple[int, str, str]] = []
    try:
        root: Any = resources.files("snapstore.migrations")
        entries = [(p.name, p.read_text()) for p in root.iterdir() if p.name.endswith(".sql")]
    except (ModuleNotFoundError, FileNotFoundError):
        src = Path(__file__).resolve().parent.parent / "migrations"
        entries = [(p.name, p.read_text()) for p in src.glob("*.sql")]
    for name, sql in entries:
        found.append((int(name.split("_", 1)[0]), name, sql))
    found.sort()
    return found


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


# A read-only connection cannot migrate a catalog written by an older version; these TEMP views
# (which shadow the main tables for unqualified names) give its queries the columns the newer
# migrations add, with their defaults. Keyed by the migration that adds the columns.
_COMPAT_VIEWS: dict[int, list[str]] = {
    2: ["CREATE TEMP TABLE owners(id TEXT PRIMARY KEY, kernel TEXT NOT NULL, host TEXT NOT NULL, "
        "pid INTEGER NOT NULL, lease REAL NOT NULL, renewed REAL NOT NULL, created REAL NOT NULL)"],
    3: ["CREATE TEMP VIEW chunks AS SELECT *, NULL AS quarantined FROM main.chunks"],
}


def _compat_views(c: Conn) -> None:
    ver = int(str(c.pragma("user_version")))
    for num, stmts in sorted(_COMPAT_VIEWS.items()):
        if 0 < ver < num:
            for sql in stmts:
                c.execute(sql)


class _Held:
    """One thread's connection; closing it when the thread's locals go keeps threads from leaking
    connections (a server with a thread per request)."""

    __slots__ = ("__weakref__", "conn")

    def __init__(self, conn: Conn):
        self.conn = conn

    def close(self) -> None:
        try:
            self.conn.close(True)
        except apsw.Error:
            pass

    def __del__(self) -> None:
        self.close()


class Database:
    """Thread-safe access to ``snapstore.db``: a connection per thread, retried transactions."""

    def __init__(self, path: str, *, readonly: bool = False):
        if apsw.sqlite_lib_version().split(".") and tuple(
            int(x) for x in apsw.sqlite_lib_version().split(".")[:3]
        ) < MIN_SQLITE:
            raise StoreFormatError(
                f"SQLite {apsw.sqlite_lib_version()} is too old; snapstore needs >= "
                f"{'.'.join(map(str, MIN_SQLITE))} (install a newer apsw wheel)"
            )
        self.path = path
        self.readonly = readonly
        self._local = threading.local()
        self._all: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
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
        else:
            self._check_version(conn)

    # -- connections -------------------------------------------------------------------------
    def conn(self) -> Conn:
        """This thread's connection (opened on first use; closed when the thread ends)."""
        holder: _Held | None = getattr(self._local, "held", None)
        if holder is not None:
            return holder.conn
        if self._closed:
            raise StateError("the store is closed; open it again with Store.open()")
        c = self._connect()
        holder = _Held(c)
        self._local.held = holder  # thread-local: dropped, and the connection closed, when the thread ends
        with self._lock:
            self._all.add(holder)
        return c

    def _connect(self) -> Conn:
        """A new, configured connection; "database is locked" while setting it up (another
        process holds the database exclusively, or is recovering it) is retried like a transaction."""
        flags = apsw.SQLITE_OPEN_READONLY if self.readonly else apsw.SQLITE_OPEN_READWRITE
        for attempt in range(_BUSY_RETRIES):
            c: Conn | None = None
            try:
                c = apsw.Connection(self.path, flags=flags | apsw.SQLITE_OPEN_NOFOLLOW)
                c.set_busy_timeout(_BUSY_TIMEOUT_MS)
                if not self.readonly:
                    apsw.bestpractice.connection_wal(c)
                apsw.bestpractice.connection_enable_foreign_keys(c)
                apsw.bestpractice.connection_dqs(c)
                apsw.bestpractice.connection_recursive_triggers(c)
                # FULL: a commit is durable when it returns (WAL fsync per commit), so a save the API
                # reported survives power loss, not only a process crash.
                c.pragma("synchronous", "FULL")
                if self.readonly:
                    _compat_views(c)
                return c
            except apsw.BusyError:
                if c is not None:
                    c.close()
                time.sleep(min(0.5, 0.005 * 2**min(attempt, 7)) * random.random())
            except apsw.Error as e:
                if c is not None:
                    c.close()
                raise translate(e) from None
        raise StoreIOError(16, "the store database stayed locked by another process for too long")

    def close(self) -> None:
        """Close every connection this object opened (all threads)."""
        with self._lock:
            self._closed = True
            held, self._all = list(self._all), weakref.WeakSet()
        for h in held:
            h.close()
        self._local = threading.local()

    # -- transactions ------------------------------------------------------------------------
    def write(self, fn: Callable[[Conn], T], *, durable: bool = True) -> T:
        """Run ``fn`` in an IMMEDIATE transaction, retried while the database is busy.

        ``durable=False`` skips the WAL fsync at commit (synchronous=NORMAL for this transaction):
        for bookkeeping such as last-use times and hit counters, which a power cut may roll back
        without harm; the next durable commit makes them durable too.
        """
        if durable:
            return self._transact(fn, "BEGIN IMMEDIATE")
        c = self.conn()
        c.pragma("synchronous", "NORMAL")
        try:
            return self._transact(fn, "BEGIN IMMEDIATE")
        finally:
            c.pragma("synchronous", "FULL")

    def try_write(self, fn: Callable[[Conn], T]) -> tuple[bool, T | None]:
        """Run ``fn`` in a write transaction only if the write lock is free now: (ran, result).

        Never waits for another writer (busy timeout 0, no retries) and skips the WAL fsync:
        for bookkeeping a reader records on the way out (last use, hit counts), which must not
        queue a restore behind a long write.
        """
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
                result = fn(c)
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

    def read(self, fn: Callable[[Conn], T]) -> T:
        """Run ``fn`` in a read transaction (a consistent snapshot of the database)."""
        return self._transact(fn, "BEGIN")

    def _transact(self, fn: Callable[[Conn], T], begin: str) -> T:
        c = self.conn()
        for attempt in range(_BUSY_RETRIES):
            try:
                c.execute(begin)
            except apsw.BusyError:
                time.sleep(min(0.5, 0.005 * 2**min(attempt, 7)) * random.random())
                continue
            except apsw.Error as e:
                raise translate(e) from None
            try:
                result = fn(c)
                c.execute("COMMIT")
                return result
            except apsw.BusyError:
                self._rollback(c)
                time.sleep(min(0.5, 0.005 * 2**min(attempt, 7)) * random.random())
                continue
            except BaseException as e:
                self._rollback(c)
                if isinstance(e, apsw.Error):
                    raise translate(e) from None
                raise
        raise StoreIOError(16, "the store database stayed locked by another process for too long")

    @staticmethod
    def _rollback(c: Conn) -> None:
        if not c.get_autocommit():
            try:
                c.execute("ROLLBACK")
            except apsw.Error:
                pass

    # -- schema ------------------------------------------------------------------------------
    def _check_version(self, c: Conn) -> int:
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

    def _migrate(self, c: Conn) -> None:
        ver = self._check_version(c)
        todo = [m for m in migrations_dir() if m[0] > ver]
        if not todo:
            return

        def apply(c: Conn) -> None:
            current = int(str(c.pragma("user_version")))
            for num, _name, sql in todo:
                if num <= current:
                    continue  # another process migrated first
                c.execute(sql)
                c.pragma("user_version", num)
            c.pragma("application_id", APPLICATION_ID)

        self.write(apply)

    # -- identities --------------------------------------------------------------------------
    @staticmethod
    def ensure_identity(c: Conn, key: str, canonical: str, now: float) -> int:
        row = c.execute("SELECT id FROM identities WHERE key = ?", (key,)).fetchone()
        if row:
            c.execute("UPDATE identities SET last_open = ? WHERE id = ?", (now, row[0]))
            return int(row[0])
        c.execute("INSERT INTO identities(key, canonical, created, last_open) VALUES (?, ?, ?, ?)",
                  (key, canonical, now, now))
        return int(c.last_insert_rowid())

    @staticmethod
    def identity_id(c: Conn, key: str) -> int | None:
        row = c.execute("SELECT id FROM identities WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else None

    @staticmethod
    def identity_key(c: Conn, identity_id: int) -> str | None:
        """The key of an identity row (what a snapshot's identity really is), or None if gone."""
        row = c.execute("SELECT key FROM identities WHERE id = ?", (identity_id,)).fetchone()
        return str(row[0]) if row else None

    @staticmethod
    def identities(c: Conn) -> list[tuple[int, str, str, float, float]]:
        return list(c.execute("SELECT id, key, canonical, created, last_open FROM identities ORDER BY id"))

    @staticmethod
    def delete_identity(c: Conn, identity_id: int) -> None:
        c.execute("DELETE FROM identities WHERE id = ? AND NOT EXISTS "
                  "(SELECT 1 FROM snapshots WHERE identity_id = ?)", (identity_id, identity_id))

    # -- snapshots ---------------------------------------------------------------------------
    @staticmethod
    def snapshot(c: Conn, sid: int) -> SnapRow | None:
        row = c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE id = ?", (sid,)).fetchone()
        return _snap(row) if row else None

    @staticmethod
    def snapshots(c: Conn, identity_id: int | None = None) -> list[SnapRow]:
        if identity_id is None:
            cur = c.execute(f"SELECT {_SNAP_COLS} FROM snapshots ORDER BY id")
        else:
            cur = c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE identity_id = ? ORDER BY id",
                            (identity_id,))
        return [_snap(r) for r in cur]

    @staticmethod
    def match_candidates(c: Conn, identity_key: str, namespace: str, anchors: Sequence[bytes],
                         max_tokens: int, not_before: float) -> Iterator[tuple[int, int, bytes]]:
        """(id, n_tokens, prefix_key) of committed matchable snapshots of the identity *key* whose
        anchor is one of ``anchors``, deepest first, read lazily (callers stop at a hit).

        The identity is resolved by key inside the statement, so a row id that has come to name
        another identity can never select its snapshots. ``anchors[i]`` anchors the prefixes of
        ``BLOCK i … BLOCK (i + 1) - 1`` tokens, so batches taken from the end are in n_tokens order too:
        one indexed statement per ``_ANCHOR_BATCH`` anchors (one for prompts below 512K tokens),
        and a prompt of any length stays under SQLite's bound-variable limit.
        """
        sql = ("SELECT id, n_tokens, prefix_key FROM snapshots WHERE identity_id = "
               "(SELECT id FROM identities WHERE key = ?) AND namespace = ? AND anchor IN ({marks}) "
               "AND n_tokens <= ? AND last_used >= ? AND state = 1 AND matchable = 1 "
               "ORDER BY n_tokens DESC, id DESC")
        hi = min(len(anchors), max_tokens // BLOCK + 1) if max_tokens >= 0 else 0
        while hi > 0:
            lo = max(0, hi - _ANCHOR_BATCH)
            batch = anchors[lo:hi]
            for sid, n, key in c.execute(sql.format(marks=",".join("?" * len(batch))),
                                         (identity_key, namespace, *batch, max_tokens, not_before)):
                yield int(sid), int(n), bytes(key)
            hi = lo

    @staticmethod
    def same_content(c: Conn, identity_id: int, namespace: str, prefix_key: bytes,
                     content_key: bytes) -> SnapRow | None:
        row = c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND prefix_key = ? "
            "AND content_key = ? AND state = 1 AND matchable = 1 LIMIT 1",
            (identity_id, namespace, prefix_key, content_key)).fetchone()
        return _snap(row) if row else None

    @staticmethod
    def chain(c: Conn, sid: int) -> list[SnapRow]:
        """The snapshot and its ancestors, root first."""
        rows = c.execute(
            f"WITH RECURSIVE ch(x, lvl) AS (SELECT ?, 0 UNION ALL "
            f"SELECT s.parent_id, ch.lvl + 1 FROM snapshots s JOIN ch ON s.id = ch.x "
            f"WHERE s.parent_id IS NOT NULL AND ch.lvl <= min((SELECT depth FROM snapshots WHERE id = ?), 100000)) "
            f"SELECT {_SNAP_COLS} FROM snapshots JOIN ch ON snapshots.id = ch.x ORDER BY ch.lvl DESC",
            (sid, sid)).fetchall()
        return [_snap(r[:20]) for r in rows]

    @staticmethod
    def insert_snapshot(c: Conn, **v: Any) -> int:
        c.execute(
            "INSERT INTO snapshots(identity_id, namespace, parent_id, depth, n_tokens, base_tokens, "
            "token_width, tokens, anchor, prefix_key, content_key, session, state, owner, matchable, "
            "created, last_used, hits, logical_bytes) VALUES (:identity_id, :namespace, :parent_id, :depth, "
            ":n_tokens, :base_tokens, :token_width, :tokens, :anchor, :prefix_key, :content_key, :session, "
            ":state, :owner, 1, :now, :now, 0, :logical_bytes)", v)
        return int(c.last_insert_rowid())

    @staticmethod
    def insert_part(c: Conn, sid: int, name: str, kind: int, dtype: str, shape: Sequence[int],
                    component: str | None, row_start: int, row_end: int, nbytes: int,
                    chunk_ids: Sequence[bytes]) -> None:
        c.execute("INSERT INTO parts(snapshot_id, name, kind, dtype, shape, component, row_start, row_end, "
                  "nbytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (sid, name, kind, dtype, json.dumps(list(shape)), component, row_start, row_end, nbytes))
        c.executemany("INSERT INTO part_chunks(snapshot_id, name, seq, chunk_id) VALUES (?, ?, ?, ?)",
                      [(sid, name, i, cid) for i, cid in enumerate(chunk_ids)])
        for cid in chunk_ids:
            c.execute("UPDATE chunks SET refs = refs + 1 WHERE id = ?", (cid,))

    @staticmethod
    def children(c: Conn, sid: int) -> list[int]:
        return [int(r[0]) for r in c.execute("SELECT id FROM snapshots WHERE parent_id = ?", (sid,))]

    @staticmethod
    def has_children(c: Conn, sid: int) -> bool:
        return c.execute("SELECT 1 FROM snapshots WHERE parent_id = ? LIMIT 1", (sid,)).fetchone() is not None

    @staticmethod
    def set_state(c: Conn, sid: int, state: int, owner: str | None, now: float) -> None:
        c.execute("UPDATE snapshots SET state = ?, owner = ?, last_used = ? WHERE id = ?",
                  (state, owner, now, sid))

    @staticmethod
    def touch(c: Conn, sid: int, now: float, hits: int) -> None:
        """Raise last_used to ``now`` and add ``hits`` restores (a snapshot gone meanwhile: no-op)."""
        c.execute("UPDATE snapshots SET last_used = max(last_used, ?), hits = hits + ? WHERE id = ?",
                  (now, int(hits), sid))

    @staticmethod
    def set_unmatchable(c: Conn, sid: int) -> None:
        c.execute("UPDATE snapshots SET matchable = 0 WHERE id = ?", (sid,))

    @staticmethod
    def session_prefixes(c: Conn, identity_id: int, namespace: str, session: str,
                         below_tokens: int, exclude: int) -> list[SnapRow]:
        return [_snap(r) for r in c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND session = ? "
            "AND state = 1 AND matchable = 1 AND n_tokens < ? AND id != ?",
            (identity_id, namespace, session, below_tokens, exclude))]

    @staticmethod
    def lru_leaves(c: Conn, exclude: Iterable[int], limit: int = 64) -> list[SnapRow]:
        """Committed snapshots without children, least recently used first."""
        ex = list(exclude)
        not_in = f"AND id NOT IN ({','.join('?' * len(ex))})" if ex else ""
        return [_snap(r) for r in c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots s WHERE state = 1 {not_in} AND NOT EXISTS "
            f"(SELECT 1 FROM snapshots k WHERE k.parent_id = s.id) ORDER BY last_used, id LIMIT ?",
            (*ex, limit))]

    @staticmethod
    def expired(c: Conn, before: float) -> list[SnapRow]:
        return [_snap(r) for r in c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE state = 1 AND last_used < ? ORDER BY depth DESC",
            (before,))]

    @staticmethod
    def pending(c: Conn) -> list[SnapRow]:
        return [_snap(r) for r in c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE state = 0")]

    @staticmethod
    def descendants(c: Conn, sid: int) -> list[int]:
        """Every snapshot below ``sid`` (children, grandchildren, ...), deepest first."""
        # UNION (not UNION ALL): a damaged catalog with a parent cycle still terminates
        rows = c.execute(
            "WITH RECURSIVE d(x) AS (SELECT id FROM snapshots WHERE parent_id = ? UNION "
            "SELECT s.id FROM snapshots s JOIN d ON s.parent_id = d.x) "
            "SELECT x FROM d JOIN snapshots ON snapshots.id = d.x WHERE x != ? ORDER BY depth DESC, x DESC",
            (sid, sid)).fetchall()
        return [int(str(r[0])) for r in rows]

    @staticmethod
    def delete_snapshot(c: Conn, sid: int) -> list[bytes]:
        """Delete one snapshot (it must have no children); return chunk ids whose refs fell to 0."""
        freed = Database._drop_parts(c, sid, None)
        c.execute("DELETE FROM snapshots WHERE id = ?", (sid,))
        return freed

    @staticmethod
    def drop_fixed_parts(c: Conn, sid: int) -> list[bytes]:
        """Drop a snapshot's fixed parts (kept as a chain link only); return freed chunk ids."""
        return Database._drop_parts(c, sid, 0)

    @staticmethod
    def _drop_parts(c: Conn, sid: int, kind: int | None) -> list[bytes]:
        cond = "" if kind is None else " AND name IN (SELECT name FROM parts WHERE snapshot_id = ? AND kind = ?)"
        args: tuple[Any, ...] = (sid,) if kind is None else (sid, sid, kind)
        ids = [bytes(r[0]) for r in c.execute(f"SELECT chunk_id FROM part_chunks WHERE snapshot_id = ?{cond}", args)]
        c.execute(f"DELETE FROM part_chunks WHERE snapshot_id = ?{cond}", args)
        if kind is None:
            c.execute("DELETE FROM parts WHERE snapshot_id = ?", (sid,))
        else:
            c.execute("DELETE FROM parts WHERE snapshot_id = ? AND kind = ?", (sid, kind))
        freed: list[bytes] = []
        for cid in ids:
            c.execute("UPDATE chunks SET refs = refs - 1 WHERE id = ?", (cid,))
        for cid in set(ids):
            row = c.execute("SELECT refs, stored_len FROM chunks WHERE id = ?", (cid,)).fetchone()
            if row and row[0] <= 0:
                c.execute("DELETE FROM chunks WHERE id = ?", (cid,))
                Database.add_counter(c, "stored_bytes", -int(row[1]))
                freed.append(cid)
        return freed

    # -- owners of pending captures ----------------------------------------------------------
    @staticmethod
    def owners(c: Conn) -> dict[str, OwnerRow]:
        """Every registered owner by id; none in a schema-v1 catalog read without migrating it."""
        if c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'owners'").fetchone() is None:
            return {}
        return {str(r[0]): OwnerRow(str(r[0]), str(r[1]), str(r[2]), int(r[3]), float(r[4]), float(r[5]),
                                    float(r[6]))
                for r in c.execute("SELECT id, kernel, host, pid, lease, renewed, created FROM owners")}

    @staticmethod
    def renew_owner(c: Conn, oid: str, kernel: str, host: str, pid: int, lease: float, now: float) -> None:
        """Register an owner or renew its lease (re-registering one a sweeper declared dead)."""
        c.execute("INSERT INTO owners(id, kernel, host, pid, lease, renewed, created) VALUES (?, ?, ?, ?, ?, ?, ?) "
                  "ON CONFLICT(id) DO UPDATE SET renewed = max(renewed, excluded.renewed), lease = excluded.lease",
                  (oid, kernel, host, pid, lease, now, now))

    @staticmethod
    def delete_owner(c: Conn, oid: str) -> None:
        c.execute("DELETE FROM owners WHERE id = ?", (oid,))

    # -- parts and chunks --------------------------------------------------------------------
    @staticmethod
    def parts(c: Conn, sid: int) -> list[PartRow]:
        return [_part(r) for r in c.execute(
            "SELECT snapshot_id, name, kind, dtype, shape, component, row_start, row_end, nbytes "
            "FROM parts WHERE snapshot_id = ? ORDER BY name", (sid,))]

    @staticmethod
    def part_chunks(c: Conn, sid: int, name: str) -> list[ChunkRow | None]:
        """The chunks of one part in order; None where a referenced chunk row is missing."""
        out: list[ChunkRow | None] = []
        for r in c.execute(
                "SELECT pc.chunk_id, c.raw_len, c.stored_len, c.codec, c.checksum, c.refs, c.created, c.scope, "
                "c.quarantined FROM part_chunks pc LEFT JOIN chunks c ON c.id = pc.chunk_id "
                "WHERE pc.snapshot_id = ? AND pc.name = ? ORDER BY pc.seq", (sid, name)):
            out.append(None if r[1] is None else ChunkRow(bytes(r[0]), *r[1:]))
        return out

    @staticmethod
    def add_chunk(c: Conn, cid: bytes, raw_len: int, stored_len: int, codec: int, csum: bytes,
                  scope: bytes, now: float) -> bool:
        """Insert a chunk row with refs 0 unless present; True if it was new."""
        c.execute("INSERT INTO chunks(id, raw_len, stored_len, codec, checksum, scope, refs, created) "
                  "VALUES (?, ?, ?, ?, ?, ?, 0, ?) ON CONFLICT(id) DO NOTHING",
                  (cid, raw_len, stored_len, codec, csum, scope, now))
        if c.changes():
            Database.add_counter(c, "stored_bytes", stored_len)
            return True
        return False

    @staticmethod
    def chunk(c: Conn, cid: bytes) -> ChunkRow | None:
        r = c.execute(f"SELECT {_CHUNK_COLS} FROM chunks WHERE id = ?", (cid,)).fetchone()
        return ChunkRow(bytes(r[0]), *r[1:]) if r else None

    @staticmethod
    def all_chunks(c: Conn) -> Iterator[ChunkRow]:
        for r in c.execute(f"SELECT {_CHUNK_COLS} FROM chunks"):
            yield ChunkRow(bytes(r[0]), *r[1:])

    @staticmethod
    def chunk_state(c: Conn, cid: bytes) -> int:
        """0: no row; 1: a healthy row; 2: a quarantined row (one index probe, no transaction needed)."""
        r = c.execute("SELECT quarantined IS NULL FROM chunks WHERE id = ?", (cid,)).fetchone()
        return 0 if r is None else (1 if r[0] else 2)

    @staticmethod
    def heal_chunk(c: Conn, cid: bytes, stored_len: int, codec: int) -> None:
        """Make a chunk row describe the file just published at its address, and lift its quarantine."""
        r = c.execute("SELECT stored_len, quarantined FROM chunks WHERE id = ?", (cid,)).fetchone()
        if r is None:
            return
        c.execute("UPDATE chunks SET stored_len = ?, codec = ?, quarantined = NULL WHERE id = ?",
                  (stored_len, codec, cid))
        if stored_len != r[0]:
            Database.add_counter(c, "stored_bytes", stored_len - int(r[0]))
        if r[1] is not None:
            Database.add_counter(c, "healed", 1)

    @staticmethod
    def quarantine_chunk(c: Conn, cid: bytes, now: float) -> bool:
        """Mark a healthy chunk row as damaged; True if this call did (False: no row, or already)."""
        c.execute("UPDATE chunks SET quarantined = ? WHERE id = ? AND quarantined IS NULL", (now, cid))
        if c.changes():
            Database.add_counter(c, "quarantines", 1)
            return True
        return False

    @staticmethod
    def quarantined_ids(c: Conn) -> set[bytes]:
        """Ids of the quarantined chunks (few; read through the partial index)."""
        return {bytes(r[0]) for r in c.execute("SELECT id FROM chunks WHERE quarantined IS NOT NULL")}

    @staticmethod
    def quarantined_users(c: Conn) -> dict[int, bool]:
        """Snapshots that use a quarantined chunk -> True when a row-stream segment does (then every
        descendant is hit too), False when only fixed parts do (only the snapshot itself). One probe
        of the partial index when nothing is quarantined."""
        out: dict[int, bool] = {}
        for sid, kind in c.execute(
                "SELECT DISTINCT pc.snapshot_id, p.kind FROM chunks q JOIN part_chunks pc ON pc.chunk_id = q.id "
                "JOIN parts p ON p.snapshot_id = pc.snapshot_id AND p.name = pc.name "
                "WHERE q.quarantined IS NOT NULL"):
            out[int(sid)] = out.get(int(sid), False) or int(kind) == 1
        return out

    @staticmethod
    def chunk_users(c: Conn, cid: bytes) -> list[int]:
        return [int(r[0]) for r in c.execute(
            "SELECT DISTINCT snapshot_id FROM part_chunks WHERE chunk_id = ?", (cid,))]

    @staticmethod
    def refcount_mismatches(c: Conn) -> list[tuple[bytes, int, int]]:
        return [(bytes(r[0]), int(r[1]), int(r[2])) for r in c.execute(
            "SELECT c.id, c.refs, (SELECT count(*) FROM part_chunks pc WHERE pc.chunk_id = c.id) AS n "
            "FROM chunks c WHERE c.refs != n")]

    # -- accounting and counters -------------------------------------------------------------
    @staticmethod
    def add_counter(c: Conn, name: str, delta: int) -> None:
        c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, delta))

    @staticmethod
    def counters(c: Conn) -> dict[str, int]:
        return {str(k): int(v) for k, v in c.execute("SELECT name, value FROM counters")}

    @staticmethod
    def totals(c: Conn) -> tuple[int, int, int, int]:
        """(stored bytes, logical bytes, committed matchable entries, all snapshots) from the tables."""
        stored = _int(c, "SELECT coalesce(sum(stored_len), 0) FROM chunks")
        row = c.execute(
            "SELECT coalesce(sum(CASE WHEN matchable = 1 THEN logical_bytes ELSE 0 END), 0), "
            "coalesce(sum(state = 1 AND matchable = 1), 0), count(*) FROM snapshots").fetchone()
        assert row is not None
        return stored, int(row[0]), int(row[1]), int(row[2])

    @staticmethod
    def census(c: Conn) -> tuple[int, int, int]:
        """(pending snapshots, chunks, raw bytes referenced counting every reference: for dedup ratio)."""
        return (_int(c, "SELECT count(*) FROM snapshots WHERE state = 0"),
                _int(c, "SELECT count(*) FROM chunks"),
                _int(c, "SELECT coalesce(sum(c.raw_len), 0) FROM part_chunks pc JOIN chunks c ON c.id = pc.chunk_id"))

    @staticmethod
    def quarantined_count(c: Conn) -> int:
        """Chunks quarantined now (damaged, awaiting a save of the correct bytes or a repair)."""
        return _int(c, "SELECT count(*) FROM chunks WHERE quarantined IS NOT NULL")

    @staticmethod
    def set_refs(c: Conn, cid: bytes, refs: int) -> None:
        c.execute("UPDATE chunks SET refs = ? WHERE id = ?", (refs, cid))

    @staticmethod
    def delete_chunk_row(c: Conn, cid: bytes) -> None:
        c.execute("DELETE FROM chunks WHERE id = ?", (cid,))

    @staticmethod
    def orphan_part_owners(c: Conn) -> list[int]:
        """Snapshot ids that own parts but have no snapshots row (a row deleted behind our back)."""
        return [int(str(r[0])) for r in c.execute(
            "SELECT DISTINCT snapshot_id FROM parts WHERE snapshot_id NOT IN (SELECT id FROM snapshots) "
            "UNION SELECT DISTINCT snapshot_id FROM part_chunks WHERE snapshot_id NOT IN (SELECT id FROM snapshots)")]

    @staticmethod
    def chunk_exists(c: Conn, cid: bytes) -> bool:
        return c.execute("SELECT 1 FROM chunks WHERE id = ?", (cid,)).fetchone() is not None

    @staticmethod
    def stored_bytes(c: Conn) -> int:
        row = c.execute("SELECT value FROM counters WHERE name = 'stored_bytes'").fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def entry_count(c: Conn) -> int:
        return _int(c, "SELECT count(*) FROM snapshots WHERE state = 1 AND matchable = 1")

    @staticmethod
    def set_counter(c: Conn, name: str, value: int) -> None:
        c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = excluded.value", (name, value))

    @staticmethod
    def integrity_check(c: Conn) -> list[str]:
        return [str(r[0]) for r in c.execute("PRAGMA integrity_check") if r[0] != "ok"]

    @staticmethod
    def foreign_key_check(c: Conn) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in c.execute("PRAGMA foreign_key_check")]


# -- private copies of a catalog (dry runs, read-only inspection) ------------------------------
def rolled_back(c: Conn, fn: Callable[[Conn], T]) -> T:
    """Run ``fn`` in a transaction on ``c`` and roll it back: what it would do, done nowhere."""
    c.execute("BEGIN")
    try:
        return fn(c)
    finally:
        c.execute("ROLLBACK")


def catalog_copy(src: Conn) -> Conn:
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

    def __init__(self, mem: Conn, path: str) -> None:  # no super().__init__(): nothing on disk to open
        self.path = path
        self.readonly = True
        self._mem: Conn | None = mem
        self._migrate(mem)  # the copy is private: bring a catalog of an older version up to date

    def conn(self) -> Conn:
        if self._mem is None:
            raise StoreFormatError("the catalog snapshot is closed")
        return self._mem

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()
            self._mem = None


def snapshot_catalog(db_path: str) -> Conn:
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
