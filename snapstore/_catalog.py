"""The catalog queries: every statement snapstore runs on its tables (SQL lives here, in _db.py and
in migrations/ only).

A :class:`Txn` is one transaction as its callers see it: it carries the queries and collects the
chunk ids whose last reference it removed (``freed``). Nobody unlinks a chunk file inside a
transaction: the repository's write path (:meth:`snapstore._repo.Repo.write`) unlinks ``freed``
after the commit, so "rows first, files after commit" holds by construction.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import apsw

from ._errors import CorruptionError
from ._tokens import BLOCK

__all__ = ["ChunkRow", "OwnerRow", "PartKind", "PartRow", "SnapRow", "SnapState", "Txn"]

_ANCHOR_BATCH = 2048  # anchors bound per match statement: far below SQLite's 32766-variable limit


class SnapState(enum.IntEnum):
    """``snapshots.state``: a pending capture (invisible to match) or a committed snapshot."""

    PENDING = 0
    COMMITTED = 1


class PartKind(enum.IntEnum):
    """``parts.kind``: a fixed part stored whole, or a row-stream segment."""

    FIXED = 0
    ROWS = 1


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


def _int(c: apsw.Connection, sql: str, args: tuple[Any, ...] = ()) -> int:
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


class Txn:
    """One open transaction on the catalog: its queries, and the chunk ids it freed (``freed``)."""

    __slots__ = ("_c", "freed")

    def __init__(self, conn: apsw.Connection) -> None:
        self._c = conn
        self.freed: list[bytes] = []

    def free(self, cid: bytes) -> None:
        """Record a chunk whose row this transaction removed: its file goes after the commit."""
        self.freed.append(cid)

    # raw statements, for tests that damage a catalog on purpose (library code uses the queries)
    def execute(self, sql: str, args: Sequence[Any] | dict[str, Any] = ()) -> apsw.Cursor:
        """Run one statement on this transaction's connection (tests only)."""
        return self._c.execute(sql, args)

    def pragma(self, name: str, value: Any = None) -> Any:
        """Read (or set) a pragma on this transaction's connection."""
        return self._c.pragma(name) if value is None else self._c.pragma(name, value)

    # -- identities --------------------------------------------------------------------------
    def ensure_identity(self, key: str, canonical: str, now: float) -> int:
        row = self._c.execute("SELECT id FROM identities WHERE key = ?", (key,)).fetchone()
        if row:
            self._c.execute("UPDATE identities SET last_open = ? WHERE id = ?", (now, row[0]))
            return int(row[0])
        self._c.execute("INSERT INTO identities(key, canonical, created, last_open) VALUES (?, ?, ?, ?)",
                  (key, canonical, now, now))
        return int(self._c.last_insert_rowid())

    def identity_id(self, key: str) -> int | None:
        row = self._c.execute("SELECT id FROM identities WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else None

    def identity_key(self, identity_id: int) -> str | None:
        """The key of an identity row (what a snapshot's identity really is), or None if gone."""
        row = self._c.execute("SELECT key FROM identities WHERE id = ?", (identity_id,)).fetchone()
        return str(row[0]) if row else None

    def identities(self) -> list[tuple[int, str, str, float, float]]:
        return list(self._c.execute("SELECT id, key, canonical, created, last_open FROM identities ORDER BY id"))

    def delete_identity(self, identity_id: int) -> None:
        self._c.execute("DELETE FROM identities WHERE id = ? AND NOT EXISTS "
                  "(SELECT 1 FROM snapshots WHERE identity_id = ?)", (identity_id, identity_id))

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot(self, sid: int) -> SnapRow | None:
        row = self._c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE id = ?", (sid,)).fetchone()
        return _snap(row) if row else None

    def snapshots(self, identity_id: int | None = None) -> list[SnapRow]:
        if identity_id is None:
            cur = self._c.execute(f"SELECT {_SNAP_COLS} FROM snapshots ORDER BY id")
        else:
            cur = self._c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE identity_id = ? ORDER BY id",
                            (identity_id,))
        return [_snap(r) for r in cur]

    def match_candidates(self, identity_key: str, namespace: str, anchors: Sequence[bytes],
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
            for sid, n, key in self._c.execute(sql.format(marks=",".join("?" * len(batch))),
                                         (identity_key, namespace, *batch, max_tokens, not_before)):
                yield int(sid), int(n), bytes(key)
            hi = lo

    def same_content(self, identity_id: int, namespace: str, prefix_key: bytes,
                     content_key: bytes) -> SnapRow | None:
        row = self._c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND prefix_key = ? "
            "AND content_key = ? AND state = 1 AND matchable = 1 LIMIT 1",
            (identity_id, namespace, prefix_key, content_key)).fetchone()
        return _snap(row) if row else None

    def chain(self, sid: int) -> list[SnapRow]:
        """The snapshot and its ancestors, root first."""
        rows = self._c.execute(
            f"WITH RECURSIVE ch(x, lvl) AS (SELECT ?, 0 UNION ALL "
            f"SELECT s.parent_id, ch.lvl + 1 FROM snapshots s JOIN ch ON s.id = ch.x "
            f"WHERE s.parent_id IS NOT NULL AND ch.lvl <= min((SELECT depth FROM snapshots WHERE id = ?), 100000)) "
            f"SELECT {_SNAP_COLS} FROM snapshots JOIN ch ON snapshots.id = ch.x ORDER BY ch.lvl DESC",
            (sid, sid)).fetchall()
        return [_snap(r[:20]) for r in rows]

    def insert_snapshot(self, **v: Any) -> int:
        self._c.execute(
            "INSERT INTO snapshots(identity_id, namespace, parent_id, depth, n_tokens, base_tokens, "
            "token_width, tokens, anchor, prefix_key, content_key, session, state, owner, matchable, "
            "created, last_used, hits, logical_bytes) VALUES (:identity_id, :namespace, :parent_id, :depth, "
            ":n_tokens, :base_tokens, :token_width, :tokens, :anchor, :prefix_key, :content_key, :session, "
            ":state, :owner, 1, :now, :now, 0, :logical_bytes)", v)
        return int(self._c.last_insert_rowid())

    # -- block-granular prefixes (see _prefix_match.py) --------------------------------------
    def insert_row_prefixes(self, sid: int, keys: Sequence[tuple[int, bytes]]) -> None:
        """Index ``sid`` under each (n_tokens, key) prefix it adds."""
        self._c.executemany("INSERT OR IGNORE INTO row_prefixes(snapshot_id, n_tokens, key) VALUES (?, ?, ?)",
                            [(sid, n, k) for n, k in keys])

    def row_prefix_holders(self, identity_key: str, namespace: str, key: bytes, n_tokens: int,
                           limit: int) -> list[int]:
        """Committed snapshots of the identity *key* and namespace whose tokens start with the
        prefix ``key`` names (``n_tokens`` long), most recently used first."""
        rows = self._c.execute(
            "SELECT s.id FROM row_prefixes r JOIN snapshots s ON s.id = r.snapshot_id WHERE r.key = ? "
            "AND r.n_tokens = ? AND s.identity_id = (SELECT id FROM identities WHERE key = ?) "
            "AND s.namespace = ? AND s.state = 1 ORDER BY s.last_used DESC, s.id DESC LIMIT ?",
            (key, n_tokens, identity_key, namespace, limit)).fetchall()
        return [int(str(r[0])) for r in rows]

    def insert_part(self, sid: int, name: str, kind: int, dtype: str, shape: Sequence[int],
                    component: str | None, row_start: int, row_end: int, nbytes: int,
                    chunk_ids: Sequence[bytes]) -> None:
        self._c.execute("INSERT INTO parts(snapshot_id, name, kind, dtype, shape, component, row_start, row_end, "
                  "nbytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (sid, name, kind, dtype, json.dumps(list(shape)), component, row_start, row_end, nbytes))
        self._c.executemany("INSERT INTO part_chunks(snapshot_id, name, seq, chunk_id) VALUES (?, ?, ?, ?)",
                      [(sid, name, i, cid) for i, cid in enumerate(chunk_ids)])
        for cid in chunk_ids:
            self._c.execute("UPDATE chunks SET refs = refs + 1 WHERE id = ?", (cid,))

    def children(self, sid: int) -> list[int]:
        return [int(r[0]) for r in self._c.execute("SELECT id FROM snapshots WHERE parent_id = ?", (sid,))]

    def has_children(self, sid: int) -> bool:
        return self._c.execute("SELECT 1 FROM snapshots WHERE parent_id = ? LIMIT 1", (sid,)).fetchone() is not None

    def set_state(self, sid: int, state: int, owner: str | None, now: float) -> None:
        self._c.execute("UPDATE snapshots SET state = ?, owner = ?, last_used = ? WHERE id = ?",
                  (state, owner, now, sid))

    def touch(self, sid: int, now: float, hits: int) -> None:
        """Raise last_used to ``now`` and add ``hits`` restores (a snapshot gone meanwhile: no-op)."""
        self._c.execute("UPDATE snapshots SET last_used = max(last_used, ?), hits = hits + ? WHERE id = ?",
                  (now, int(hits), sid))

    def set_unmatchable(self, sid: int) -> None:
        self._c.execute("UPDATE snapshots SET matchable = 0 WHERE id = ?", (sid,))

    def session_prefixes(self, identity_id: int, namespace: str, session: str,
                         below_tokens: int, exclude: int) -> list[SnapRow]:
        return [_snap(r) for r in self._c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND session = ? "
            "AND state = 1 AND matchable = 1 AND n_tokens < ? AND id != ?",
            (identity_id, namespace, session, below_tokens, exclude))]

    def lru_leaves(self, exclude: Iterable[int], limit: int = 64) -> list[SnapRow]:
        """Committed snapshots without children, least recently used first."""
        ex = list(exclude)
        not_in = f"AND id NOT IN ({','.join('?' * len(ex))})" if ex else ""
        return [_snap(r) for r in self._c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots s WHERE state = 1 {not_in} AND NOT EXISTS "
            f"(SELECT 1 FROM snapshots k WHERE k.parent_id = s.id) ORDER BY last_used, id LIMIT ?",
            (*ex, limit))]

    def expired(self, before: float) -> list[SnapRow]:
        return [_snap(r) for r in self._c.execute(
            f"SELECT {_SNAP_COLS} FROM snapshots WHERE state = 1 AND last_used < ? ORDER BY depth DESC",
            (before,))]

    def pending(self) -> list[SnapRow]:
        return [_snap(r) for r in self._c.execute(f"SELECT {_SNAP_COLS} FROM snapshots WHERE state = 0")]

    def descendants(self, sid: int) -> list[int]:
        """Every snapshot below ``sid`` (children, grandchildren, ...), deepest first."""
        # UNION (not UNION ALL): a damaged catalog with a parent cycle still terminates
        rows = self._c.execute(
            "WITH RECURSIVE d(x) AS (SELECT id FROM snapshots WHERE parent_id = ? UNION "
            "SELECT s.id FROM snapshots s JOIN d ON s.parent_id = d.x) "
            "SELECT x FROM d JOIN snapshots ON snapshots.id = d.x WHERE x != ? ORDER BY depth DESC, x DESC",
            (sid, sid)).fetchall()
        return [int(str(r[0])) for r in rows]

    def delete_snapshot(self, sid: int) -> None:
        """Delete one snapshot (it must have no children); chunks whose refs fall to 0 join ``freed``."""
        self._drop_parts(sid, None)
        self._c.execute("DELETE FROM snapshots WHERE id = ?", (sid,))

    def drop_fixed_parts(self, sid: int) -> None:
        """Drop a snapshot's fixed parts (kept as a chain link only); freed chunks join ``freed``."""
        self._drop_parts(sid, PartKind.FIXED)

    def _drop_parts(self, sid: int, kind: int | None) -> None:
        cond = "" if kind is None else " AND name IN (SELECT name FROM parts WHERE snapshot_id = ? AND kind = ?)"
        args: tuple[Any, ...] = (sid,) if kind is None else (sid, sid, kind)
        ids = [bytes(r[0]) for r in
               self._c.execute(f"SELECT chunk_id FROM part_chunks WHERE snapshot_id = ?{cond}", args)]
        self._c.execute(f"DELETE FROM part_chunks WHERE snapshot_id = ?{cond}", args)
        if kind is None:
            self._c.execute("DELETE FROM parts WHERE snapshot_id = ?", (sid,))
        else:
            self._c.execute("DELETE FROM parts WHERE snapshot_id = ? AND kind = ?", (sid, kind))
        for cid in ids:
            self._c.execute("UPDATE chunks SET refs = refs - 1 WHERE id = ?", (cid,))
        for cid in dict.fromkeys(ids):
            row = self._c.execute("SELECT refs, stored_len FROM chunks WHERE id = ?", (cid,)).fetchone()
            if row and row[0] <= 0:
                self._c.execute("DELETE FROM chunks WHERE id = ?", (cid,))
                self.add_counter("stored_bytes", -int(row[1]))
                self.free(cid)

    # -- owners of pending captures ----------------------------------------------------------
    def owners(self) -> dict[str, OwnerRow]:
        """Every registered owner by id; none in a schema-v1 catalog read without migrating it."""
        if self._c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'owners'").fetchone() is None:
            return {}
        return {str(r[0]): OwnerRow(str(r[0]), str(r[1]), str(r[2]), int(r[3]), float(r[4]), float(r[5]),
                                    float(r[6]))
                for r in self._c.execute("SELECT id, kernel, host, pid, lease, renewed, created FROM owners")}

    def renew_owner(self, oid: str, kernel: str, host: str, pid: int, lease: float, now: float) -> None:
        """Register an owner or renew its lease (re-registering one a sweeper declared dead)."""
        self._c.execute("INSERT INTO owners(id, kernel, host, pid, lease, renewed, created) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?) "
                  "ON CONFLICT(id) DO UPDATE SET renewed = max(renewed, excluded.renewed), lease = excluded.lease",
                  (oid, kernel, host, pid, lease, now, now))

    def delete_owner(self, oid: str) -> None:
        self._c.execute("DELETE FROM owners WHERE id = ?", (oid,))

    # -- parts and chunks --------------------------------------------------------------------
    def parts(self, sid: int) -> list[PartRow]:
        return [_part(r) for r in self._c.execute(
            "SELECT snapshot_id, name, kind, dtype, shape, component, row_start, row_end, nbytes "
            "FROM parts WHERE snapshot_id = ? ORDER BY name", (sid,))]

    def part_chunks(self, sid: int, name: str) -> list[ChunkRow | None]:
        """The chunks of one part in order; None where a referenced chunk row is missing."""
        out: list[ChunkRow | None] = []
        for r in self._c.execute(
                "SELECT pc.chunk_id, c.raw_len, c.stored_len, c.codec, c.checksum, c.refs, c.created, c.scope, "
                "c.quarantined FROM part_chunks pc LEFT JOIN chunks c ON c.id = pc.chunk_id "
                "WHERE pc.snapshot_id = ? AND pc.name = ? ORDER BY pc.seq", (sid, name)):
            out.append(None if r[1] is None else ChunkRow(bytes(r[0]), *r[1:]))
        return out

    def add_chunk(self, cid: bytes, raw_len: int, stored_len: int, codec: int, csum: bytes,
                  scope: bytes, now: float) -> bool:
        """Insert a chunk row with refs 0 unless present; True if it was new."""
        self._c.execute("INSERT INTO chunks(id, raw_len, stored_len, codec, checksum, scope, refs, created) "
                  "VALUES (?, ?, ?, ?, ?, ?, 0, ?) ON CONFLICT(id) DO NOTHING",
                  (cid, raw_len, stored_len, codec, csum, scope, now))
        if self._c.changes():
            self.add_counter("stored_bytes", stored_len)
            return True
        return False

    def chunk(self, cid: bytes) -> ChunkRow | None:
        r = self._c.execute(f"SELECT {_CHUNK_COLS} FROM chunks WHERE id = ?", (cid,)).fetchone()
        return ChunkRow(bytes(r[0]), *r[1:]) if r else None

    def all_chunks(self) -> Iterator[ChunkRow]:
        for r in self._c.execute(f"SELECT {_CHUNK_COLS} FROM chunks"):
            yield ChunkRow(bytes(r[0]), *r[1:])

    def chunk_state(self, cid: bytes) -> int:
        """0: no row; 1: a healthy row; 2: a quarantined row (one index probe, no transaction needed)."""
        r = self._c.execute("SELECT quarantined IS NULL FROM chunks WHERE id = ?", (cid,)).fetchone()
        return 0 if r is None else (1 if r[0] else 2)

    def heal_chunk(self, cid: bytes, stored_len: int, codec: int) -> None:
        """Make a chunk row describe the file just published at its address, and lift its quarantine."""
        r = self._c.execute("SELECT stored_len, quarantined FROM chunks WHERE id = ?", (cid,)).fetchone()
        if r is None:
            return
        self._c.execute("UPDATE chunks SET stored_len = ?, codec = ?, quarantined = NULL WHERE id = ?",
                  (stored_len, codec, cid))
        if stored_len != r[0]:
            self.add_counter("stored_bytes", stored_len - int(r[0]))
        if r[1] is not None:
            self.add_counter("healed", 1)

    def quarantine_chunk(self, cid: bytes, now: float) -> bool:
        """Mark a healthy chunk row as damaged; True if this call did (False: no row, or already)."""
        self._c.execute("UPDATE chunks SET quarantined = ? WHERE id = ? AND quarantined IS NULL", (now, cid))
        if self._c.changes():
            self.add_counter("quarantines", 1)
            return True
        return False

    def quarantined_ids(self) -> set[bytes]:
        """Ids of the quarantined chunks (few; read through the partial index)."""
        return {bytes(r[0]) for r in self._c.execute("SELECT id FROM chunks WHERE quarantined IS NOT NULL")}

    def quarantined_users(self) -> dict[int, bool]:
        """Snapshots that use a quarantined chunk -> True when a row-stream segment does (then every
        descendant is hit too), False when only fixed parts do (only the snapshot itself). One probe
        of the partial index when nothing is quarantined."""
        out: dict[int, bool] = {}
        for sid, kind in self._c.execute(
                "SELECT DISTINCT pc.snapshot_id, p.kind FROM chunks q JOIN part_chunks pc ON pc.chunk_id = q.id "
                "JOIN parts p ON p.snapshot_id = pc.snapshot_id AND p.name = pc.name "
                "WHERE q.quarantined IS NOT NULL"):
            out[int(sid)] = out.get(int(sid), False) or int(kind) == 1
        return out

    def chunk_users(self, cid: bytes) -> list[int]:
        return [int(r[0]) for r in self._c.execute(
            "SELECT DISTINCT snapshot_id FROM part_chunks WHERE chunk_id = ?", (cid,))]

    def refcount_mismatches(self) -> list[tuple[bytes, int, int]]:
        return [(bytes(r[0]), int(r[1]), int(r[2])) for r in self._c.execute(
            "SELECT c.id, c.refs, (SELECT count(*) FROM part_chunks pc WHERE pc.chunk_id = c.id) AS n "
            "FROM chunks c WHERE c.refs != n")]

    # -- accounting and counters -------------------------------------------------------------
    def add_counter(self, name: str, delta: int) -> None:
        self._c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, delta))

    def counters(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self._c.execute("SELECT name, value FROM counters")}

    def totals(self) -> tuple[int, int, int, int]:
        """(stored bytes, logical bytes, committed matchable entries, all snapshots) from the tables."""
        stored = _int(self._c, "SELECT coalesce(sum(stored_len), 0) FROM chunks")
        row = self._c.execute(
            "SELECT coalesce(sum(CASE WHEN matchable = 1 THEN logical_bytes ELSE 0 END), 0), "
            "coalesce(sum(state = 1 AND matchable = 1), 0), count(*) FROM snapshots").fetchone()
        assert row is not None
        return stored, int(row[0]), int(row[1]), int(row[2])

    def census(self) -> tuple[int, int, int]:
        """(pending snapshots, chunks, raw bytes referenced counting every reference: for dedup ratio)."""
        return (_int(self._c, "SELECT count(*) FROM snapshots WHERE state = 0"),
                _int(self._c, "SELECT count(*) FROM chunks"),
                _int(self._c, "SELECT coalesce(sum(c.raw_len), 0) FROM part_chunks pc "
                     "JOIN chunks c ON c.id = pc.chunk_id"))

    def quarantined_count(self) -> int:
        """Chunks quarantined now (damaged, awaiting a save of the correct bytes or a repair)."""
        return _int(self._c, "SELECT count(*) FROM chunks WHERE quarantined IS NOT NULL")

    def set_refs(self, cid: bytes, refs: int) -> None:
        self._c.execute("UPDATE chunks SET refs = ? WHERE id = ?", (refs, cid))

    def delete_chunk_row(self, cid: bytes) -> None:
        """Delete a chunk row (repair); its file joins ``freed``."""
        self._c.execute("DELETE FROM chunks WHERE id = ?", (cid,))
        self.free(cid)

    def orphan_part_owners(self) -> list[int]:
        """Snapshot ids that own parts but have no snapshots row (a row deleted behind our back)."""
        return [int(str(r[0])) for r in self._c.execute(
            "SELECT DISTINCT snapshot_id FROM parts WHERE snapshot_id NOT IN (SELECT id FROM snapshots) "
            "UNION SELECT DISTINCT snapshot_id FROM part_chunks WHERE snapshot_id NOT IN (SELECT id FROM snapshots)")]

    def chunk_exists(self, cid: bytes) -> bool:
        return self._c.execute("SELECT 1 FROM chunks WHERE id = ?", (cid,)).fetchone() is not None

    def stored_bytes(self) -> int:
        row = self._c.execute("SELECT value FROM counters WHERE name = 'stored_bytes'").fetchone()
        return int(row[0]) if row else 0

    def entry_count(self) -> int:
        return _int(self._c, "SELECT count(*) FROM snapshots WHERE state = 1 AND matchable = 1")

    def set_counter(self, name: str, value: int) -> None:
        self._c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = excluded.value", (name, value))

    def integrity_check(self) -> list[str]:
        return [str(r[0]) for r in self._c.execute("PRAGMA integrity_check") if r[0] != "ok"]

    def foreign_key_check(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._c.execute("PRAGMA foreign_key_check")]
