"""The catalog queries: every statement snapstore runs on its tables (SQL lives here, in
catalog/chunk_queries.py, catalog/rows.py, catalog/db.py and migrations/ only).

A :class:`Txn` is one transaction as its callers see it: it carries the queries and collects the
chunk ids whose last reference it removed (``freed``). Nobody unlinks a chunk file inside a
transaction: the repository's write path (:meth:`snapstore.chunks.repo.Repo.write`) unlinks ``freed``
after the commit, so "rows first, files after commit" holds by construction.

This module holds the queries on identities, snapshots (match candidates, chains, the lifecycle)
and owners; :mod:`snapstore.catalog.chunk_queries` those on parts, chunks and counters; :mod:`snapstore.catalog.rows`
the row types (re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apsw
import numpy as np

from snapstore._errors import CorruptionError
from snapstore._tokens import BLOCK, Link, Segment, decode_tokens
from snapstore.catalog.admission_queries import TTL_FRESH_SQL, AdmissionQueries
from snapstore.catalog.chunk_queries import QUARANTINED_USERS_SQL, ChunkQueries
from snapstore.catalog.find_keys import FIND_SEED, extend
from snapstore.catalog.prefix_queries import PrefixQueries
from snapstore.catalog.rate_queries import RateQueries
from snapstore.catalog.rows import (
    N_SNAP,
    SNAP_COLS,
    ChunkRow,
    OwnerRow,
    PartKind,
    PartRow,
    SnapRow,
    SnapState,
    snap_row,
)

__all__ = ["QUARANTINED_USERS_SQL", "ChunkRow", "OwnerRow", "PartKind", "PartRow", "SnapRow", "SnapState", "Txn"]

_ANCHOR_BATCH = 2048  # find keys per match statement: far below SQLite's 32766-variable limit
# The first match statement binds only the deepest find keys: a hit is usually a prompt that
# extends a saved one by a turn, so it ends within these, and one index probe per 256-token block
# of a 128K prompt (515) cost more than the rest of a hit (docs/benchmarks.md). A miss pays one
# more statement for the remaining keys.
_FIRST_BATCH = 32


def _carray() -> Any:
    """apsw's binding of an int64 array to SQLite's carray() as one value, where this apsw and its
    SQLite have it (apsw 3.54 here): a 515-key probe costs ~0.6x the same IN list of bound variables."""
    make = getattr(apsw, "carray", None)
    if make is None:
        return None
    probe = apsw.Connection(":memory:")
    try:
        probe.execute("SELECT value FROM carray(?)", (make(np.zeros(1, np.int64)),)).fetchall()
    except apsw.Error:
        return None  # an SQLite built without carray: the IN list
    finally:
        probe.close()
    return make


_CARRAY: Any = _carray()


# The walk from snapshot ?1 up its parents: ch(x, lvl, want), lvl 0 the snapshot itself, ``want``
# the base_tokens of the row below (where a link must end; NULL at lvl 0); bounded by its recorded
# depth (and 100000), so a damaged parent cycle cannot loop. One text for every chain query.
_WALK = ("WITH RECURSIVE ch(x, lvl, want) AS (SELECT ?1, 0, NULL UNION ALL "
         "SELECT s.parent_id, ch.lvl + 1, s.base_tokens FROM snapshots s JOIN ch ON s.id = ch.x "
         "WHERE s.parent_id IS NOT NULL AND ch.lvl <= min((SELECT depth FROM snapshots WHERE id = ?1), 100000))")


_SNAP_COLS_S = ", ".join(f"s.{col.strip()}" for col in SNAP_COLS.split(","))  # SNAP_COLS of `snapshots s`


class Txn(ChunkQueries, AdmissionQueries, RateQueries, PrefixQueries):
    """One open transaction on the catalog: its queries, and the chunk ids it freed (``freed``)."""

    __slots__ = ("_c", "freed")

    def __init__(self, conn: apsw.Connection) -> None:
        self._c = conn
        self.freed: list[bytes] = []

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
        row = self._c.execute(f"SELECT {SNAP_COLS} FROM snapshots WHERE id = ?", (sid,)).fetchone()
        return snap_row(row) if row else None

    def snapshot_and_key(self, sid: int) -> tuple[SnapRow, str | None] | None:
        """Snapshot ``sid`` and its identity's key (None: that row is gone) in one statement: a
        restore's ownership check without a second read (issue 31). A scalar subquery, not a LEFT
        JOIN: the same answer, and SQLite ran the join's statement 6x slower (30 against 5 us)."""
        row = self._c.execute(f"SELECT {_SNAP_COLS_S}, (SELECT key FROM identities WHERE id = s.identity_id) "
                              "FROM snapshots s WHERE s.id = ?", (sid,)).fetchone()
        return (snap_row(row[:N_SNAP]), None if row[N_SNAP] is None else str(row[N_SNAP])) if row else None

    def snapshots(self, identity_id: int | None = None) -> list[SnapRow]:
        if identity_id is None:
            cur = self._c.execute(f"SELECT {SNAP_COLS} FROM snapshots ORDER BY id")
        else:
            cur = self._c.execute(f"SELECT {SNAP_COLS} FROM snapshots WHERE identity_id = ? ORDER BY id",
                            (identity_id,))
        return [snap_row(r) for r in cur]

    def match_candidates(self, identity_key: str, namespace: str, keys: np.ndarray,
                         max_tokens: int, not_before: float
                         ) -> Iterator[tuple[int, int, bytes, Segment, bytes | None]]:
        """(id, n_tokens, prefix_key, own token segment, layout key) of committed matchable snapshots
        of the identity *key* whose find key (:mod:`snapstore.catalog.find_keys`) is ``keys[n_tokens // BLOCK]``,
        deepest first, read lazily (callers stop at a hit). ``keys``: a prompt's find keys, int64
        (:func:`snapstore.catalog.find_keys.find_keys`).

        The identity is resolved by key inside the statement, so a row id that has come to name
        another identity can never select its snapshots. ``keys[i]`` names the prefixes of
        ``BLOCK i … BLOCK (i + 1) - 1`` tokens, so batches taken from the end are in n_tokens order too:
        one indexed statement for the last ``_FIRST_BATCH`` keys, then one per ``_ANCHOR_BATCH``
        of the rest (two for prompts below 512K tokens), so a prompt of any length stays under
        SQLite's bound-variable limit. A row whose key equals the prompt's key at another block
        (a 64-bit collision) is not yielded there: it would break the deepest-first order. The own
        segment ``(blob, width, base_tokens, n_tokens)`` lets match() pass over a candidate whose
        last tokens differ (a sibling, a collision) without reading its chain; the layout key
        (:mod:`snapstore.plan.fit`) whether its parts restore into the caller's layout.
        """
        sql = ("SELECT id, n_tokens, prefix_key, find_key, tokens, token_width, base_tokens, layout_key FROM snapshots "
               "WHERE identity_id = "
               "(SELECT id FROM identities WHERE key = ?) AND namespace = ? AND find_key IN {keys} "
               "AND n_tokens <= ? AND " + TTL_FRESH_SQL.format(last_used="last_used", sid="snapshots.id") +
               " AND state = 1 AND matchable = 1 "
               "AND imported_from IS NULL")  # an import under an identity override is never matched (v11)
        hi = min(len(keys), max_tokens // BLOCK + 1) if max_tokens >= 0 else 0
        batch_size = _FIRST_BATCH
        while hi > 0:
            lo = max(0, hi - batch_size)
            batch_size = _ANCHOR_BATCH
            batch = np.ascontiguousarray(keys[lo:hi], dtype=np.int64)
            if _CARRAY is not None:  # the batch bound as one array: no statement text of 500 "?"s to bind
                marks, bound = "carray(?)", [_CARRAY(batch)]
            else:
                marks, bound = "(" + ",".join("?" * len(batch)) + ")", batch.tolist()
            rows: list[Any] = self._c.execute(
                sql.replace("{keys}", marks), (identity_key, namespace, *bound, max_tokens, not_before,
                                               time.time())).fetchall()
            # n_tokens DESC, id DESC, put here rather than by an ORDER BY: its temp B-tree copied every
            # row's blob once more, half of a hit's first statement (a sorter reads every row first too)
            rows.sort(key=lambda r: (r[1], r[0]), reverse=True)
            for sid, n, pkey, fk, blob, width, base, lkey in rows:
                b = int(n) // BLOCK
                if lo <= b < hi and fk == int(keys[b]):
                    yield (int(sid), int(n), bytes(pkey), (bytes(blob), int(width), int(base), int(n)),
                           None if lkey is None else bytes(lkey))
            hi = lo

    def same_content(self, identity_id: int, namespace: str, prefix_key: bytes,
                     content_key: bytes, imported_from: str | None = None) -> SnapRow | None:
        """A committed, matchable snapshot of equal tokens and content *and the same override mark*
        (``imported_from``; None: native): a native save or fetch is never deduplicated onto an
        import under an identity override, which match() never serves (issue 46 item 5)."""
        row = self._c.execute(
            f"SELECT {SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND prefix_key = ? "
            "AND content_key = ? AND state = 1 AND matchable = 1 AND imported_from IS ? LIMIT 1",
            (identity_id, namespace, prefix_key, content_key, imported_from)).fetchone()
        return snap_row(row) if row else None

    def same_link(self, identity_id: int, namespace: str, parent_id: int | None, prefix_key: bytes,
                  content_key: bytes) -> SnapRow | None:
        """A committed snapshot of equal tokens and content over ``parent_id``, superseded chain links
        included (an import reuses the links a chain already has: :mod:`snapstore.transfer.importer`)."""
        row = self._c.execute(
            f"SELECT {SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND prefix_key = ? "
            "AND content_key = ? AND state = 1 AND parent_id IS ? ORDER BY matchable DESC, id LIMIT 1",
            (identity_id, namespace, prefix_key, content_key, parent_id)).fetchone()
        return snap_row(row) if row else None

    def chain(self, sid: int) -> list[SnapRow]:
        """The snapshot and its ancestors, root first. Ordered here by level, not by an ORDER BY:
        SQLite's temp B-tree copied every row (token blobs too) once more for a dozen rows."""
        rows: list[Any] = self._c.execute(
            f"{_WALK} SELECT {_SNAP_COLS_S}, ch.lvl FROM ch CROSS JOIN snapshots s ON s.id = ch.x", (sid,)).fetchall()
        rows.sort(key=lambda r: r[N_SNAP], reverse=True)
        return [snap_row(r[:N_SNAP]) for r in rows]

    def chain_tokens(self, sid: int) -> list[Segment]:
        """The stored token segments ``(blob, width, base_tokens, n_tokens)`` of the snapshot's
        chain, root first (:meth:`chain_segments` in full, ordered by level)."""
        return [seg for _lvl, seg in sorted(self.chain_segments(sid), key=lambda r: -r[0])]

    def chain_segments(self, sid: int, start: int = 0) -> Iterator[tuple[int, Segment]]:
        """``(level, (blob, width, base_tokens, n_tokens))`` of the snapshot's chain from level
        ``start`` up (0 the snapshot, 1 its parent, ...), leaf first, read lazily, without reading
        whole rows (``chain``); match() walks the same chain with the compare done in SQL
        (:meth:`chain_links`).

        Lazily, because holding a chain's blobs at once costs more than reading them: 50 fresh
        10 KiB blobs alive together fault in fresh pages on every call (~4x the read, measured);
        streamed, each blob's memory is reused by the next. Leaf first: the walk's queue is read in
        FIFO order and CROSS JOIN keeps it the outer loop, so no ORDER BY sorts (copies) the blobs."""
        cur = self._c.execute(
            f"{_WALK} SELECT ch.lvl, s.tokens, s.token_width, s.base_tokens, s.n_tokens FROM ch CROSS JOIN "
            "snapshots s ON s.id = ch.x WHERE ch.lvl >= ?2", (sid, start))
        for lvl, b, w, base, n in cur:
            yield int(lvl), (bytes(b), int(w), int(base), int(n))

    def chain_links(self, sid: int, start: int, width: int, prompt: memoryview) -> Iterator[Link]:
        """The links of the snapshot's chain from level ``start`` up, leaf first, lazily (the walk
        of :meth:`chain_segments`), each compared inside SQLite: a link of ``width`` with
        ``prompt`` (the prompt encoded in that width) at its own offset, so its blob never becomes
        a Python object; a link of another width brings its blob for the caller to compare.

        Yields :data:`._tokens.Link` ``(level, width, base_tokens, n_tokens, blob bytes, same,
        blob)``: ``same`` is None where ``blob`` is given. (Measured: docs/benchmarks.md, "match()
        fifth pass".)"""
        cur = self._c.execute(
            f"{_WALK} SELECT ch.lvl, s.token_width, s.base_tokens, s.n_tokens, "
            "length(s.tokens), "
            "CASE WHEN s.token_width = ?3 THEN s.tokens = substr(?4, s.base_tokens * ?3 + 1, length(s.tokens)) END, "
            "CASE WHEN s.token_width = ?3 THEN NULL ELSE s.tokens END "
            "FROM ch CROSS JOIN snapshots s ON s.id = ch.x WHERE ch.lvl >= ?2", (sid, start, width, prompt))
        for lvl, w, base, n, nbytes, same, blob in cur:  # tokens is a BLOB NOT NULL of a STRICT table
            yield int(lvl), int(w), int(base), int(n), int(nbytes), None if same is None else bool(same), blob

    def chain_spells(self, sid: int, width: int, prompt: memoryview, narrow: int) -> bool:
        """The fast path of :meth:`chain_links` + :func:`._tokens.spells_chain`, in one aggregate
        statement: True when every ancestor link of ``sid`` has ``width``, a well-formed blob, ends
        where the link below it starts and equals ``prompt`` (the prompt in that width) at its offset,
        fits int32 where ``width`` is 4 (``narrow``: how many leading prompt tokens do), and the
        chain reaches token 0. False means "not shown here": the caller runs the exact streaming
        check, which also says why (a mismatch, another width, a malformed blob). No Python object
        per link: ~45% of the chain check (docs/benchmarks.md, "Issue 12, fifth session")."""
        row = self._c.execute(  # the same walk as the exact check's (_WALK), so the same links
            f"{_WALK} SELECT count(*), total(s.token_width = ?2 "
            "AND length(s.tokens) = ?2 * (s.n_tokens - s.base_tokens) "
            "AND s.n_tokens = ch.want AND s.base_tokens <= s.n_tokens "
            "AND (?2 = 8 OR s.n_tokens <= ?4 OR s.n_tokens <= s.base_tokens) "
            "AND s.tokens = substr(?3, s.base_tokens * ?2 + 1, length(s.tokens))), min(s.base_tokens) "
            "FROM ch JOIN snapshots s ON s.id = ch.x WHERE ch.lvl >= 1", (sid, width, prompt, narrow)).fetchone()
        links, good, low = row if row is not None else (0, 0, None)  # an aggregate always has its one row
        return bool(links) and int(good) == int(links) and low == 0

    def insert_snapshot(self, **v: Any) -> int:
        """Insert one snapshot row; ``find_key`` as given (a save's, from its tokens), else derived here."""
        if v.get("find_key") is None:
            v["find_key"] = self.derive_find_key(v["parent_id"], v["base_tokens"], v["n_tokens"],
                                                 v["token_width"], v["tokens"])
        v.setdefault("layout_key", None)  # schema v9: the saver names its parts' layout (plan.fit)
        v.setdefault("imported_from", None)  # schema v11: set by an import under an identity override
        self._c.execute(
            "INSERT INTO snapshots(identity_id, namespace, parent_id, depth, n_tokens, base_tokens, "
            "token_width, tokens, anchor, prefix_key, content_key, session, state, owner, matchable, "
            "created, last_used, hits, logical_bytes, find_key, layout_key, imported_from) VALUES (:identity_id, "
            ":namespace, :parent_id, :depth, :n_tokens, :base_tokens, :token_width, :tokens, :anchor, :prefix_key, "
            ":content_key, :session, :state, :owner, 1, :now, :now, 0, :logical_bytes, :find_key, :layout_key, "
            ":imported_from)", v)
        return int(self._c.last_insert_rowid())

    # -- find keys (schema v8, see catalog/find_keys.py) --------------------------------------------
    def derive_find_key(self, parent_id: int | None, base: int, n: int, width: int, blob: bytes) -> int:
        """The find key of a snapshot of ``n`` tokens whose own segment ``blob`` holds tokens
        ``[base, n)`` over parent ``parent_id``: the parent's key extended by the blocks the
        segment completes (the parent's last partial block is read from the chain above)."""
        own = decode_tokens(blob, width, n - base)
        if parent_id is None:
            return extend(FIND_SEED, own)
        start = base // BLOCK * BLOCK
        head, key = self._tokens_from(parent_id, start, base)
        if key is None:  # a parent without a key (written by an older snapstore since): from the root
            head, _ = self._tokens_from(parent_id, 0, base)
            key = FIND_SEED
        return extend(key, np.concatenate([head, own]) if len(head) else own)

    def _tokens_from(self, sid: int, start: int, end: int) -> tuple[np.ndarray, int | None]:
        """Tokens ``[start, end)`` of the chain ending at ``sid`` (``end`` its n_tokens), read one
        link at a time upwards until ``start`` is covered, and ``sid``'s own find key."""
        segs: list[np.ndarray] = []
        key: int | None = None
        at: int | None = sid
        for hop in range(100_001):
            row = self._c.execute("SELECT parent_id, base_tokens, n_tokens, token_width, tokens, find_key "
                                  "FROM snapshots WHERE id = ?", (at,)).fetchone() if at is not None else None
            if row is None or int(row[2]) != end:
                raise CorruptionError(f"the token chain above snapshot {sid} is broken at {at}; "
                                      "run `snapstore verify`")
            pid, base, _n, w, blob, fk = row
            if hop == 0:
                key = None if fk is None else int(fk)
            seg = decode_tokens(blob, int(w), end - int(base))
            segs.append(seg[max(0, start - int(base)):])
            if int(base) <= start:
                break
            at, end = pid, int(base)
        else:
            raise CorruptionError(f"the chain above snapshot {sid} does not end; run `snapstore verify`")
        segs.reverse()
        return (np.concatenate(segs) if len(segs) > 1 else segs[0]), key

    def has_unkeyed(self) -> bool:
        """Is there a snapshot without a find key (index snapshots_unkeyed: no scan)?"""
        return self._c.execute("SELECT 1 FROM snapshots WHERE find_key IS NULL LIMIT 1").fetchone() is not None

    def backfill_find_keys(self) -> int:
        """Key every snapshot that has no find key yet (migration 0008), parents first; how many."""
        todo = [int(r[0]) for r in self._c.execute(
            "SELECT id FROM snapshots WHERE find_key IS NULL ORDER BY depth, id")]
        for sid in todo:
            row: Any = self._c.execute("SELECT parent_id, base_tokens, n_tokens, token_width, tokens FROM snapshots "
                                       "WHERE id = ?", (sid,)).fetchone()
            key = self.derive_find_key(None if row[0] is None else int(row[0]), int(row[1]), int(row[2]),
                                       int(row[3]), row[4])
            self._c.execute("UPDATE snapshots SET find_key = ? WHERE id = ?", (key, sid))
        return len(todo)

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

    def mark_shared(self, sid: int) -> None:
        """Record that ``sid`` was used outside its own session (a snapshot gone meanwhile: no-op)."""
        self._c.execute("UPDATE snapshots SET shared = 1 WHERE id = ? AND session IS NOT NULL", (sid,))

    def detach_from_session(self, sid: int) -> None:
        """Take ``sid`` out of its session: an ordinary snapshot from now on, never superseded."""
        self._c.execute("UPDATE snapshots SET session = NULL WHERE id = ?", (sid,))

    def children_outside(self, sid: int, session: str | None) -> list[int]:
        """The children of ``sid`` whose session is not ``session`` (NULL counts as another one)."""
        return [int(r[0]) for r in self._c.execute(
            "SELECT id FROM snapshots WHERE parent_id = ? AND session IS NOT ?", (sid, session))]

    def session_prefixes(self, identity_id: int, namespace: str, session: str,
                         up_to_tokens: int, exclude: int) -> list[SnapRow]:
        """Committed matchable snapshots of the session with at most ``up_to_tokens`` tokens, but ``exclude``."""
        return [snap_row(r) for r in self._c.execute(
            f"SELECT {SNAP_COLS} FROM snapshots WHERE identity_id = ? AND namespace = ? AND session = ? "
            "AND state = 1 AND matchable = 1 AND n_tokens <= ? AND id != ?",
            (identity_id, namespace, session, up_to_tokens, exclude))]

    def lru_leaves(self, exclude: Iterable[int], limit: int = 64) -> list[SnapRow]:
        """Committed snapshots without children and without a name, least recently used first."""
        ex = list(exclude)
        not_in = f"AND id NOT IN ({','.join('?' * len(ex))})" if ex else ""
        return [snap_row(r) for r in self._c.execute(
            f"SELECT {SNAP_COLS} FROM snapshots s WHERE state = 1 {not_in} AND NOT EXISTS "
            f"(SELECT 1 FROM snapshots k WHERE k.parent_id = s.id) "
            f"AND NOT EXISTS (SELECT 1 FROM names n WHERE n.snapshot_id = s.id) ORDER BY last_used, id LIMIT ?",
            (*ex, limit))]

    def expired(self, before: float) -> list[SnapRow]:
        """Committed snapshots the TTL no longer serves (:data:`TTL_FRESH_SQL`: no live name), deepest first."""
        return [snap_row(r) for r in self._c.execute(
            f"SELECT {SNAP_COLS} FROM snapshots s WHERE state = 1 AND NOT "
            f"{TTL_FRESH_SQL.format(last_used='last_used', sid='s.id')} ORDER BY depth DESC", (before, time.time()))]

    def pending(self) -> list[SnapRow]:
        return [snap_row(r) for r in self._c.execute(f"SELECT {SNAP_COLS} FROM snapshots WHERE state = 0")]

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

    # -- checks of the catalog file (verify) --------------------------------------------------
    def integrity_check(self) -> list[str]:
        return [str(r[0]) for r in self._c.execute("PRAGMA integrity_check") if r[0] != "ok"]

    def foreign_key_check(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._c.execute("PRAGMA foreign_key_check")]
