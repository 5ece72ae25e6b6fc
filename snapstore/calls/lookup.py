"""``Store.lookup``: match() and describe() of its hit in one read transaction (issue 31).

A scheduler asks, per request, how many tokens the store holds for a prompt and what restoring
them writes, before it allocates anything. As two calls that is two transactions, and describe
walks the chain the match just walked; here both run in one consistent snapshot of the catalog
(the plan's own checks unchanged: a chain that would not restore is an error, not a hit).
A store with a shared tier takes the two calls (the tier may hold a longer prefix).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from snapstore._layout import Layout
from snapstore._refs import SnapshotRef, excluded, namespace_key
from snapstore._results import MatchDetails
from snapstore._tokens import TokensLike, as_token_array
from snapstore.catalog.db import Database
from snapstore.catalog.queries import Txn
from snapstore.lifecycle.access import Access
from snapstore.plan.match import best_match
from snapstore.restore.read import details_of, plan_of, wanted_components

__all__ = ["lookup_prefix"]


def lookup_prefix(db: Database, access: Access, layout: Layout, tokens: TokensLike, *, namespace: str | None,
                  exclude: Iterable[SnapshotRef] | None, components: Iterable[str] | None, ttl: float | None,
                  count: Callable[..., None], two_calls: tuple[Any, Any] | None = None) -> MatchDetails | None:
    """The longest committed prefix of ``tokens`` as :class:`MatchDetails` (``n_tokens``: the
    tokens matched; ``snapshot_tokens``: the snapshot's own), or None; counted like match().
    ``two_calls``: the store's (match, describe), taken instead when it has a shared tier."""
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
        found = best_match(c, layout, key, ns, arr, skip, not_before)
        if found is None:
            return None
        hit, n_hit = found
        snap, plan = plan_of(c, access, layout, hit.id, ns, None, wanted, 0, n_hit)
        return details_of(c, snap, plan, ns, 0)

    details = db.read(run)
    if details is None:
        count("misses")
        return None
    count("hits")
    count("hit_tokens", details.n_tokens)
    return details
