"""The Store's reports and maintenance calls: its snapshots, stats, verify and gc (a base of
:class:`snapstore.Store`, which supplies the attributes declared here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from snapstore._config import Budget
from snapstore._identity import Identity
from snapstore._numbers import real
from snapstore._results import SnapshotInfo, Stats
from snapstore.catalog.queries import Txn
from snapstore.check.inspect import snapshot_infos, stats_of
from snapstore.check.verify import VerifyReport
from snapstore.chunks.repo import Repo
from snapstore.lifecycle.gc import GcReport
from snapstore.restore.ramtier import RamTier
from snapstore.restore.rates import RestoreRates
from snapstore.store.gate import CallGate, operation
from snapstore.tiers.stack import Tiers

__all__ = ["StoreReports"]

T = TypeVar("T")


class StoreReports:
    """snapshots(), stats(), verify(), gc(): reads of the whole store and its collection."""

    _repo: Repo
    _gate: CallGate
    _tiers: Tiers
    _rates: RestoreRates
    identity: Identity
    budget: Budget
    pending_lease: float

    def _write(self, fn: Callable[[Txn], T], *, durable: bool = True) -> T:
        raise NotImplementedError  # the Store's write transaction (bookkeeping included)

    @property
    def _ram(self) -> RamTier | None:
        """The RAM tier, or None without ``ram_bytes`` (as the restore passes it on, and tests drain it)."""
        return self._tiers.ram

    @operation
    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot of this store's identity (all namespaces), oldest first."""
        return self._repo.db.read(lambda t: snapshot_infos(t, self.identity.key))

    @operation
    def stats(self) -> Stats:
        """Counters and totals (see docs/api.md)."""
        if not self._repo.readonly:  # a read-only store keeps this session's counters in memory only
            self._write(lambda t: None, durable=False)
        st = self._repo.db.read(lambda t: stats_of(t, self.budget.disk_bytes or 0, self._ram.used if self._ram else 0))
        # this process's restore rates are newer than the catalog's (written at most every 30 s, and at close)
        st = dataclasses.replace(st, restore_rates={**st.restore_rates, **self._rates.rates()})
        uploads = self._tiers.shared.uploads()  # the shared tier's live upload queue, next to its counters
        if uploads:
            st = dataclasses.replace(st, remote={**st.remote, **uploads})
        return st

    @operation
    def verify(self, deep: bool = True) -> VerifyReport:
        """Check the store (see snapstore verify); returns a VerifyReport."""
        from snapstore.check.verify import verify
        report = verify(self._repo, deep=deep, pending_lease=self.pending_lease)
        if self._tiers.ram is not None:
            self._tiers.ram.delete(report.damaged_chunks)
        return report

    @operation
    def gc(self, *, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
        """Collect orphan and temp files, dead pending captures, expired snapshots, over-budget leaves."""
        from snapstore.lifecycle.gc import gc
        grace = real(grace, "grace", minimum=0.0, unit="seconds")
        if not dry_run:
            self._repo.refuse_write("collect garbage (gc(dry_run=True) says what a collection would remove)")
        return gc(self._repo, budget=self.budget, grace=grace, dry_run=dry_run, pending_lease=self.pending_lease)
