"""Queries on ``row_prefixes``, the block-granular prefix index (schema 5, :mod:`snapstore.plan.prefix`):
the part of :class:`snapstore.catalog.queries.Txn` that touches that table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apsw

__all__ = ["ROW_PREFIX_HELD_SQL", "ROW_PREFIX_HOLDERS_SQL", "PrefixQueries"]

# The holders of block-prefix keys (``{keys}``: one "?" per key), longest prefix first, then most
# recently used, at most ``?`` (the last parameter) per prefix length: the window keeps a prefix
# that ten thousand conversations share from sending all of them to Python. The CROSS JOIN keeps
# the key index as the outer loop: left to itself the planner walked every snapshot of the
# identity and probed the key for each (95 us a probe at 72 snapshots, growing with the store),
# where a key names only the snapshots that share that prefix (27 us).
ROW_PREFIX_HOLDERS_SQL = (
    "SELECT n_tokens, key, id FROM (SELECT r.n_tokens, r.key, s.id, s.last_used, row_number() OVER "
    "(PARTITION BY r.n_tokens ORDER BY s.last_used DESC, s.id DESC) AS rank "
    "FROM row_prefixes r CROSS JOIN snapshots s ON s.id = r.snapshot_id WHERE r.key IN ({keys}) "
    "AND s.identity_id = (SELECT id FROM identities WHERE key = ?) AND s.namespace = ? AND s.state = 1 "
    "AND s.imported_from IS NULL) WHERE rank <= ? ORDER BY n_tokens DESC, last_used DESC, id DESC")
# Whether any snapshot holds one prefix (the binary search's probe): the first row ends it.
ROW_PREFIX_HELD_SQL = (
    "SELECT 1 FROM row_prefixes r CROSS JOIN snapshots s ON s.id = r.snapshot_id WHERE r.key = ? "
    "AND r.n_tokens = ? AND s.identity_id = (SELECT id FROM identities WHERE key = ?) AND s.namespace = ? "
    "AND s.state = 1 AND s.imported_from IS NULL LIMIT 1")


class PrefixQueries:
    """Queries on ``row_prefixes``, over one transaction's connection."""

    __slots__ = ()
    _c: apsw.Connection

    def insert_row_prefixes(self, sid: int, keys: Sequence[tuple[int, bytes]]) -> None:
        """Index ``sid`` under each (n_tokens, key) prefix it adds."""
        self._c.executemany("INSERT OR IGNORE INTO row_prefixes(snapshot_id, n_tokens, key) VALUES (?, ?, ?)",
                            [(sid, n, k) for n, k in keys])

    def row_prefix_holders(self, identity_key: str, namespace: str, keys: Sequence[tuple[bytes, int]],
                           limit: int) -> dict[int, list[int]]:
        """Per prefix length: committed snapshots of the identity *key* and namespace whose tokens
        start with the prefix a ``(key, n_tokens)`` of ``keys`` names, most recently used first, at
        most ``limit`` each; one statement for them all."""
        want = dict(keys)
        out: dict[int, list[int]] = {}
        if not want:
            return out
        sql = ROW_PREFIX_HOLDERS_SQL.format(keys=",".join("?" * len(want)))
        rows: list[Any] = self._c.execute(sql, (*want, identity_key, namespace, limit)).fetchall()
        for n, key, sid in rows:
            if want.get(key) == n:  # the key at its own length only
                out.setdefault(int(n), []).append(int(sid))
        return out

    def row_prefix_held(self, identity_key: str, namespace: str, key: bytes, n_tokens: int) -> bool:
        """Whether a committed snapshot of the identity *key* and namespace holds the prefix ``key``
        names (``n_tokens`` long): the binary search's probe, one index row at most."""
        rows: list[Any] = self._c.execute(ROW_PREFIX_HELD_SQL, (key, n_tokens, identity_key, namespace)).fetchall()
        return bool(rows)
