"""The catalog queries of write admission (:mod:`snapstore.lifecycle.admission`): first sightings
of prefixes (``admit="second_hit"``) and the shared write bucket (``Budget.write_bytes_per_hour``).

:class:`AdmissionQueries` is the part of :class:`snapstore.catalog.queries.Txn` that touches the
``sightings`` and ``write_bucket`` tables of migration 0010.
"""

from __future__ import annotations

import apsw

__all__ = ["AdmissionQueries"]


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
