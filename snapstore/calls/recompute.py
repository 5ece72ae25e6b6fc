"""The Store's side of restore or recompute (issue 32, part 1): estimates of its matches' restores,
the choice among a prompt's stored prefixes (:mod:`snapstore.plan.recompute` decides), and what each
restore records (its rate per tier, :mod:`snapstore.restore.rates`; the time it saved).

Kept apart from ``Store.match`` so that match's own path is unchanged when no prefill rate is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from snapstore._errors import SnapstoreError
from snapstore._refs import ref_namespace, snapshot_id
from snapstore._results import Match, RecomputeDecision, RestoreEstimate
from snapstore.catalog.queries import ChunkRow, SnapRow
from snapstore.plan.match import best_match
from snapstore.plan.prefix import match_tokens
from snapstore.plan.recompute import MAX_CONSIDERED, Option, decide
from snapstore.restore.rates import RestoreRates
from snapstore.restore.tiers import probe_chunks

__all__ = ["choose_match", "estimate_of", "restored"]

Found = tuple[SnapRow, int]


def estimate_of(store: Any, m: Any, wanted: set[str], namespace: str | None,
                remote_bytes: Callable[[Any], int] | None) -> RestoreEstimate:
    """``Store.estimate_restore``: a shared-tier match costs its bytes at the remote rate; a local one
    its plan's chunk bytes at the rate of the tier each chunk is in now (:func:`probe_chunks`)."""
    rates: RestoreRates = store._rates
    if getattr(m, "remote", None) is not None and remote_bytes is not None:
        return rates.estimate({"remote": remote_bytes(m)})
    sid = snapshot_id(m)
    ns = ref_namespace(m, namespace)
    chunks: list[ChunkRow] = []
    store._repo.db.read(lambda c: store._plan(c, sid, ns, None, wanted, 0, match_tokens(m), chunks))
    return rates.estimate(probe_chunks(chunks, store._repo.blob_path, store._ram))


def choose_match(store: Any, arr: np.ndarray, ns: str, namespace: str | None, skip: set[int], not_before: float,
                 found: Found | None, far: Match | None, rate: float,
                 estimate: Callable[[Match], RestoreEstimate]) -> Match | None:
    """``match(prefill_tokens_per_s=rate)``: the shared tier's longer match (``far``) and the local
    prefixes, longest first (the next found by matching again past the previous), weighed by
    :func:`snapstore.plan.recompute.decide`. Counts the hit or miss, and ``recompute_skipped`` when a
    longer prefix was passed over (or all were)."""
    by_id: dict[int, Match] = {}

    def options() -> Iterator[Option]:
        if far is not None:
            by_id[far.snapshot_id] = far
            yield far.snapshot_id, far.n_tokens, lambda: _guarded(estimate, far)
        got, passed = found, set(skip)
        for _ in range(MAX_CONSIDERED):
            if got is None:
                return
            snap, n = got
            m = by_id[snap.id] = Match(snap.id, n, namespace)
            yield snap.id, n, lambda m=m: _guarded(estimate, m)  # type: ignore[misc]
            passed.add(snap.id)
            got = store._repo.db.read(lambda c: best_match(c, store.layout, store.identity.key, ns, arr, passed,
                                                           not_before))

    decision = decide(options(), rate)
    count = store._ledger.count
    if decision.considered and decision.chosen != decision.considered[0].snapshot_id:
        count("recompute_skipped")
    chosen = next((c for c in decision.considered if c.snapshot_id == decision.chosen), None)
    if chosen is None:
        count("misses")
        return None
    count("hits")
    count("hit_tokens", chosen.n_tokens)
    return dataclasses.replace(by_id[chosen.snapshot_id], why=decision)


def _guarded(estimate: Callable[[Match], RestoreEstimate], m: Match) -> RestoreEstimate | None:
    try:
        return estimate(m)
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
