"""Which snapshots a store may read or change: the one ownership check, the chain-link check, the
restorable check, and why this store dropped the ids it no longer finds (for error messages).

A snapshot is this store's when its identity *key* (not the row id, which another identity may
come to reuse) is the store's, and its namespace is the one asked for. Every Store call that names
a snapshot goes through :meth:`Access.own` or :meth:`Access.readable`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from snapstore._errors import IdentityError, InvalidInputError, NotFoundError, SnapshotUnavailableError
from snapstore._identity import Identity
from snapstore.catalog.chain_cache import ChainReads
from snapstore.catalog.db import Database
from snapstore.catalog.queries import SnapRow, SnapState, Txn

__all__ = ["Access", "Retry"]

_GONE_NOTES = 4096  # ids remembered with the reason they went (oldest forgotten first)
_GONE_DEFAULT = ("evicted for the budget, superseded within its session, deleted, or a pending "
                 "capture that was abandoned or whose process is gone")


class Retry(Exception):
    """The commit found a chunk file gone (concurrent eviction), the parent gone, or this store's
    identity row dropped by another process (re-created in its own transaction first): redo."""

    def __init__(self, parent_gone: bool = False, identity_gone: bool = False) -> None:
        super().__init__()
        self.parent_gone = parent_gone
        self.identity_gone = identity_gone


class Access:
    """One store's identity (by key) and owner token, and the checks made against them."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.identity_key = identity.key
        self.owner = ""  # the owner token, set once the store's owner exists (Store._start)
        self._gone: dict[int, str] = {}  # ids this store dropped on purpose -> why

    def ensure_identity(self, db: Database) -> int:
        """Create (or refresh) this identity's row in a transaction of its own; its row id.

        Never inside a larger transaction: a row created there and rolled back (a skipped save)
        would hand its id to the next identity that opens, while this store relied on it.
        """
        now = time.time()
        return db.write(lambda t: t.ensure_identity(self.identity_key, self.identity.canonical, now))

    def iid(self, t: Txn) -> int:
        """This identity's row id as of this transaction; Retry(identity_gone) when another process
        dropped it as stale (the caller re-creates it and redoes the transaction)."""
        row = t.identity_id(self.identity_key)
        if row is None:
            raise Retry(identity_gone=True)
        return row

    def mine(self, t: Txn | ChainReads, snap: SnapRow) -> bool:
        """Does ``snap`` belong to this store's identity? Decided by the identity *key*, not the id."""
        return t.identity_key(snap.identity_id) == self.identity_key

    def own(self, t: Txn, snap: SnapRow | None, namespace: str | None = None) -> SnapRow:
        """The one ownership check: ``snap`` exists, is of this identity and of ``namespace``."""
        if snap is None:
            raise NotFoundError("no such snapshot (evicted, superseded, abandoned or never saved)")
        return self._owned(snap, t.identity_key(snap.identity_id), namespace)

    def _owned(self, snap: SnapRow, key: str | None, namespace: str | None) -> SnapRow:
        """:meth:`own` given the key of ``snap``'s identity row (None: gone)."""
        if key != self.identity_key:
            raise IdentityError(f"snapshot {snap.id} belongs to another identity than this store was opened for")
        if namespace is not None and snap.namespace != namespace:
            raise IdentityError(f"snapshot {snap.id} belongs to another namespace")
        return snap

    def chain(self, c: Txn | ChainReads, snap: SnapRow) -> list[SnapRow]:
        """``snap``'s chain, root first; every link must be of this identity (by key) and of the
        snapshot's namespace, so a damaged or reused parent link can never serve another's rows."""
        chain = c.chain(snap.id)
        for link in chain:
            if link.namespace != snap.namespace or (link.identity_id != snap.identity_id
                                                    and not self.mine(c, link)):
                raise SnapshotUnavailableError(
                    f"snapshot {snap.id}: chain link {link.id} belongs to another identity or namespace; "
                    "nothing was written (run `snapstore verify`)", snapshot_id=snap.id)
        return chain

    def readable(self, c: Txn | ChainReads, sid: int, ns: str, rows_from: int) -> SnapRow:
        """Snapshot ``sid`` if this store may restore it from ``rows_from`` on (ownership, not another
        process's pending capture, rows_from within it); else the error that says why not."""
        found = c.snapshot_and_key(sid)  # the row and its identity's key: one statement
        if found is None:
            raise SnapshotUnavailableError(f"snapshot {sid} no longer exists ({self.gone_why(sid)}); "
                                           "nothing was written", snapshot_id=sid)
        snap = self._owned(found[0], found[1], ns)
        if snap.state == SnapState.PENDING and snap.owner != self.owner:
            raise SnapshotUnavailableError(f"snapshot {sid} is a pending capture of another process",
                                           snapshot_id=sid)
        if rows_from < 0 or rows_from > snap.n_tokens:
            raise InvalidInputError(f"rows_from={rows_from} is outside snapshot {sid}'s [0, {snap.n_tokens}] tokens")
        return snap

    def note_gone(self, ids: Iterable[int], why: str) -> None:
        """Remember why this store dropped ``ids`` (bounded), so a later restore can say so."""
        for i in ids:
            self._gone[i] = why
        while len(self._gone) > _GONE_NOTES:
            del self._gone[next(iter(self._gone))]

    def gone_why(self, sid: int) -> str:
        """Why ``sid`` is gone, as far as this store knows."""
        return self._gone.get(sid, _GONE_DEFAULT)
