"""The write transactions of a store's snapshot-lifecycle calls: commit, abandon and delete, and
the housekeeping run at open and close.

Each function runs inside one write transaction (``t``) and applies the policies of
:mod:`snapstore.lifecycle.rules`; chunk rows they remove are freed on ``t`` and unlinked after the commit by
the repository's write path. Ownership is checked through :class:`snapstore.lifecycle.access.Access`.
"""

from __future__ import annotations

from snapstore._errors import StateError
from snapstore._results import DeleteResult
from snapstore._tokens import TokenIndex
from snapstore.catalog.queries import SnapRow, SnapState, Txn
from snapstore.lifecycle.access import Access
from snapstore.lifecycle.capacity import Capacity
from snapstore.lifecycle.eviction import evict_until
from snapstore.lifecycle.liveness import Liveness
from snapstore.lifecycle.owner import Owner
from snapstore.lifecycle.rules import IdentityDrop, drop_dead_pending, drop_subtree, expire, supersede
from snapstore.lifecycle.rules import drop_stale as stale
from snapstore.plan.match import tokens_of
from snapstore.save.stages import Skip

__all__ = ["abandon_capture", "commit_capture", "delete_subtree", "drop_capture", "housekeep", "retire"]


def housekeep(t: Txn, *, root: str, lease: float, now: float, identity_key: str, drop_stale: bool,
              ttl: float | None) -> tuple[list[str], list[IdentityDrop]]:
    """At open: drop pending captures of dead owners, this model's stale identities (``drop_stale``:
    :func:`snapstore.lifecycle.rules.drop_stale`), expired snapshots (``ttl``). Returns the dead owners whose lock
    files may go after the commit, and the identities dropped (logged after it: :func:`log_drops`)."""
    live = Liveness(root, t, lease, now)
    _, _, dead = drop_dead_pending(t, live)
    drops = stale(t, identity_key, live) if drop_stale else []
    if ttl:
        expire(t, now - ttl)
    return dead, drops


def retire(t: Txn, owner: Owner, *, root: str, lease: float) -> list[str]:
    """At close: abandon this owner's pending captures, remove its row, drop dead owners' captures.
    Returns the dead owners whose lock files may go after the commit."""
    mine = 0
    for snap in t.pending():
        if snap.owner == owner.token and t.snapshot(snap.id) is not None:
            gone, _ = drop_subtree(t, snap.id)
            mine += len(gone)
    if mine:
        t.add_counter("abandoned", mine)
    owner.retire(t)
    _, _, dead = drop_dead_pending(t, Liveness(root, t, lease))
    return dead


def commit_capture(t: Txn, access: Access, sid: int, ns: str, capacity: Capacity, now: float) -> SnapRow:
    """Commit pending capture ``sid`` and its pending ancestors (root first), superseding within
    their sessions, then evict to fit; Skip(reason) when it cannot fit. Returns the snapshot's row
    as read before the commit (already committed: returned as it is)."""
    snap = access.own(t, t.snapshot(sid), ns)
    if snap.state == SnapState.COMMITTED:
        return snap
    if snap.owner != access.owner:
        raise StateError(f"snapshot {sid} is a pending capture of another process")
    chain = access.chain(t, snap)
    tokens = tokens_of(chain)
    for link in chain:
        if link.state == SnapState.COMMITTED:
            continue
        t.set_state(link.id, SnapState.COMMITTED, None, now)
        new = t.snapshot(link.id)
        assert new is not None
        supersede(t, new, TokenIndex(tokens[:link.n_tokens]))
    ok, _ = evict_until(t, lambda _freed: capacity.excess(t) is None, {s.id for s in chain})
    if not ok:
        raise Skip(capacity.excess(t) or "disk_reserve")
    return snap


def drop_capture(t: Txn, owner: str, sid: int) -> None:
    """Drop ``owner``'s pending capture ``sid`` and its pending descendants, nothing else."""
    snap = t.snapshot(sid)
    if snap is None or snap.state == SnapState.COMMITTED or snap.owner != owner:
        return  # committed meanwhile by another thread of this store, or already gone
    gone, _ = drop_subtree(t, sid)
    t.add_counter("abandoned", len(gone))


def abandon_capture(t: Txn, access: Access, sid: int, ns: str) -> None:
    """abandon(): drop this store's pending capture ``sid`` and its pending descendants (gone: no-op)."""
    snap = t.snapshot(sid)
    if snap is None:
        return
    access.own(t, snap, ns)
    if snap.state == SnapState.COMMITTED:
        raise StateError(f"snapshot {sid} is committed; abandon() only drops pending captures "
                         "(delete() drops committed snapshots)")
    if snap.owner != access.owner:
        raise StateError(f"snapshot {sid} is a pending capture of another process")
    gone, _ = drop_subtree(t, sid)
    t.add_counter("abandoned", len(gone))
    access.note_gone(gone, f"abandoned: its turn was abandoned (abandon({sid}))")


def delete_subtree(t: Txn, access: Access, sid: int, ns: str, *, root: str, lease: float) -> DeleteResult:
    """delete(): drop snapshot ``sid`` of this identity, its descendants and the bare chain links
    left without children; refused while a live process has a pending capture in the subtree."""
    snap = access.own(t, t.snapshot(sid), ns)
    live = Liveness(root, t, lease)
    for d in [sid, *t.descendants(sid)]:
        row = t.snapshot(d)
        if row is not None and row.state == SnapState.PENDING and row.owner != access.owner \
                and live.alive(row.owner, row.created):
            raise StateError(f"snapshot {d} (in the subtree of {snap.id}) is a pending capture of "
                             "another process; delete it after that capture is committed or abandoned")
    before = t.stored_bytes()
    gone, pruned = drop_subtree(t, sid)
    t.add_counter("deleted", len(gone) + len(pruned))
    access.note_gone(gone + pruned, f"deleted (delete({sid}))")
    return DeleteResult(tuple(gone + pruned), before - t.stored_bytes())
