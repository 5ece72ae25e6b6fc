"""Named snapshots (issue 32, part 3): ``Store.name`` / ``named`` / ``unname``.

A name pins one committed snapshot of this store's identity, in one namespace: while the name
lives the snapshot is never evicted, expired by the store's TTL, or retired by supersede (it is
detached from its session instead), and its chain stays because it has a child. Its bytes count
toward the disk budget like any others, so a save that cannot fit beside named snapshots is
skipped (``disk_budget``), as beside pins. A name with a ttl stops protecting at its expiry and is
removed (by the next eviction, expiry, ``named`` or ``name`` call). Naming is idempotent; naming
another snapshot with a name in use moves the name. Deleting the snapshot removes its names.
"""

from __future__ import annotations

from snapstore._errors import StateError
from snapstore._numbers import optional_real
from snapstore._refs import MAX_NAME, check_name
from snapstore.catalog.queries import SnapState, Txn
from snapstore.lifecycle.access import Access

__all__ = ["MAX_NAME", "check_name", "check_ttl", "name_snapshot", "resolve_name", "unname"]

# the rule for names is snapstore._refs' (one validation, shared with the export-file decoder)


def check_ttl(ttl_s: object) -> float | None:
    """A name's ``ttl_s``: None (no end), else a finite number of seconds > 0 (snapstore._numbers)."""
    return optional_real(ttl_s, "ttl_s", above=0.0, unit="seconds")


def name_snapshot(t: Txn, access: Access, sid: int, ns: str, name: str, ttl_s: float | None, now: float) -> None:
    """Give snapshot ``sid`` (committed, this identity's, of namespace ``ns``) the name ``name``."""
    snap = access.own(t, t.snapshot(sid), ns)
    if snap.state != SnapState.COMMITTED or not snap.matchable:
        raise StateError(f"snapshot {sid} is {'pending' if snap.state != SnapState.COMMITTED else 'superseded'}: "
                         "only a committed, matchable snapshot can be named (commit it first)")
    t.drop_expired_names(now)
    t.set_name(access.iid(t), ns, name, sid, now, now + ttl_s if ttl_s is not None else None)


def resolve_name(t: Txn, access: Access, ns: str, name: str, now: float) -> int | None:
    """The snapshot ``name`` points at (live names only), or None."""
    iid = t.identity_id(access.identity_key)
    return None if iid is None else t.name_target(iid, ns, name, now)


def unname(t: Txn, access: Access, ns: str, name: str) -> bool:
    """Remove the name; whether it existed. The snapshot stays (evictable again)."""
    iid = t.identity_id(access.identity_key)
    return iid is not None and t.drop_name(iid, ns, name)
