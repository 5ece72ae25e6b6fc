"""The Store's side of restore or recompute (issue 32, part 1): estimates of its matches' restores,
the choice among a prompt's stored prefixes (:mod:`snapstore.plan.restore_or_recompute` decides), and what each
restore records (its rate per tier, :mod:`snapstore.restore.rates`; the time it saved).

Kept apart from ``Store.match`` so that match's own path is unchanged when no prefill rate is given.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from snapstore._errors import SnapstoreError
from snapstore._layout import Layout
from snapstore._refs import SnapshotRef, ref_namespace, resolve_ref
from snapstore._results import Match, RecomputeDecision, RestoreEstimate
from snapstore.catalog.chain_cache import Stamp
from snapstore.catalog.queries import ChunkRow, SnapRow
from snapstore.lifecycle.bookkeeping import Ledger
from snapstore.plan.match import Prompt, best_match
from snapstore.plan.prefix import granularity
from snapstore.plan.restore_or_recompute import MAX_CONSIDERED, Option, check_rate, decide
from snapstore.restore.rates import DISK_TIERS, LOCAL_TIERS, RestoreRates
from snapstore.restore.read import plan_of, wanted_components
from snapstore.restore.tier_probe import probe_chunks
from snapstore.store.gate import CallGate, operation
from snapstore.tiers.stack import Tiers

__all__ = ["RestoreRates", "RestoreTimer", "StoreRecompute", "choose_match", "chosen_match", "chunks_estimate",
           "estimate_of", "restored", "weigh"]

Found = tuple[SnapRow, int]


def estimate_of(store: Any, m: Any, wanted: set[str], namespace: str | None,
                remote_bytes: Callable[[Any], int] | None, sure: float = 0.0) -> RestoreEstimate:
    """``Store.estimate_restore``: a shared-tier match costs its bytes at the remote rate; a local one
    its plan's chunk bytes at the rate of the tier each chunk is in now (:func:`chunks_estimate`;
    ``sure``: as there)."""
    rates: RestoreRates = store._rates
    if getattr(m, "remote", None) is not None and remote_bytes is not None:
        return rates.estimate({"remote": remote_bytes(m)})
    ref = resolve_ref(m)  # the one reading of a ref: a Match's or MatchDetails' n_tokens is what is estimated
    sid, ns = ref.snapshot_id, ref_namespace(ref, namespace)
    chunks: list[ChunkRow] = []
    _, plan = store._repo.db.read(lambda c: plan_of(c, store._access, store.layout, sid, ns, None, wanted, 0,
                                                    ref.upto, chunks, store._repo.plans))
    return chunks_estimate(store, chunks, plan.stamp, sure)


def chunks_estimate(store: Any, chunks: list[ChunkRow], stamp: Stamp | None = None,
                    sure: float = 0.0) -> RestoreEstimate:
    """A local plan's chunk bytes at the rate of the tier each chunk is in now (:func:`probe_chunks`):
    the one estimate of a local restore, for ``estimate_restore`` and a weighed ``lookup`` alike.
    ``stamp``: the plan's (made from memory), under which the store's kept files are probed.
    ``sure``: seconds under which an upper bound answers instead, nothing probed (a weighed match
    takes any restore that cheap, :func:`snapstore.plan.restore_or_recompute.decide`)."""
    rates: RestoreRates = store._rates
    if sure > 0.0:
        where = LOCAL_TIERS if store._tiers.ram is not None else DISK_TIERS  # the tiers its chunks can be in
        bound = rates.bound(sum(chunk.raw_len for chunk in chunks), where)
        if bound.seconds <= sure:
            return bound
    return rates.estimate(probe_chunks(chunks, store._repo.blob_path, store._tiers.ram, store._repo.files, stamp))


def weigh(found: Found | None, next_found: Callable[[set[int]], Found | None], skip: set[int],
          estimate: Callable[[Match, float], RestoreEstimate | None], far: Match | None, rate: float,
          namespace: str | None) -> tuple[RecomputeDecision, dict[int, Match]]:
    """The shared tier's longer match (``far``) and the local prefixes, longest first — ``found``, then
    each next one ``next_found(passed)`` finds past the ones before — weighed by
    :func:`snapstore.plan.restore_or_recompute.decide`; the decision and the Match of each option weighed.
    ``estimate``: an option's restore estimate, None when it is not a choice (gone since it matched)."""
    by_id: dict[int, Match] = {}

    def options() -> Iterator[Option]:
        if far is not None:
            by_id[far.snapshot_id] = far
            yield far.snapshot_id, far.n_tokens, lambda sure: estimate(far, sure)
        got, passed = found, set(skip)
        for _ in range(MAX_CONSIDERED):
            if got is None:
                return
            snap, n = got
            m = by_id[snap.id] = Match(snap.id, n, namespace)
            yield snap.id, n, lambda sure, m=m: estimate(m, sure)  # type: ignore[misc]
            passed.add(snap.id)
            got = next_found(passed)  # only when decide() asks: a free restore of it could still win

    return decide(options(), rate), by_id


