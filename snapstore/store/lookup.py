"""``Store.lookup``: match() and describe() of its hit in one read transaction (issue 31).

A scheduler asks, per request, how many tokens the store holds for a prompt and what restoring
them writes, before it allocates anything. As two calls that is two transactions, and describe
walks the chain the match just walked; here both run in one consistent snapshot of the catalog
(the plan's own checks unchanged: a chain that would not restore is an error, not a hit).
A lookup weighed against prefill (``prefill_tokens_per_s``) weighs the prefixes in that same read:
each option's plan is built once, for its estimate and then for the details of the one chosen
(:func:`snapstore.store.recompute.weigh` decides, as match() does). A store with a shared tier
takes the two calls (the tier may hold a longer prefix). ``Store.load`` (store/load.py) is here
too: both are the Store's prefix-to-plan calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from snapstore._config import Budget
from snapstore._errors import SnapstoreError
from snapstore._layout import Layout
from snapstore._refs import SnapshotRef, excluded, namespace_key
from snapstore._results import LoadResult, Match, MatchDetails, RecomputeDecision, RestoreEstimate
from snapstore._tokens import TokensLike, as_token_array
from snapstore.catalog.chain_cache import ChainCache, ChainReads, Stamp
from snapstore.catalog.db import Database
from snapstore.catalog.queries import ChunkRow, SnapRow, Txn
from snapstore.chunks.repo import Repo
from snapstore.lifecycle.access import Access
from snapstore.lifecycle.bookkeeping import Ledger
from snapstore.parts.buffers import Destination
from snapstore.plan.match import Prompt, best_match
from snapstore.plan.restore_or_recompute import check_rate
from snapstore.plan.restore_plan import RestorePlan
from snapstore.restore.read import details_of, plan_of, wanted_components
from snapstore.store.gate import CallGate, operation
from snapstore.store.load import load_prefix
from snapstore.store.recompute import chosen_match, chunks_estimate, weigh
from snapstore.store.warm import warm_up
from snapstore.tiers.stack import Tiers

__all__ = ["KeptReads", "StoreLookup", "lookup_prefix"]


def lookup_prefix(db: Database, access: Access, layout: Layout, tokens: TokensLike, *, namespace: str | None,
                  exclude: Iterable[SnapshotRef] | None, components: Iterable[str] | None, ttl: float | None,
                  count: Callable[..., None], two_calls: tuple[Any, Any] | None = None,
                  weighed: tuple[float, Callable[[list[ChunkRow], Stamp | None, float], RestoreEstimate]] | None = None,
                  memo: ChainCache | None = None) -> MatchDetails | None:
    """The longest committed prefix of ``tokens`` as :class:`MatchDetails` (``n_tokens``: the
    tokens matched; ``snapshot_tokens``: the snapshot's own), or None; counted like match().
    ``two_calls``: the store's (match, describe), taken instead when it has a shared tier.
    ``weighed``: (prefill tokens per second, the estimate of a plan's chunks under its stamp, or a bound under
    the seconds given, :func:`snapstore.store.recompute.chunks_estimate`): the prefix that saves
    the most time, or None when reading the prompt is faster than any restore (``why`` says).
    ``memo``: the store's kept plan reads (``Repo.plans``)."""
    if two_calls is not None:  # the shared tier may hold a longer prefix than the local catalog
        match, describe = two_calls
        m = match(tokens, namespace=namespace, exclude=exclude)
        return None if m is None else describe(m, components, namespace=namespace)
    arr = as_token_array(tokens, borrow=True)  # read only during this call
    ns = namespace_key(namespace)
    skip = excluded(exclude)
    wanted = wanted_components(layout, components)
    if len(arr) == 0:
        return None
    not_before = time.time() - ttl if ttl else 0.0
    key = access.identity_key

    def run(c: Txn) -> MatchDetails | None:
        reads = KeptReads(c, memo)
        found = best_match(c, layout, key, ns, arr, skip, not_before, reads)
        if found is None:
            return None
        hit, n_hit = found
        snap, plan = plan_of(reads.plans(), access, layout, hit.id, ns, None, wanted, 0, n_hit, memo=memo)
        return details_of(snap, plan, ns, 0)

    if weighed is None:
        details = db.read(run)
        if details is None:
            count("misses")
            return None
        count("hits")
        count("hit_tokens", details.n_tokens)
        return details
    rate, estimate_chunks = weighed
    prompt = Prompt(arr)

    def run_weighed(c: Txn) -> tuple[RecomputeDecision, dict[int, Match], MatchDetails | None]:
        plans: dict[int, tuple[SnapRow, RestorePlan]] = {}
        reads = KeptReads(c, memo)

        def estimate(m: Match, sure: float) -> RestoreEstimate | None:
            chunks: list[ChunkRow] = []
            try:
                plans[m.snapshot_id] = plan_of(reads.plans(), access, layout, m.snapshot_id, ns, None, wanted, 0,
                                               m.n_tokens, chunks, memo)
            except SnapstoreError:
                return None  # unreadable since it matched: not a choice (its restore would fail alike)
            return estimate_chunks(chunks, plans[m.snapshot_id][1].stamp, sure)

        decision, by_id = weigh(best_match(c, layout, key, ns, prompt, skip, not_before, reads),
                                lambda passed: best_match(c, layout, key, ns, prompt, passed, not_before, reads),
                                skip, estimate, None, rate, namespace)
        if decision.chosen is None:
            return decision, by_id, None
        snap, plan = plans[decision.chosen]
        return decision, by_id, details_of(snap, plan, ns, 0, decision)

    decision, by_id, details = db.read(run_weighed)
    chosen_match(count, decision, by_id)  # counted as match() counts it
    return details


class KeptReads:
    """A lookup's kept plan reads (:meth:`ChainCache.reads`), made at most once per transaction and
    only when asked (a match asks once a candidate's own tokens match: a miss reads no stamp).
    ``made``: what was made — the reads the plans of the same transaction then use — or None."""

    __slots__ = ("_c", "_memo", "made")

    def __init__(self, c: Txn, memo: ChainCache | None) -> None:
        self._c = c
        self._memo = memo
        self.made: Txn | ChainReads | None = None

    def __call__(self) -> ChainReads | None:
        if self.made is None and self._memo is not None:
            self.made = self._memo.reads(self._c)
        return self.made if isinstance(self.made, ChainReads) else None

    def plans(self) -> Txn | ChainReads:
        """What a plan of this transaction reads through: the reads made, else the transaction."""
        return self.made if self.made is not None else self._c


class StoreLookup:
    """``lookup`` and ``load``: a base of :class:`snapstore.Store`, which supplies what is declared here."""

    _gate: CallGate
    _repo: Repo
    _access: Access
    _ledger: Ledger
    _tiers: Tiers
    layout: Layout
    budget: Budget
    match: Callable[..., Match | None]
    describe: Callable[..., MatchDetails]

    @operation
    def lookup(self, tokens: TokensLike, *, namespace: str | None = None, exclude: Iterable[SnapshotRef] | None = (),
               components: Iterable[str] | None = None,
               prefill_tokens_per_s: float | None = None) -> MatchDetails | None:
        """``describe(match(tokens))`` in one catalog read, or None (docs/api.md "lookup"); with
        ``prefill_tokens_per_s`` the match weighed against prefill, in the same read (``why`` set)."""
        def match(t: TokensLike, **kw: Any) -> Match | None:
            return self.match(t, prefill_tokens_per_s=prefill_tokens_per_s, **kw)

        weighed = (check_rate(prefill_tokens_per_s),
                   lambda chunks, stamp, sure: chunks_estimate(self, chunks, stamp, sure)) \
            if prefill_tokens_per_s is not None else None
        return lookup_prefix(self._repo.db, self._access, self.layout, tokens, namespace=namespace, exclude=exclude,
                             components=components, ttl=self.budget.ttl, count=self._ledger.count,
                             two_calls=(match, self.describe) if self._tiers.shared.present else None, weighed=weighed,
                             memo=self._repo.plans)

    @operation
    def warm_up(self) -> None:
        """Pay the first lookup's and restore's one-time costs now, on this thread's connection
        (prepared statements, the residency probe, the plans of the most recently used snapshots):
        for an engine about to serve (store/warm.py). Reads only; counts nothing."""
        warm_up(self._repo.db, self._access, self.layout, self._repo.plans)

    def load(self, tokens: TokensLike | Match | MatchDetails, *,
             allocate: Callable[[MatchDetails], Mapping[str, Destination]],
             release: Callable[[Mapping[str, Destination]], object] | None = None,
             components: Iterable[str] | None = None, namespace: str | None = None,
             exclude: Iterable[SnapshotRef] | None = (), session: str | None = None) -> LoadResult | None:
        """Match, allocate(details), restore; None on a miss; an error: release, raise (store/load.py).
        ``tokens`` may be the Match / MatchDetails of an earlier match() / lookup(): not matched again."""
        return load_prefix(self, tokens, allocate, release, components=components, namespace=namespace,  # type: ignore[arg-type]
                           exclude=exclude, session=session)
