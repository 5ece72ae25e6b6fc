"""The catalog queries of write admission (:mod:`snapstore.lifecycle.admission`): first sightings
of prefixes (``admit="second_hit"``) and the shared write bucket (``Budget.write_bytes_per_hour``);
and of named snapshots (:mod:`snapstore.lifecycle.naming`).

:class:`AdmissionQueries` is the part of :class:`snapstore.catalog.queries.Txn` that touches the
``sightings``, ``write_bucket`` and ``names`` tables of migration 0010.
"""

from __future__ import annotations

import time

import apsw

__all__ = ["LIVE_NAME_SQL", "TTL_FRESH_SQL", "AdmissionQueries"]

# The TTL's one exemption (docs/api.md "Named snapshots", issue 46 item 8): a snapshot a live name
# pins, or one in the chain of such a snapshot (kept because it has a child, and holding the named
# snapshot's own leading rows: a block-granular prefix of the named snapshot is served through it),
# is never expired by the store's TTL, in any query (match, lookup, expiry, gc). ``{sid}``: the column
# holding the snapshot's id; binds one parameter, now (a name whose ttl ran out pins nothing). The
# walk goes up from the live names, never down a subtree, in an uncorrelated IN subquery: SQLite
# builds that set once per statement, however many rows it tests.
LIVE_NAME_SQL = ("{sid} IN (WITH RECURSIVE kept(x) AS (SELECT snapshot_id FROM names "
                 "WHERE expires IS NULL OR expires > ? UNION SELECT p.parent_id FROM snapshots p "
                 "JOIN kept ON p.id = kept.x WHERE p.parent_id IS NOT NULL) SELECT x FROM kept)")
# A snapshot the TTL still serves: used at or after the cutoff, or named. Binds (cutoff, now); with no
# TTL the cutoff is 0 and the first test decides (the name is not looked up).
TTL_FRESH_SQL = "({last_used} >= ? OR " + LIVE_NAME_SQL + ")"


class AdmissionQueries:
    """Queries on ``sightings`` and ``write_bucket``, over one transaction's connection."""

    __slots__ = ()
    _c: apsw.Connection

    # -- sightings ------------------------------------------------------------------------------
    def sighting(self, key: int, not_before: float) -> bool:
        """Whether prefix ``key`` was seen at or after ``not_before`` (an older row does not count)."""
        row = self._c.execute("SELECT seen_at FROM sightings WHERE key = ?", (key,)).fetchone()
        return row is not None and float(row[0]) >= not_before

    def record_sighting(self, key: int, now: float) -> None:
        """Remember (or refresh) the first sighting of prefix ``key``."""
        self._c.execute("INSERT INTO sightings(key, seen_at) VALUES (?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET seen_at = excluded.seen_at", (key, now))

    def forget_sighting(self, key: int) -> None:
        self._c.execute("DELETE FROM sightings WHERE key = ?", (key,))

    def prune_sightings(self, not_before: float, keep: int) -> int:
        """Drop sightings older than ``not_before``, then the oldest beyond ``keep``; how many went."""
        self._c.execute("DELETE FROM sightings WHERE seen_at < ?", (not_before,))
        gone = self._c.changes()
        self._c.execute("DELETE FROM sightings WHERE key IN (SELECT key FROM sightings ORDER BY seen_at "
                        "LIMIT max(0, (SELECT count(*) FROM sightings) - ?))", (keep,))
        return int(gone + self._c.changes())

    def sighting_count(self) -> int:
        row = self._c.execute("SELECT count(*) FROM sightings").fetchone()
        return int(row[0]) if row else 0

    # -- the write bucket -----------------------------------------------------------------------
    def write_bucket(self) -> tuple[float, float] | None:
        """The shared bucket's (level, at), or None before any process set it."""
        row = self._c.execute("SELECT level, at FROM write_bucket WHERE id = 1").fetchone()
        return (float(row[0]), float(row[1])) if row else None

    def set_write_bucket(self, level: float, at: float) -> None:
        self._c.execute("INSERT INTO write_bucket(id, level, at) VALUES (1, ?, ?) "
                        "ON CONFLICT(id) DO UPDATE SET level = excluded.level, at = excluded.at", (level, at))

    # -- names ----------------------------------------------------------------------------------
    def set_name(self, identity_id: int, namespace: str, name: str, sid: int, now: float,
                 expires: float | None) -> None:
        """Name snapshot ``sid`` (a name already in use moves to it)."""
        self._c.execute("INSERT INTO names(identity_id, namespace, name, snapshot_id, created, expires) "
                        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(identity_id, namespace, name) DO UPDATE SET "
                        "snapshot_id = excluded.snapshot_id, created = excluded.created, expires = excluded.expires",
                        (identity_id, namespace, name, sid, now, expires))

    def name_target(self, identity_id: int, namespace: str, name: str, now: float) -> int | None:
        """The snapshot a live (unexpired) name points at, or None."""
        row = self._c.execute("SELECT snapshot_id FROM names WHERE identity_id = ? AND namespace = ? AND name = ? "
                              "AND (expires IS NULL OR expires > ?)", (identity_id, namespace, name, now)).fetchone()
        return int(row[0]) if row else None

    def drop_name(self, identity_id: int, namespace: str, name: str) -> bool:
        self._c.execute("DELETE FROM names WHERE identity_id = ? AND namespace = ? AND name = ?",
                        (identity_id, namespace, name))
        return bool(self._c.changes())

    def drop_expired_names(self, now: float) -> int:
        """Remove every name whose ttl ran out (it no longer protects its snapshot)."""
        self._c.execute("DELETE FROM names WHERE expires IS NOT NULL AND expires <= ?", (now,))
        return int(self._c.changes())

    def is_named(self, sid: int) -> bool:
        return self._c.execute("SELECT 1 FROM names WHERE snapshot_id = ?", (sid,)).fetchone() is not None

    def ttl_fresh(self, sid: int, last_used: float, not_before: float) -> bool:
        """Whether the store's TTL still serves snapshot ``sid`` (last used at ``last_used``): used at
        or after ``not_before``, or pinned by a live name (:data:`TTL_FRESH_SQL`, the same rule in SQL)."""
        if last_used >= not_before:
            return True
        sql = "SELECT " + LIVE_NAME_SQL.format(sid="?")
        row = self._c.execute(sql, (sid, time.time())).fetchone()
        return bool(row and row[0])

    def all_names(self) -> list[tuple[int, str, str, int, float, float | None]]:
        """Every name: (identity id, namespace, name, snapshot id, created, expires), by identity and name
        (none in a catalog older than schema 10, read without migrating)."""
        if self._c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'names'").fetchone() is None:
            return []
        return [(int(r[0]), str(r[1]), str(r[2]), int(r[3]), float(r[4]), None if r[5] is None else float(r[5]))
                for r in self._c.execute("SELECT identity_id, namespace, name, snapshot_id, created, expires "
                                         "FROM names ORDER BY identity_id, namespace, name")]
