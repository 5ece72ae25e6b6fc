"""Queries on ``row_prefixes``, the block-granular prefix index (schema 5, :mod:`snapstore.plan.prefix`):
the part of :class:`snapstore.catalog.queries.Txn` that touches that table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apsw

__all__ = ["ROW_PREFIX_HOLDERS_SQL", "PrefixQueries"]

# The holders of block-prefix keys (``{keys}``: one "?" per key), longest prefix first, then most
# recently used. The CROSS JOIN keeps the key index as the outer loop: left to itself the planner
# walked every snapshot of the identity and probed the key for each (95 us a probe at 72
# snapshots, growing with the store; a lookup makes up to a dozen), where a key names only the
# snapshots that share that prefix (27 us).
ROW_PREFIX_HOLDERS_SQL = (
    "SELECT r.n_tokens, r.key, s.id FROM row_prefixes r CROSS JOIN snapshots s ON s.id = r.snapshot_id "
    "WHERE r.key IN ({keys}) AND s.identity_id = (SELECT id FROM identities WHERE key = ?) "
    "AND s.namespace = ? AND s.state = 1 AND s.imported_from IS NULL "
    "ORDER BY r.n_tokens DESC, s.last_used DESC, s.id DESC")


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
        rows: list[Any] = self._c.execute(sql, (*want, identity_key, namespace)).fetchall()
        for n, key, sid in rows:
            held = out.setdefault(int(n), [])
            if want.get(key) == n and len(held) < limit:  # the key at its own length only
                held.append(int(sid))
        return {n: ids for n, ids in out.items() if ids}
