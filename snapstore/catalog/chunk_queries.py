"""The catalog queries on parts, chunks and their references, quarantine, and the counters and
totals they keep (SQL lives here, in the other ``_catalog*`` modules, catalog/db.py and migrations/ only).

:class:`ChunkQueries` is the half of :class:`snapstore.catalog.queries.Txn` that touches ``parts``,
``part_chunks``, ``chunks`` and ``counters``. A chunk row whose last reference goes is recorded in
``freed`` (:meth:`ChunkQueries.free`): its file is unlinked after the commit, never inside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import apsw

from snapstore.catalog.rows import CHUNK_COLS, ChunkRow, PartKind, PartRow, chunk_row, part_row, scalar

__all__ = ["QUARANTINED_USERS_SQL", "ChunkQueries"]

# Snapshots using a quarantined chunk. CROSS JOIN fixes the join order: from the partial index of
# quarantined chunks (usually empty) to their users. Left to itself the planner scanned every
# part_chunks row (4 ms at 1,000 snapshots, on every match that found a candidate).
QUARANTINED_USERS_SQL = (
    "SELECT DISTINCT pc.snapshot_id, p.kind FROM chunks q CROSS JOIN part_chunks pc ON pc.chunk_id = q.id "
    "JOIN parts p ON p.snapshot_id = pc.snapshot_id AND p.name = pc.name WHERE q.quarantined IS NOT NULL")


class ChunkQueries:
    """Queries on parts, chunks, quarantine and counters, over one transaction's connection."""

    __slots__ = ()
    _c: apsw.Connection
    freed: list[bytes]

    def free(self, cid: bytes) -> None:
        """Record a chunk whose row this transaction removed: its file goes after the commit."""
        self.freed.append(cid)

    # -- parts and their chunk references -------------------------------------------------------
    def insert_part(self, sid: int, name: str, kind: int, dtype: str, shape: Sequence[int],
                    component: str | None, row_start: int, row_end: int, nbytes: int,
                    chunk_ids: Sequence[bytes], tokens_per_row: int | None = None) -> None:
        """One part of ``sid`` and its chunk references; ``tokens_per_row``: a row segment's granularity."""
        self._c.execute("INSERT INTO parts(snapshot_id, name, kind, dtype, shape, component, row_start, row_end, "
                  "nbytes, tokens_per_row) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (sid, name, kind, dtype, json.dumps(list(shape)), component, row_start, row_end, nbytes,
                   tokens_per_row))
        self._c.executemany("INSERT INTO part_chunks(snapshot_id, name, seq, chunk_id) VALUES (?, ?, ?, ?)",
                      [(sid, name, i, cid) for i, cid in enumerate(chunk_ids)])
        for cid in chunk_ids:
            self._c.execute("UPDATE chunks SET refs = refs + 1 WHERE id = ?", (cid,))

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

    def parts(self, sid: int) -> list[PartRow]:
        return [part_row(r) for r in self._c.execute(
            "SELECT snapshot_id, name, kind, dtype, shape, component, row_start, row_end, nbytes, tokens_per_row "
            "FROM parts WHERE snapshot_id = ? ORDER BY name", (sid,))]

    def part_chunks(self, sid: int, name: str) -> list[ChunkRow | None]:
        """The chunks of one part in order; None where a referenced chunk row is missing."""
        out: list[ChunkRow | None] = []
        for r in self._c.execute(
                "SELECT pc.chunk_id, c.raw_len, c.stored_len, c.codec, c.checksum, c.refs, c.created, c.scope, "
                "c.quarantined FROM part_chunks pc LEFT JOIN chunks c ON c.id = pc.chunk_id "
                "WHERE pc.snapshot_id = ? AND pc.name = ? ORDER BY pc.seq", (sid, name)):
            out.append(None if r[1] is None else chunk_row(r))
        return out

    def chain_parts(self, ids: Sequence[int]) -> list[tuple[PartRow, list[ChunkRow | None]]]:
        """Every part of the snapshots ``ids`` with its chunks in order (None where a referenced chunk
        row is missing), in one statement: a restore plan's catalog reads for a whole chain (issue 31:
        two statements per link and part cost more than a small restore's bytes)."""
        out: list[tuple[PartRow, list[ChunkRow | None]]] = []
        key: tuple[int, str] | None = None
        rows: list[Any] = self._c.execute(
            "SELECT p.snapshot_id, p.name, p.kind, p.dtype, p.shape, p.component, p.row_start, p.row_end, "
            "p.nbytes, p.tokens_per_row, pc.chunk_id, c.raw_len, c.stored_len, c.codec, c.checksum, c.refs, "
            "c.created, c.scope, c.quarantined, pc.seq FROM json_each(?) j "
            "JOIN parts p ON p.snapshot_id = j.value "
            "LEFT JOIN part_chunks pc ON pc.snapshot_id = p.snapshot_id AND pc.name = p.name "
            "LEFT JOIN chunks c ON c.id = pc.chunk_id", (json.dumps([int(i) for i in ids]),)).fetchall()
        # ordered here, not by an ORDER BY (its temp B-tree copies every row once more); a part
        # without chunks has a NULL seq, alone in its group
        rows.sort(key=lambda r: (r[0], r[1], -1 if r[19] is None else r[19]))
        for r in rows:
            if (r[0], r[1]) != key:
                key = (r[0], r[1])
                out.append((part_row(r[:10]), []))
            if r[10] is not None:  # a part without chunks (0 bytes) has one row of NULLs here
                out[-1][1].append(None if r[11] is None else chunk_row(r[10:19]))
        return out

    def catalog_gen(self) -> tuple[bytes, int] | None:
        """The catalog's (nonce, generation) (schema 13): what kept plan reads are checked against
        (catalog/chain_cache.py); None when its row is gone (nothing can be kept then)."""
        row = self._c.execute("SELECT nonce, gen FROM catalog_gen WHERE id = 1").fetchone()
        return (bytes(row[0]), int(row[1])) if row else None

    def recently_used(self, identity_key: str, limit: int) -> list[tuple[int, str]]:
        """(id, namespace) of the identity's committed, matchable snapshots, the most recently used
        first: what ``warm_up`` plans into the memo (store/warm.py)."""
        return [(int(i), str(ns)) for i, ns in self._c.execute(
            "SELECT id, namespace FROM snapshots WHERE identity_id = (SELECT id FROM identities WHERE key = ?) "
            "AND state = 1 AND matchable = 1 ORDER BY last_used DESC, id DESC LIMIT ?", (identity_key, limit))]

    # -- chunks and quarantine ------------------------------------------------------------------
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
        r = self._c.execute(f"SELECT {CHUNK_COLS} FROM chunks WHERE id = ?", (cid,)).fetchone()
        return chunk_row(r) if r else None

    def all_chunks(self) -> Iterator[ChunkRow]:
        for r in self._c.execute(f"SELECT {CHUNK_COLS} FROM chunks"):
            yield chunk_row(r)

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
        for sid, kind in self._c.execute(QUARANTINED_USERS_SQL):
            out[int(sid)] = out.get(int(sid), False) or int(kind) == 1
        return out

    def chunk_users(self, cid: bytes) -> list[int]:
        return [int(r[0]) for r in self._c.execute(
            "SELECT DISTINCT snapshot_id FROM part_chunks WHERE chunk_id = ?", (cid,))]

    def refcount_mismatches(self) -> list[tuple[bytes, int, int]]:
        return [(bytes(r[0]), int(r[1]), int(r[2])) for r in self._c.execute(
            "SELECT c.id, c.refs, (SELECT count(*) FROM part_chunks pc WHERE pc.chunk_id = c.id) AS n "
            "FROM chunks c WHERE c.refs != n")]

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

    # -- accounting and counters ----------------------------------------------------------------
    def add_counter(self, name: str, delta: int) -> None:
        self._c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, delta))

    def set_counter(self, name: str, value: int) -> None:
        self._c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = excluded.value", (name, value))

    def counters(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self._c.execute("SELECT name, value FROM counters")}

    def stored_bytes(self) -> int:
        row = self._c.execute("SELECT value FROM counters WHERE name = 'stored_bytes'").fetchone()
        return int(row[0]) if row else 0

    def entry_count(self) -> int:
        return scalar(self._c, "SELECT count(*) FROM snapshots WHERE state = 1 AND matchable = 1")

    def totals(self) -> tuple[int, int, int, int]:
        """(stored bytes, logical bytes, committed matchable entries, all snapshots) from the tables."""
        stored = scalar(self._c, "SELECT coalesce(sum(stored_len), 0) FROM chunks")
        row = self._c.execute(
            "SELECT coalesce(sum(CASE WHEN matchable = 1 THEN logical_bytes ELSE 0 END), 0), "
            "coalesce(sum(state = 1 AND matchable = 1), 0), count(*) FROM snapshots").fetchone()
        assert row is not None
        return stored, int(row[0]), int(row[1]), int(row[2])

    def census(self) -> tuple[int, int, int]:
        """(pending snapshots, chunks, raw bytes referenced counting every reference: for dedup ratio)."""
        return (scalar(self._c, "SELECT count(*) FROM snapshots WHERE state = 0"),
                scalar(self._c, "SELECT count(*) FROM chunks"),
                scalar(self._c, "SELECT coalesce(sum(c.raw_len), 0) FROM part_chunks pc "
                     "JOIN chunks c ON c.id = pc.chunk_id"))

    def quarantined_count(self) -> int:
        """Chunks quarantined now (damaged, awaiting a save of the correct bytes or a repair)."""
        return scalar(self._c, "SELECT count(*) FROM chunks WHERE quarantined IS NOT NULL")
