"""The restore side of a store, between its checks and its stream: which components are wanted, the
validated plan of a snapshot the store may read, what describe() reports of it, and the stream
that quarantines the chunks it found damaged (:mod:`snapstore.plan.restore_plan` validates,
:mod:`snapstore.restore.stream` streams).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from snapstore._errors import CorruptionError, InvalidInputError, RestoreError, StoreIOError
from snapstore._layout import Layout
from snapstore._results import MatchDetails, RecomputeDecision
from snapstore.catalog.chain_cache import ChainCache, ChainReads, Stamp
from snapstore.catalog.queries import ChunkRow, SnapRow, SnapState, Txn
from snapstore.chunks.direct_io import DirectReads
from snapstore.chunks.repo import Repo
from snapstore.chunks.staging import StagingBuffer
from snapstore.lifecycle.access import Access
from snapstore.parts.buffers import Destination
from snapstore.plan.chain_rows import ChainRows
from snapstore.plan.prefix import granularity, rows_bound, rows_limit
from snapstore.plan.restore_plan import CheckedPlan, RestorePlan, bind, check_plan
from snapstore.restore.fail import Damage, quarantine
from snapstore.restore.ramtier import RamTier
from snapstore.restore.read_path import ReadPaths
from snapstore.restore.stream import stream_plan
from snapstore.restore.tier_probe import TierBytes

__all__ = ["Planned", "allocated", "destination", "details_of", "plan_of", "planned", "planned_destination",
           "stream_checked", "wanted_components"]


def wanted_components(layout: Layout, components: Iterable[str] | None) -> set[str]:
    """The components to restore: all of the layout's (None) or the named ones, each known."""
    if isinstance(components, str):
        raise InvalidInputError(f"components must be a collection of names, e.g. [{components!r}]")
    try:
        wanted = set(layout.components) if components is None else set(components)
    except TypeError:  # not iterable, or an unhashable item (a list in the list)
        raise InvalidInputError(f"components must be a collection of component names (str), got "
                                f"{components!r:.80}") from None
    unknown = wanted - set(layout.components)
    if unknown:
        raise InvalidInputError(f"unknown components {sorted(unknown)}; the layout has "
                                f"{sorted(layout.components)}")
    return wanted


@dataclass(frozen=True)
class Planned:
    """A snapshot's plan, checked once (:func:`planned`): bound to destinations as often as a call
    needs — describe()'s none, then the mapping a restore's callable ``into`` returned — without
    reading or checking the catalog again."""

    snap: SnapRow
    checked: CheckedPlan
    stamp: Stamp | None  # the catalog stamp it was read under, when planned through the memo

    def bind(self, into: Mapping[str, Destination] | None, chunks: list[ChunkRow] | None = None) -> RestorePlan:
        """The plan into ``into`` (None: a description), every destination checked before a write."""
        plan = bind(self.checked, into, chunks)
        plan.stamp = self.stamp
        return plan


def planned(c: Txn | ChainReads, access: Access, layout: Layout, sid: int, ns: str, wanted: set[str],
            rows_from: int = 0, upto: int | None = None, memo: ChainCache | None = None) -> Planned:
    """Check that ``sid`` is this store's to restore and check its plan: the one planning step of a
    restore, a describe, a batch and a lookup. ``upto``: the tokens of a block-granular prefix match
    (rows [0, upto // g) only, :mod:`snapstore.plan.prefix`). ``memo``: the store's kept plan reads
    (``Repo.plans``), used while the catalog generation stands; ``c`` may be those reads already
    made in this transaction (:meth:`ChainCache.reads`: the stamp read once)."""
    reads = c if memo is None or isinstance(c, ChainReads) else memo.reads(c)
    snap = access.readable(reads, sid, ns, rows_from)
    rows_to = rows_limit(layout, snap, upto)
    bound = rows_bound(layout, snap, rows_to)
    if rows_from > bound:  # rows_from counts rows: at tokens_per_row > 1 the tokens bound (readable) is looser
        raise InvalidInputError(f"rows_from={rows_from} is past the {bound} rows (of {granularity(layout)} tokens) "
                                f"that restoring snapshot {sid} writes; nothing was written")
    chain = access.chain(reads, snap)
    ids = [link.id for link in chain]
    kept = reads if isinstance(reads, ChainReads) else None
    key = (layout.key, frozenset(wanted), rows_from, rows_to)
    checked = kept.checked(sid, key) if kept is not None else None  # the checks ran on these rows
    if not isinstance(checked, CheckedPlan):
        rows = ChainRows(reads, ids)  # every link's parts and chunks: one statement
        checked = check_plan(rows, sid, chain, layout, wanted, rows_from, rows_to)
        if kept is not None:
            kept.keep_checked(sid, ids, key, checked, len(checked.chunks))
    return Planned(snap, checked, kept.stamp if kept is not None else None)


