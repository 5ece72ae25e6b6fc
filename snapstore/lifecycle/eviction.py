"""Eviction: which committed snapshots go when the store is over its budget, least recently used first.

One copy of the rule, applied inside one write transaction by every writer — a save making room,
an import, a shared-tier fetch, ``gc`` and open-time housekeeping. An evicted leaf goes with the
ancestors left as bare chain links (:func:`snapstore.lifecycle.rules.drop_leaf`); a live name
protects its snapshot (an expired one no longer does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from snapstore.catalog.queries import Txn
from snapstore.lifecycle.rules import drop_leaf

__all__ = ["evict_until", "over_budget"]


def over_budget(t: Txn, disk_bytes: int | None, max_entries: int | None) -> str | None:
    """Which limit the catalog exceeds now ("disk_budget", "max_entries"), or None."""
    if disk_bytes is not None and t.stored_bytes() > disk_bytes:
        return "disk_budget"
    if max_entries is not None and t.entry_count() > max_entries:
        return "max_entries"
    return None

def evict_until(t: Txn, fits: Callable[[list[bytes]], bool], protect: Iterable[int]) -> tuple[bool, list[int]]:
    """Pop least-recently-used committed leaves (never ``protect``) until ``fits(t.freed)``.

    Returns (fits now, snapshot ids evicted, pruned chain links included); counts "evictions".
    """
    keep = set(protect)
    gone: list[int] = []
    evicted = 0
    t.drop_expired_names(time.time())  # an expired name no longer protects its snapshot
    while not fits(t.freed):
        # one leaf at a time: dropping it may turn its (older) parent into the next LRU leaf
        leaves = t.lru_leaves(keep, limit=1)
        if not leaves:
            return False, gone
        own, pruned = drop_leaf(t, leaves[0].id)
        gone += own + pruned
        evicted += 1
    if evicted:
        t.add_counter("evictions", evicted)
    return True, gone
