"""The Store's named snapshots: ``name``, ``named``, ``unname`` (a base of :class:`snapstore.Store`,
which supplies the attributes declared here; the rules are :mod:`snapstore.lifecycle.naming`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from snapstore._refs import SnapshotRef, namespace_key, ref_namespace, snapshot_id
from snapstore._results import Match
from snapstore.catalog.queries import Txn
from snapstore.chunks.repo import Repo
from snapstore.lifecycle.access import Access
from snapstore.lifecycle.naming import check_name, check_ttl, name_snapshot, resolve_name, unname
from snapstore.store.gate import CallGate, operation

__all__ = ["StoreNames"]

T = TypeVar("T")


class StoreNames:
    """name(), named(), unname(): names that pin snapshots, per identity and namespace (docs/api.md)."""

    _repo: Repo
    _gate: CallGate
    _access: Access

    def _write(self, fn: Callable[[Txn], T], *, durable: bool = True) -> T:
        raise NotImplementedError  # the Store's write transaction (bookkeeping included)

    @operation
    def name(self, ref: SnapshotRef, name: str, *, ttl_s: float | None = None, namespace: str | None = None) -> None:
        """Pin a committed snapshot (and so its chain) under ``name`` in its namespace: never evicted,
        expired or superseded while named; ``ttl_s``: the name ends after that many seconds."""
        sid, ns = snapshot_id(ref), ref_namespace(ref, namespace)
        nm, ttl = check_name(name), check_ttl(ttl_s)
        self._write(lambda t: name_snapshot(t, self._access, sid, ns, nm, ttl, time.time()))

    @operation
    def named(self, name: str, *, namespace: str | None = None) -> Match | None:
        """The snapshot ``name`` pins in ``namespace`` (this identity's), as a Match to restore; None if none."""
        nm, ns = check_name(name), namespace_key(namespace)

        def find(t: Txn) -> Match | None:
            sid = resolve_name(t, self._access, ns, nm, time.time())
            snap = t.snapshot(sid) if sid is not None else None
            return Match(snap.id, snap.n_tokens, namespace) if snap is not None else None

        return self._repo.db.read(find)

    @operation
    def unname(self, name: str, *, namespace: str | None = None) -> bool:
        """Remove ``name`` (the snapshot stays, evictable again); whether the name existed."""
        nm, ns = check_name(name), namespace_key(namespace)
        return self._write(lambda t: unname(t, self._access, ns, nm))