def plan_of(c: Txn | ChainReads, access: Access, layout: Layout, sid: int, ns: str,
            into: Mapping[str, Destination] | None, wanted: set[str], rows_from: int = 0, upto: int | None = None,
            chunks: list[ChunkRow] | None = None, memo: ChainCache | None = None) -> tuple[SnapRow, RestorePlan]:
    """:func:`planned`, bound to ``into`` (None: described; ``chunks`` gets the chunk rows it reads)."""
    p = planned(c, access, layout, sid, ns, wanted, rows_from, upto, memo)
    return p.snap, p.bind(into, chunks)


def details_of(snap: SnapRow, plan: RestorePlan, ns: str, rows_from: int,
               why: RecomputeDecision | None = None) -> MatchDetails:
    """What restoring ``snap`` by ``plan`` writes, as describe() returns it (``why``: the decision of the
    match it describes, made with ``prefill_tokens_per_s``)."""
    sid = snap.id
    return MatchDetails(
        snapshot_id=sid, n_tokens=plan.n_tokens, namespace=ns or None, rows=dict(plan.rows),
        components=plan.held, missing_components=frozenset(plan.missing_components),
        part_bytes=dict(plan.part_bytes), nbytes=sum(plan.part_bytes.values()),
        chain=list(plan.chain), pending=snap.state == SnapState.PENDING, rows_from=rows_from,
        snapshot_tokens=snap.n_tokens, why=why)


def stream_checked(plan: RestorePlan, sid: int | None, repo: Repo, staging: StagingBuffer, ram: RamTier | None,
                   count: Callable[[str], None], reads: DirectReads | None = None,
                   tiers: TierBytes | None = None) -> None:
    """Stream ``plan``; on a RestoreError count it, name snapshot ``sid`` (None: a batch), and
    quarantine the chunks found damaged in the same call (snapshots using them stop matching until
    a save heals them). The one copy of this policy: restore() and restore_many() both use it."""
    damage: Damage = []
    try:
        t0 = time.perf_counter()
        direct = stream_plan(plan, repo.blob_path, staging, ram, damage, reads, tiers, repo.files)
        if isinstance(reads, ReadPaths):  # a large cold restore: measures the read path, or times it (issue 48)
            reads.restored(repo, tiers, time.perf_counter() - t0, direct)
    except RestoreError as e:
        if e.snapshot_id is None and sid is not None:
            e.snapshot_id = sid
        count("restore_errors")
        if damage and not repo.readonly:  # a read-only store reports damage, it cannot record it
            try:
                quarantine(repo.db, repo.blob_path, damage)
            except (StoreIOError, CorruptionError):
                pass  # a later restore finds (and quarantines) it again
        raise


def destination(into: object) -> Mapping[str, Destination] | None:
    """restore()'s ``into`` before the plan: a mapping as it is, None for a callable (handed the
    checked plan, :func:`allocated`); anything else raises InvalidInputError."""
    if isinstance(into, Mapping):
        return into
    if callable(into):
        return None
    raise InvalidInputError("into must be a mapping of part name to writable buffer, or a callable "
                            "that takes the plan (MatchDetails) and returns one")


def allocated(into: object, details: MatchDetails) -> Mapping[str, Destination]:
    """A callable ``into``'s destinations for the checked plan ``details``; what it raises reaches
    the caller as is (nothing has been written yet)."""
    assert callable(into)  # destination() said so
    dest = into(details)
    if not isinstance(dest, Mapping):
        raise InvalidInputError(f"the destination callable must return a mapping of part name to buffer, "
                                f"got {type(dest).__name__}; nothing was written")
    return dest


def planned_destination(into: object, plan: Callable[[], MatchDetails]) -> Mapping[str, Destination]:
    """:func:`destination`, else :func:`allocated` for the checked plan ``plan()`` (the shared tier's
    restore, whose plan is its manifests')."""
    dest = destination(into)
    return dest if dest is not None else allocated(into, plan())
