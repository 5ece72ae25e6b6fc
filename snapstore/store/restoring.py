"""``Store.restore`` and ``Store.describe``: plan a snapshot once, then stream it (restore/read.py),
or replay a restore repeated into the same arrays from the plan kept for it (restore/hot.py,
issue 48). A base of :class:`snapstore.Store`, which supplies the attributes declared here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import cast

from snapstore._config import Budget
from snapstore._errors import RestoreError
from snapstore._layout import Layout
from snapstore._refs import SnapshotRef, ref_namespace, resolve_ref, session_key
from snapstore._results import MatchDetails, RestoreResult
from snapstore.catalog.queries import Txn
from snapstore.chunks.repo import Repo
from snapstore.chunks.staging import StagingBuffer
from snapstore.lifecycle.access import Access
from snapstore.lifecycle.bookkeeping import Ledger, record_use
from snapstore.lifecycle.capacity import Capacity
from snapstore.lifecycle.rules import new_outside_use
from snapstore.parts.buffers import Destination
from snapstore.plan.prefix import granularity
from snapstore.restore.hot import HotKey, HotRestores
from snapstore.restore.read import Planned, details_of, planned, stream_checked, wanted_components
from snapstore.restore.read_path import ReadPaths
from snapstore.save.stages import count_of
from snapstore.store.batch import plan_then_bind
from snapstore.store.gate import CallGate, operation
from snapstore.store.recompute import RestoreRates, RestoreTimer, StoreRecompute, restored
from snapstore.tiers.stack import Tiers

__all__ = ["StoreRestore"]


class StoreRestore:
    """``restore`` and ``describe`` (module docstring)."""

    _gate: CallGate
    _tiers: Tiers
    _hot: HotRestores
    _repo: Repo
    _access: Access
    _capacity: Capacity
    _staging: StagingBuffer
    _ledger: Ledger
    _reads: ReadPaths
    _rates: RestoreRates
    layout: Layout
    budget: Budget


    # -- restore -----------------------------------------------------------------------------
    def _plan(self, c: Txn, sid: int, ns: str, wanted: set[str], rows_from: int = 0,
              upto: int | None = None) -> Planned:
        """Check that ``sid`` is this store's to restore and check its plan (bound by the caller)."""
        return planned(c, self._access, self.layout, sid, ns, wanted, rows_from, upto, memo=self._repo.plans)

    @operation
    def restore(self, m: SnapshotRef,
                into: Mapping[str, Destination] | Callable[[MatchDetails], Mapping[str, Destination]],
                components: Iterable[str] | None = None, *, namespace: str | None = None,
                rows_from: int = 0, session: str | None = None) -> RestoreResult:
        """Write the snapshot's state into ``into`` (name → writable buffer), exactly, or raise.

        ``m`` is a Match (its namespace applies), a SaveResult or a snapshot id (then ``namespace``
        must name the snapshot's namespace). ``into`` may be a callable: it gets the checked plan
        (``describe``) and returns the mapping (plan, then write). ``rows_from``: rows the engine
        already holds, not written. ``session``: the caller's session key; a restore by another
        session or without one keeps the snapshot from being superseded away (docs/api.md). Raises
        a RestoreError whose ``touched`` says whether ``into`` was modified.
        """
        k = count_of(rows_from, "rows_from")
        hot: HotKey | None = None
        touched = False  # a replay wrote before it gave up: the full path's error must say so
        if not self._tiers.shared.has(m):
            ref = resolve_ref(m)
            hot = self._hot.key(ref.snapshot_id, ref_namespace(ref, namespace), components, k, ref.upto, into)
            if hot is not None:
                done = self._replayed(hot, m, into, k, session)
                if isinstance(done, RestoreResult):
                    return done
                touched = done
        wanted = wanted_components(self.layout, components)
        # its time and tiers, for the restore rates (store/recompute.py; the Store is a StoreRecompute too)
        timer = RestoreTimer(cast("StoreRecompute", self), m, k)
        if self._tiers.shared.has(m):
            # a shared-tier match: fetched into the local tier (then restored below), or streamed (remote.tier)
            got = self._tiers.shared.restore(m, into, self.layout, wanted, k, lambda t, _freed: self._capacity.excess(t)
                                             is None, lambda n: self._capacity.precheck(n, 0) is None, self._access.iid)
            if isinstance(got, RestoreResult):
                timer.done(got.n_tokens, got.bytes_restored)
                return got
            m = got
        ref = resolve_ref(m)  # the one reading of a ref: a Match's or MatchDetails' n_tokens is honoured
        sid, ns = ref.snapshot_id, ref_namespace(ref, namespace)
        t0 = time.perf_counter()
        sess = session_key(session)
        wal = self._hot.wal() if hot is not None else None  # before the plan: what a kept plan stands under
        try:
            # planned once (a block-granular prefix match restores rows [0, upto // g) only); a callable
            # `into` is handed the checked plan; timed from the plan, or after a callable's allocation
            snap, plan = plan_then_bind(self, sid, ns, into, wanted, k, ref.upto, getattr(m, "why", None),
                                        timer.reading)
            stream_checked(plan, sid, self._repo, self._staging, self._tiers.ram, self._ledger.count, self._reads,
                           timer.tiers)
        except RestoreError as e:
            e.touched = e.touched or touched
            raise
        nbytes = plan.nbytes
        timer.done(plan.n_tokens, nbytes)
        # last use and the hit are bookkeeping: recorded in memory and written now only if the
        # write lock is free; a restore queues behind a writer only for a first outside use
        outside = new_outside_use(snap, sess)
        record_use(self._repo, self._ledger, [(sid, outside)])
        if not outside and hot is not None and isinstance(into, dict):  # (a key is only made for a dict)
            self._hot.learn(hot, wal, snap, plan, into)
        return RestoreResult(plan.n_tokens, plan.rows, frozenset(plan.missing_components), plan.chain,
                             nbytes, time.perf_counter() - t0)

    def _replayed(self, key: HotKey, m: SnapshotRef, into: object, rows_from: int,
                  session: str | None) -> RestoreResult | bool:
        """A restore replayed from the plan kept for ``key`` (restore/hot.py), with a full restore's
        bookkeeping; else whether the replay wrote before it gave up (the full path runs)."""
        t0 = time.perf_counter()
        sess = session_key(session)
        assert isinstance(into, dict)  # a key is only made for a dict
        # a first use from outside the snapshot's session is written at once: the full path's
        done = self._hot.replay(key, into, lambda: self._repo.db.read(lambda c: c.catalog_gen()),
                                lambda snap: not new_outside_use(snap, sess), self._tiers.ram)
        if done is None or done.plan is None:
            return done is not None and done.touched
        p = done.plan
        dt = time.perf_counter() - t0
        restored(self._rates, self._ledger.count, m, done.tiers, dt, p.n_tokens - rows_from * granularity(self.layout))
        record_use(self._repo, self._ledger, [(p.snap.id, False)])
        return RestoreResult(p.n_tokens, dict(p.rows), p.missing, list(p.chain), p.nbytes, dt)

    @operation
    def describe(self, m: SnapshotRef, components: Iterable[str] | None = None, *,
                 namespace: str | None = None, rows_from: int = 0) -> MatchDetails:
        """What restoring ``m`` would write — rows per stream, components, bytes — checked like a
        restore's plan but without destinations, so an engine can size its buffers first."""
        ref = resolve_ref(m)
        sid, ns = ref.snapshot_id, ref_namespace(ref, namespace)
        wanted = wanted_components(self.layout, components)
        k = count_of(rows_from, "rows_from")

        def run(c: Txn) -> MatchDetails:
            p = self._plan(c, sid, ns, wanted, k, ref.upto)
            return details_of(p.snap, p.bind(None), ns, k, getattr(m, "why", None))  # a match's decision too

        return self._repo.db.read(run)
