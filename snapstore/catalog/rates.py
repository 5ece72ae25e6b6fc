"""The catalog queries of restore rates (:mod:`snapstore.restore.rates`): the per-tier sums a store
keeps of its measured restores, in the ``restore_rates`` table of migration 0011.

:class:`RateQueries` is the part of :class:`snapstore.catalog.queries.Txn` that touches that table.
"""

from __future__ import annotations

from typing import NamedTuple

import apsw

__all__ = ["RateQueries", "RateRow"]


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
