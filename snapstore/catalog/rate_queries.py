"""The catalog queries of restore rates (:mod:`snapstore.restore.rates`): the per-tier sums a store
keeps of its measured restores, in the ``restore_rates`` table of migration 0012, and the cold-read
path it measured per storage (:mod:`snapstore.restore.read_path`), in ``read_paths`` (migration 0014).

:class:`RateQueries` is the part of :class:`snapstore.catalog.queries.Txn` that touches those tables.
"""

from __future__ import annotations

from typing import NamedTuple

import apsw

__all__ = ["RateQueries", "RateRow", "ReadPathRow"]


class RateRow(NamedTuple):
    """One tier's decayed sums (see migrations/0011_restore_rates.sql)."""

    tier: str
    w: float
    su: float
    sv: float
    suu: float
    suv: float
    samples: int
    updated: float


class ReadPathRow(NamedTuple):
    """The cold-read method measured on one storage (see migrations/0014_read_paths.sql)."""

    storage: str
    method: str
    threads: int
    piece: int
    figures: str
    reason: str
    cold_rate: float
    measured: float


class RateQueries:
    """Queries on ``restore_rates``, over one transaction's connection."""

    __slots__ = ()
    _c: apsw.Connection

    def restore_rates(self) -> list[RateRow]:
        """Every tier's row (none before the first restore was measured)."""
        return [RateRow(str(r[0]), float(r[1]), float(r[2]), float(r[3]), float(r[4]), float(r[5]), int(r[6]),
                        float(r[7]))
                for r in self._c.execute("SELECT tier, w, su, sv, suu, suv, samples, updated FROM restore_rates")]

    def set_restore_rate(self, row: RateRow) -> None:
        """Write (or replace) one tier's row."""
        self._c.execute("INSERT INTO restore_rates(tier, w, su, sv, suu, suv, samples, updated) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(tier) DO UPDATE SET w = excluded.w, "
                        "su = excluded.su, sv = excluded.sv, suu = excluded.suu, suv = excluded.suv, "
                        "samples = excluded.samples, updated = excluded.updated", tuple(row))

    def read_paths(self) -> list[ReadPathRow]:
        """Every storage's measured read path (none in a catalog older than schema 14, read-only)."""
        found = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'read_paths'"
        if self._c.execute(found).fetchone() is None:
            return []  # a read-only open of an older catalog (it is not migrated): nothing measured yet
        return [ReadPathRow(str(r[0]), str(r[1]), int(r[2]), int(r[3]), str(r[4]), str(r[5]), float(r[6]),
                            float(r[7]))
                for r in self._c.execute("SELECT storage, method, threads, piece, figures, reason, cold_rate, "
                                         "measured FROM read_paths")]

    def set_read_path(self, row: ReadPathRow) -> None:
        """Write (or replace) one storage's read path."""
        self._c.execute("INSERT INTO read_paths(storage, method, threads, piece, figures, reason, cold_rate, "
                        "measured) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(storage) DO UPDATE SET "
                        "method = excluded.method, threads = excluded.threads, piece = excluded.piece, "
                        "figures = excluded.figures, reason = excluded.reason, cold_rate = excluded.cold_rate, "
                        "measured = excluded.measured", tuple(row))