def chosen_match(count: Callable[..., None], decision: RecomputeDecision, by_id: Mapping[int, Match]) -> Match | None:
    """The Match ``decision`` chose (carrying it as ``why``), or None; counts the hit or miss, and
    ``recompute_skipped`` when a longer prefix was passed over (or all were)."""
    if decision.considered and decision.chosen != decision.considered[0].snapshot_id:
        count("recompute_skipped")
    chosen = next((c for c in decision.considered if c.snapshot_id == decision.chosen), None)
    if chosen is None:
        count("misses")
        return None
    count("hits")
    count("hit_tokens", chosen.n_tokens)
    return dataclasses.replace(by_id[chosen.snapshot_id], why=decision)


def choose_match(store: Any, prompt: Prompt, ns: str, namespace: str | None, skip: set[int], not_before: float,
                 found: Found | None, far: Match | None, prefill_tokens_per_s: float) -> Match | None:
    """``match(prefill_tokens_per_s=rate)``: :func:`weigh` with the store's own estimates, each next
    prefix found by matching again (a read of its own) past the ones before."""
    rate = check_rate(prefill_tokens_per_s)
    estimate: Callable[[Match, float], RestoreEstimate] = store._weighing_estimate
    decision, by_id = weigh(
        found, lambda passed: store._repo.db.read(lambda c: best_match(c, store.layout, store.identity.key, ns,
                                                                       prompt, passed, not_before)),
        skip, lambda m, sure: _guarded(estimate, m, sure), far, rate, namespace)
    return chosen_match(store._ledger.count, decision, by_id)


def _guarded(estimate: Callable[[Match, float], RestoreEstimate], m: Match, sure: float) -> RestoreEstimate | None:
    try:
        return estimate(m, sure)
    except SnapstoreError:
        return None  # gone or unreadable since it matched: not a choice (its restore would fail alike)


def restored(rates: RestoreRates, count: Callable[[str, int], None], m: object, tiers: Mapping[str, int],
             seconds: float, new_tokens: int) -> None:
    """After a successful restore: its rate per tier, and the time it saved when the match that led
    to it carried a prefill rate (``restore_saved_us``: estimated prefill of its tokens minus its time)."""
    rates.observe(tiers, seconds)
    why = getattr(m, "why", None)
    if isinstance(why, RecomputeDecision):
        count("restore_saved_us", round((new_tokens / why.prefill_tokens_per_s - seconds) * 1e6))


class StoreRecompute:
    """``estimate_restore`` and what a restore records: a base of :class:`snapstore.Store`, which
    supplies the attributes declared here."""

    _gate: CallGate
    _tiers: Tiers
    _rates: RestoreRates
    _ledger: Ledger
    layout: Layout

    @operation
    def estimate_restore(self, m: SnapshotRef, components: Iterable[str] | None = None, *,
                         namespace: str | None = None) -> RestoreEstimate:
        """What restoring ``m`` should take: its chunk bytes per tier (RAM tier, page cache, disk, shared
        tier; probed, nothing read) at the rates this store measured, or stated guesses for a tier not yet
        seen (``measured=False``). docs/api.md "Restore or recompute"."""
        return self._weighing_estimate(m, 0.0, components, namespace=namespace)

    def _weighing_estimate(self, m: SnapshotRef, sure: float, components: Iterable[str] | None = None, *,
                           namespace: str | None = None) -> RestoreEstimate:
        """:meth:`estimate_restore`, or an upper bound where it is under ``sure`` seconds (a weighed
        match's first choice, :func:`chunks_estimate`)."""
        wanted = wanted_components(self.layout, components)
        shared = self._tiers.shared
        return estimate_of(self, m, wanted, namespace, lambda r: shared.nbytes(r, self.layout, wanted), sure)



class RestoreTimer:
    """One restore's measurement for :func:`restored`: a shared-tier match is timed whole (fetch
    included, its bytes credited to "remote"); a local one from :meth:`reading` (after the engine's
    destinations are allocated), its bytes per tier tallied by the stream into :attr:`tiers`."""

    __slots__ = ("m", "remote", "rows_from", "store", "t0", "tiers")

    def __init__(self, store: StoreRecompute, m: object, rows_from: int) -> None:
        self.store, self.m, self.rows_from = store, m, rows_from
        self.remote = store._tiers.shared.has(m)
        self.t0 = time.perf_counter()
        self.tiers: dict[str, int] = {}

    def reading(self) -> None:
        """The local restore begins (a shared-tier one keeps its start: the fetch counts)."""
        if not self.remote:
            self.t0 = time.perf_counter()

    def done(self, n_tokens: int, nbytes: int) -> None:
        """It succeeded: ``n_tokens`` restored (the engine held ``rows_from`` rows), ``nbytes`` written."""
        st = self.store
        restored(st._rates, st._ledger.count, self.m, {"remote": nbytes} if self.remote else self.tiers,
                 time.perf_counter() - self.t0, n_tokens - self.rows_from * granularity(st.layout))
