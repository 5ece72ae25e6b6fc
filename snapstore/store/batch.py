"""Plan, then write: a destination chosen from the checked plan, and batches of restores.

``Store.restore(m, into=callable)`` checks the plan once (:func:`plan_then_bind`), hands its
description (``describe``'s MatchDetails) to the engine's callable (which allocates exactly the
blocks it needs and returns the destinations), then binds that same plan to them and restores.
``Store.restore_many`` builds every plan in one read transaction and streams them as one: a chunk
that several chains share (a common system prompt) is read and checked once, then copied into
each destination.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from snapstore._errors import InvalidInputError, RestoreError
from snapstore._layout import Layout
from snapstore._refs import SnapshotRef, ref_namespace, resolve_ref, session_key
from snapstore._results import Match, MatchDetails, RecomputeDecision, RestoreResult
from snapstore._tokens import TokensLike
from snapstore.lifecycle.bookkeeping import Ledger, record_use
from snapstore.lifecycle.rules import new_outside_use
from snapstore.parts.buffers import Destination, Sink
from snapstore.plan.restore_plan import PlanItem, RestorePlan
from snapstore.restore.rates import RestoreRates
from snapstore.restore.read import (
    Planned,
    allocated,
    destination,
    details_of,
    stream_checked,
    wanted_components,
)
from snapstore.save.stages import count_of
from snapstore.store.gate import CallGate, operation

if TYPE_CHECKING:
    from snapstore.catalog.db import Conn
    from snapstore.catalog.queries import SnapRow, Txn
    from snapstore.chunks.direct_io import DirectReads
    from snapstore.chunks.repo import Repo
    from snapstore.chunks.staging import StagingBuffer
    from snapstore.tiers.stack import Tiers

__all__ = ["BatchStore", "PlanStore", "StoreBatches", "plan_then_bind", "restore_batch"]


class BatchStore(Protocol):
    """What a batch of restores uses of its Store (:class:`snapstore.Store` is one): typed here, so
    this module sits below the Store rather than importing it."""

    _tiers: Tiers
    _repo: Repo
    _staging: StagingBuffer
    _ledger: Ledger
    _reads: DirectReads
    _rates: RestoreRates

    def _plan(self, c: Txn, sid: int, ns: str, wanted: set[str], rows_from: int = 0,
              upto: int | None = None) -> Planned: ...


class PlanStore(Protocol):
    """What :func:`plan_then_bind` uses of its Store: the catalog and the one planning step."""

    _repo: Repo

    def _plan(self, c: Txn, sid: int, ns: str, wanted: set[str], rows_from: int = 0,
              upto: int | None = None) -> Planned: ...


class _FanSink(Sink):
    """One chunk, several destinations: read and checked once (staged), then written to each."""

    def __init__(self, sinks: list[Sink]):
        super().__init__(sinks[0].name, sinks[0].nbytes)
        self.sinks = sinks

    def view(self, start: int, end: int) -> memoryview | None:
        return None  # no single place to read into: the staging buffer holds it for every copy

    def write(self, start: int, data: memoryview) -> None:
        for s in self.sinks:
            s.write(start, data)


def many(items: object, what: str, of: str) -> list[Any]:
    """A batch call's argument as a list; InvalidInputError for anything that is not a collection."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise InvalidInputError(f"{what} must be a list of {of}, got {type(items).__name__}")
    try:
        return list(items)
    except TypeError:  # iterable in name only (a 0-d array)
        raise InvalidInputError(f"{what} must be a list of {of}, got {items!r:.60}") from None


def _merged(plans: list[RestorePlan]) -> RestorePlan:
    """Every plan's items as one plan; items that write the same chunk at the same place share a read."""
    groups: dict[tuple[str, bytes, int, int], list[PlanItem]] = {}
    for plan in plans:
        for item in plan.items:
            groups.setdefault((item.sink.name, item.chunk.id, item.offset, item.skip), []).append(item)
    items = [g[0] if len(g) == 1 else PlanItem(_FanSink([i.sink for i in g]), g[0].offset, g[0].chunk, g[0].skip)
             for g in groups.values()]
    return RestorePlan(plans[0].snapshot_id, plans[0].n_tokens, [], {}, set(), items)


