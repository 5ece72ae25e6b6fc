"""Lifecycle policy inside one write transaction: delete, supersede, evict, expire, drop stale.

Every function returns the chunk ids whose last reference it removed; the caller unlinks their
files only after the transaction commits (:meth:`Repo.unlink_unreferenced`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ._db import Conn, Database, SnapRow
from ._tokens import TokenIndex

__all__ = ["drop_leaf", "drop_subtree", "evict_until", "over_budget", "supersede"]


def over_budget(c: Conn, disk_bytes: int | None, max_entries: int | None) -> str | None:
    """Which limit the catalog exceeds now ("disk_budget", "max_entries"), or None."""
    if disk_bytes is not None and Database.stored_bytes(c) > disk_bytes:
        return "disk_budget"
    if max_entries is not None and Database.entry_count(c) > max_entries:
        return "max_entries"
    return None


def drop_subtree(c: Conn, sid: int) -> tuple[list[bytes], list[int]]:
    """Delete a snapshot and every descendant (deepest first); then prune dead ancestors."""
    freed: list[bytes] = []
    gone: list[int] = []
    for d in Database.descendants(c, sid):
        freed += Database.delete_snapshot(c, d)
        gone.append(d)
    f, g = drop_leaf(c, sid)
    return freed + f, gone + g


def drop_leaf(c: Conn, sid: int) -> tuple[list[bytes], list[int]]:
    """Delete a childless snapshot, then any ancestor left childless that only served as a chain link."""
    snap = Database.snapshot(c, sid)
    if snap is None:
        return [], []
    freed = Database.delete_snapshot(c, sid)
    gone = [sid]
    parent = snap.parent_id
    while parent is not None:
        p = Database.snapshot(c, parent)
        if p is None or p.matchable or Database.has_children(c, parent):
            break
        freed += Database.delete_snapshot(c, parent)
        gone.append(parent)
        parent = p.parent_id
    return freed, gone


def supersede(c: Conn, new: SnapRow, index: TokenIndex) -> tuple[list[bytes], int]:
    """In the new snapshot's session, retire older committed snapshots it strictly extends.

    A retired snapshot stops being matched and loses its fixed parts; if it still carries a
    chain (it is the new one's ancestor, or another branch's), its row segments stay.
    """
    if new.session is None:
        return [], 0
    freed: list[bytes] = []
    count = 0
    for old in Database.session_prefixes(c, new.identity_id, new.namespace, new.session, new.n_tokens, new.id):
        if old.prefix_key != index.prefix_key(old.n_tokens):
            continue  # same session, not a prefix: untouched
        freed += Database.drop_fixed_parts(c, old.id)
        Database.set_unmatchable(c, old.id)
        if not Database.has_children(c, old.id):
            f, _ = drop_leaf(c, old.id)
            freed += f
        count += 1
    if count:
        Database.add_counter(c, "supersedes", count)
    return freed, count


def evict_until(c: Conn, fits: Callable[[list[bytes]], bool], protect: Iterable[int]) -> tuple[bool, list[bytes], int]:
    """Pop least-recently-used committed leaves (never ``protect``) until ``fits(freed)``.

    Returns (fits now, freed chunk ids, snapshots evicted).
    """
    keep = set(protect)
    freed: list[bytes] = []
    evicted = 0
    while not fits(freed):
        # one leaf at a time: dropping it may turn its (older) parent into the next LRU leaf
        leaves = Database.lru_leaves(c, keep, limit=1)
        if not leaves:
            return False, freed, evicted
        f, _ = drop_leaf(c, leaves[0].id)
        freed += f
        evicted += 1
    if evicted:
        Database.add_counter(c, "evictions", evicted)
    return True, freed, evicted
