"""Lifecycle policy inside one write transaction: one copy of each rule, whoever applies it.

Open-time housekeeping, :meth:`Store.close` and ``gc`` call the same functions, with their
differences as arguments: drop dead pending captures, drop stale identities (:func:`drop_stale`:
the one staleness rule of invariant 7), expire;
plus delete, supersede (with the session rule: what another session uses is detached, not
dropped) and the pruning of chain links.
Eviction is :mod:`snapstore.lifecycle.eviction`. Each bumps its own counter. Chunk rows
they remove are recorded on the transaction (:attr:`Txn.freed`); the repository's write path
unlinks the files after the commit (:meth:`snapstore.chunks.repo.Repo.write`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from snapstore._errors import StoreFormatError
from snapstore._tokens import TokenIndex
from snapstore.catalog.queries import SnapRow, SnapState, Txn
from snapstore.catalog.rows import identity_fields
from snapstore.lifecycle.liveness import Liveness

__all__ = ["IdentityDrop", "drop_dead_pending", "drop_identities", "drop_leaf", "drop_stale", "drop_subtree",
           "expire", "log_drops", "new_outside_use", "supersede", "used_elsewhere"]

log = logging.getLogger("snapstore")




def drop_subtree(t: Txn, sid: int) -> tuple[list[int], list[int]]:
    """Delete a snapshot and every descendant (deepest first); then prune dead ancestors.

    Returns (the snapshot and its descendants, the ancestors pruned as bare chain links).
    """
    gone: list[int] = []
    for d in t.descendants(sid):
        t.delete_snapshot(d)
        gone.append(d)
    own, pruned = drop_leaf(t, sid)
    return gone + own, pruned


def drop_leaf(t: Txn, sid: int) -> tuple[list[int], list[int]]:
    """Delete a childless snapshot, then any ancestor left childless that only served as a chain link.

    Returns ([sid] or [] if it was gone already, the ancestors pruned).
    """
    snap = t.snapshot(sid)
    if snap is None:
        return [], []
    t.delete_snapshot(sid)
    pruned: list[int] = []
    parent = snap.parent_id
    while parent is not None:
        p = t.snapshot(parent)
        if p is None or p.matchable or t.has_children(parent):
            break
        t.delete_snapshot(parent)
        pruned.append(parent)
        parent = p.parent_id
    return [sid], pruned


def new_outside_use(snap: SnapRow, session: str | None) -> bool:
    """Is a use of ``snap`` by ``session`` (None: a caller without one) a use outside its own
    session — one that :func:`supersede` must not take away? Not yet recorded, only."""
    return snap.session is not None and snap.session != session and not snap.shared


def used_elsewhere(t: Txn, old: SnapRow, path: set[int]) -> bool:
    """Does anyone besides ``old``'s own session use it: a restore or a deduplicated save from
    outside it (``shared``), or a child of another session (or none) that is not on the way to
    the superseding snapshot (``path``: its chain)? A child on that path is this conversation's
    own line (a per-turn key of the same chat), which the new snapshot covers. A named snapshot
    (``Store.name``) counts as used: its name holds it."""
    return bool(old.shared) or t.is_named(old.id) or any(
        c not in path for c in t.children_outside(old.id, old.session))


def supersede(t: Txn, new: SnapRow, index: TokenIndex) -> int:
    """In the new snapshot's session, retire older committed snapshots it extends: strictly, or
    with the very same tokens (the same prompt saved again with other bytes; two matchable
    snapshots of one prompt would only compete for the budget — the newer one serves).

    A retired snapshot stops being matched and loses its fixed parts; if it still carries a
    chain (it is the new one's ancestor, or another branch's), its row segments stay. One that
    another session uses (:func:`used_elsewhere`) is detached from the session instead: it stays
    matchable, whole, and evictable like any snapshot without a session ("detached" counter).
    Returns how many were retired.
    """
    if new.session is None:
        return 0
    count = detached = 0
    path: set[int] | None = None
    for old in t.session_prefixes(new.identity_id, new.namespace, new.session, new.n_tokens, new.id):
        if old.prefix_key != index.prefix_key(old.n_tokens):
            continue  # same session, not a prefix: untouched
        if path is None:
            path = {s.id for s in t.chain(new.id)}
        if used_elsewhere(t, old, path):
            t.detach_from_session(old.id)
            detached += 1
            continue
        t.drop_fixed_parts(old.id)
        t.set_unmatchable(old.id)
        if not t.has_children(old.id):
            drop_leaf(t, old.id)
        count += 1
    if count:
        t.add_counter("supersedes", count)
    if detached:
        t.add_counter("detached", detached)
    return count




def drop_dead_pending(t: Txn, live: Liveness) -> tuple[list[int], list[int], list[str]]:
    """Drop every pending capture whose owner is dead (with its descendants) and the dead owners' rows.

    Counts each dropped capture (not the chain links pruned after it) as "abandoned". Returns
    (captures dropped, chain links pruned, owner ids removed); the caller reaps the owners' lock
    files after the commit (:func:`snapstore.lifecycle.owner.reap_lock_files`).
    """
    gone: list[int] = []
    pruned: list[int] = []
    for snap in live.dead_pending(t):
        if t.snapshot(snap.id) is not None:
            g, p = drop_subtree(t, snap.id)
            gone += g
            pruned += p
    dead = live.dead_owners()
    for oid in dead:
        t.delete_owner(oid)
    if gone:
        t.add_counter("abandoned", len(gone))
    return gone, pruned, dead


@dataclass(frozen=True, slots=True)
class IdentityDrop:
    """What dropping one identity removed: its key and fields, its snapshots, the stored bytes freed."""

    key: str
    fields: dict[str, Any]
    snapshots: tuple[int, ...]
    freed_bytes: int
    row_kept: bool = False  # a live process's pending capture, or a name, kept the identity (and a chain)
    named_kept: int = 0  # named snapshots the staleness rule kept (a name is a person's decision to keep)

    def line(self, why: str) -> str:
        """The one log line of this drop."""
        f = self.fields
        what = (f"build={f.get('build')} pack={f.get('pack')} kv={f.get('kv')} mtp={f.get('mtp')} "
                f"extra={f.get('extra')}" if "pack" in f else "fields unreadable")
        kept = "; a live process's pending capture and its chain stay" if self.row_kept and not self.named_kept else ""
        if self.named_kept:
            n = self.named_kept
            kept = (f"; {n} named snapshot{'s and their chains' if n > 1 else ' and its chain'} stay "
                    "(`snapstore inspect` lists them; export and import with --accept-identity moves one to the new "
                    "identity; unname to let the next open drop it)")
        return (f"snapstore: dropped identity {self.key} ({what}): {len(self.snapshots)} snapshots, "
                f"{self.freed_bytes} bytes stored{kept}; {why}")


def _fields(ident_id: int, canonical: str) -> dict[str, Any]:
    try:
        return identity_fields(canonical, f"catalog row identities({ident_id}) column canonical")
    except StoreFormatError:
        return {}  # unreadable: no rule can tell whose model it is


def drop_identities(t: Txn, doomed: Callable[[str, dict[str, Any]], bool], live: Liveness, *,
                    keep_named: bool = False) -> list[IdentityDrop]:
    """Drop the snapshots of every identity ``doomed(key, fields)`` names, deepest first, and its row.

    A live owner's pending capture stays, and with it the chain it extends (its ancestors keep a
    child); such an identity's row stays too. ``keep_named`` (the staleness rule): so does a snapshot
    a live name pins, with its chain (issue 46 item 11: a name is a person's decision to keep it; an
    explicit ``gc --drop-identity`` drops it too). Counts the snapshots dropped as "stale_dropped".
    No chunk file is read (invariant 7). Returns one :class:`IdentityDrop` per identity that lost
    snapshots or its row, for the caller to log once the transaction commits (:func:`log_drops`).
    """
    drops: list[IdentityDrop] = []
    if keep_named:
        t.drop_expired_names(time.time())  # a name whose ttl ran out keeps nothing
    for ident_id, key, canonical, *_ in t.identities():
        fields = _fields(ident_id, canonical)
        if not doomed(key, fields):
            continue
        before = t.stored_bytes()
        gone: list[int] = []
        named = 0
        for snap in sorted(t.snapshots(ident_id), key=lambda s: -s.depth):
            if snap.state == SnapState.PENDING and live.alive(snap.owner, snap.created):
                continue
            if keep_named and t.is_named(snap.id):
                named += 1
                continue
            if t.snapshot(snap.id) is not None and not t.has_children(snap.id):
                t.delete_snapshot(snap.id)
                gone.append(snap.id)
        t.delete_identity(ident_id)  # only once it holds no snapshot
        kept = t.identity_key(ident_id) is not None
        if gone or not kept:
            drops.append(IdentityDrop(key, fields, tuple(gone), before - t.stored_bytes(), kept, named))
    count = sum(len(d.snapshots) for d in drops)
    if count:
        t.add_counter("stale_dropped", count)
    return drops


def drop_stale(t: Txn, keep: str, live: Liveness) -> list[IdentityDrop]:
    """The staleness rule (invariant 7), for the identity *key* ``keep``: drop every other identity
    of the same model and configuration (the same ``pack`` and ``extra``: a rebuilt engine, another
    kv mode or draft setting). Another model's identities are another program's and stay (the
    budget's LRU evicts their snapshots like any), and so do the same model's under other ``extra``
    keys (another program's runtime settings, LoRA, tenant configuration: they may be running now);
    so does one whose fields cannot be read, and so do named snapshots (with their chains: kept,
    counted in the budget, listed by inspect). Open-time housekeeping (``drop_stale=True``) and
    ``gc --keep-identity`` both apply this one function. ``keep`` not in the catalog: nothing is
    provably stale, nothing is dropped."""
    mine = next((_fields(i, canonical) for i, key, canonical, *_ in t.identities() if key == keep), None)
    if mine is None or not isinstance(mine.get("pack"), str):
        return []
    pack, extra = mine.get("pack"), mine.get("extra")
    return drop_identities(
        t, lambda key, fields: key != keep and fields.get("pack") == pack and fields.get("extra") == extra, live,
        keep_named=True)


def log_drops(drops: Iterable[IdentityDrop], why: str) -> None:
    """Log each committed identity drop, one line each (``snapstore`` logger, WARNING: data went)."""
    for d in drops:
        log.warning(d.line(why))


def expire(t: Txn, before: float) -> list[int]:
    """Drop committed leaves last used before ``before`` (and the chain links they leave bare).

    Counts every snapshot dropped as "expired".
    """
    gone: list[int] = []
    t.drop_expired_names(time.time())
    for snap in t.expired(before):
        if t.snapshot(snap.id) is None or t.has_children(snap.id):
            continue
        own, pruned = drop_subtree(t, snap.id)
        gone += own + pruned
    if gone:
        t.add_counter("expired", len(gone))
    return gone