def plan_then_bind(store: PlanStore, sid: int, ns: str,
                   into: Mapping[str, Destination] | Callable[[MatchDetails], Mapping[str, Destination]],
                   wanted: set[str], rows_from: int, upto: int | None, why: RecomputeDecision | None,
                   reading: Callable[[], None]) -> tuple[SnapRow, RestorePlan]:
    """restore()'s plan, made once in one read transaction, then bound to the destinations (each
    checked before a byte is written). A callable ``into`` gets the plan's description (describe()'s
    MatchDetails, ``why`` the match's decision) and returns them. ``reading`` starts the restore's
    timer: before the plan for a mapping, after a callable's allocation (the engine's time)."""
    dest = destination(into)  # a mapping as it is (None: a callable); anything else raises before the plan
    if dest is not None:
        reading()
    p = store._repo.db.read(lambda c: store._plan(c, sid, ns, wanted, rows_from, upto))
    if dest is None:
        dest = allocated(into, details_of(p.snap, p.bind(None), ns, rows_from, why))
        reading()
    return p.snap, p.bind(dest)


def restore_batch(store: BatchStore, requests: list[tuple[Any, Any]], wanted: set[str], namespace: str | None,
                  rows_from: int, session: str | None = None) -> list[RestoreResult]:
    """Validate every request's plan, then stream them together; one error fails the batch.

    ``session``: the caller's, for the session rule (as ``Store.restore``). Shared-tier matches are
    fetched into the local tier first (``RemoteTier.localize``)."""
    requests = store._tiers.shared.localize(requests, store, wanted, rows_from)
    refs = []
    for k, pair in enumerate(requests):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidInputError(f"restore_many: request {k} must be a (match, into) pair, got {pair!r}")
        m, into = pair
        if not isinstance(into, Mapping):
            raise InvalidInputError(f"restore_many: request {k}: into must be a mapping of part name to buffer")
        ref = resolve_ref(m)  # the one reading of a ref (a MatchDetails' n_tokens honoured, as restore() does)
        refs.append((ref.snapshot_id, ref_namespace(ref, namespace), into, ref.upto))
    if not refs:
        return []
    t0 = time.perf_counter()

    def build(c: Conn) -> list[tuple[bool, RestorePlan]]:
        out = []
        for sid, ns, into, upto in refs:
            p = store._plan(c, sid, ns, wanted, rows_from, upto)
            out.append((new_outside_use(p.snap, session), p.bind(into)))  # the session rule's signal (lifecycle.rules)
        return out

    built = store._repo.db.read(build)
    plans = [p for _, p in built]
    tiers: dict[str, int] = {}
    try:
        stream_checked(_merged(plans), None, store._repo, store._staging, store._tiers.ram, store._ledger.count,
                       store._reads, tiers)
    except RestoreError as e:
        e.args = (f"restore_many ({len(plans)} requests, failed as one; every destination counts as "
                  f"touched={e.touched}): {e}",)
        raise
    dt = time.perf_counter() - t0
    store._rates.observe(tiers, dt)  # one restore of the batch's bytes, as the restore rates count it
    record_use(store._repo, store._ledger, [(p.snapshot_id, outside) for outside, p in built])
    return [RestoreResult(p.n_tokens, p.rows, frozenset(p.missing_components), p.chain, p.nbytes, dt)
            for p in plans]


class StoreBatches:
    """match_many() and restore_many(): a base of :class:`snapstore.Store`, which supplies the
    attributes and calls declared here (those of :class:`BatchStore`, its layout, gate and match)."""

    _tiers: Tiers
    _repo: Repo
    _staging: StagingBuffer
    _ledger: Ledger
    _reads: DirectReads
    _rates: RestoreRates
    _gate: CallGate
    layout: Layout

    def _plan(self, c: Txn, sid: int, ns: str, wanted: set[str], rows_from: int = 0,
              upto: int | None = None) -> Planned:
        raise NotImplementedError  # the Store's: the checked plan of one snapshot

    def match(self, tokens: TokensLike, *, namespace: str | None = None) -> Match | None:
        raise NotImplementedError  # the Store's match()

    @operation
    def match_many(self, token_lists: Iterable[TokensLike], *, namespace: str | None = None) -> list[Match | None]:
        """``match()`` for each of many prompts (a scheduler admitting a batch), in order."""
        return [self.match(t, namespace=namespace) for t in many(token_lists, "token_lists", "prompts")]

    @operation
    def restore_many(self, requests: Iterable[tuple[SnapshotRef, Mapping[str, Destination]]],
                     components: Iterable[str] | None = None, *, namespace: str | None = None,
                     rows_from: int = 0, session: str | None = None) -> list[RestoreResult]:
        """Restore many (match, into) pairs at once; a chunk their chains share is read once."""
        return restore_batch(self, many(requests, "requests", "(match, into) pairs"),
                             wanted_components(self.layout, components), namespace, count_of(rows_from, "rows_from"),
                             session_key(session))
