"""The Store: an engine's view of one store directory, bound to one identity and layout.

Short orchestrations over the stages: save (:mod:`._save`: validate, parent, plan, publish through
:mod:`._chunker`, commit), match, restore (:mod:`._plan` validates, :mod:`._restore` streams),
pending captures (commit / abandon), delete, and the lifecycle at open and close
(:mod:`._lifecycle`, the same policies gc applies). Writes go through :meth:`Repo.write` (files
freed by a transaction are unlinked after it commits) with the bookkeeping of :mod:`._bookkeeping`.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, overload

import numpy as np

from ._async_save import AsyncSaver, SaveHandle, copy_budget
from ._batch import planned_destination, restore_batch
from ._bookkeeping import Ledger
from ._buffers import Destination, PartSource, Source
from ._capacity import Capacity
from ._catalog import SnapRow, SnapState, Txn
from ._chunker import Chunker, StagingBuffer
from ._chunkfile import CODECS
from ._config import Budget, StoreOptions, store_options
from ._direct_io import direct_default
from ._errors import (
    ConfigError,
    CorruptionError,
    IdentityError,
    InvalidInputError,
    NotFoundError,
    RemoteError,
    RestoreError,
    SnapshotUnavailableError,
    SnapstoreError,
    StateError,
    StoreIOError,
)
from ._gc import GcReport
from ._identity import Identity
from ._inspect import snapshot_infos, stats_of
from ._layout import Layout
from ._lifecycle import drop_dead_pending, drop_identities, drop_subtree, evict_until, expire, supersede
from ._owner import Liveness, Owner, reap_lock_files
from ._plan import RestorePlan, build_plan
from ._prefix_match import find_prefix, match_tokens, rows_limit
from ._ramtier import RamTier
from ._refs import SnapshotRef, excluded, namespace_key, ref_namespace, snapshot_id
from ._repo import Repo
from ._restore import Damage, quarantine, stream_plan
from ._results import DeleteResult, Match, MatchDetails, RestoreResult, SaveResult, SnapshotInfo, Stats
from ._save import MAX_ATTEMPTS, WHOLE_AFTER, Retry, Saver, Skip, count_of, needs_quarantined, validate_parts
from ._tokens import TokenIndex, as_token_array, decode_tokens
from ._turn import Turn
from ._uploader import FlushResult
from ._verify import VerifyReport

__all__ = ["Store"]

T = TypeVar("T")
P = ParamSpec("P")

# Test hooks: name -> callable run at that point (tests force race windows through them; empty
# in production). "save_committed": a save's transaction has committed, its freed files not yet
# unlinked.
_HOOKS: dict[str, Callable[[], None]] = {}


def _hook(name: str) -> None:
    fn = _HOOKS.get(name)
    if fn is not None:
        fn()


def _operation(fn: Callable[Concatenate[Store, P], T]) -> Callable[Concatenate[Store, P], T]:
    """A public Store call: refused with StateError once close() began; close() waits for it."""

    def call(self: Store, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._in_operation():
            return fn(self, *args, **kwargs)

    functools.update_wrapper(call, fn)  # name, docstring and signature for help() and the docs
    return call


class Store:
    """An open snapstore directory, bound to one identity and layout. Thread-safe.

    Open with :meth:`Store.open` (``__init__`` only assigns); see docs/api.md.
    """

    def __init__(self, repo: Repo, identity: Identity, layout: Layout, budget: Budget, options: StoreOptions, *,
                 direct_io: bool = False, async_copy_bytes: int = 0) -> None:
        self._repo = repo
        self.identity = identity
        self.layout = layout
        self.budget = budget
        self.chunk_bytes = options.chunk_bytes
        self.codec = CODECS[options.codec]
        self.check_rows = options.check_rows
        self.staging_bytes = options.staging_bytes
        self.pending_lease = options.pending_lease
        self.direct_io = direct_io  # issue 12: O_DIRECT for raw chunks (see _direct_io)
        self._pool: ThreadPoolExecutor | None = None
        self._staging = StagingBuffer(options.staging_bytes, options.chunk_bytes)
        self._ram = RamTier(budget.ram_bytes or 0) if budget.ram_bytes else None
        self._ledger = Ledger(self._ram.take_hits if self._ram is not None else None)
        self._capacity = Capacity(repo.root, budget, repo.blob_path)
        self._saver = AsyncSaver(async_copy_bytes)  # issue 12: save(wait=False); no thread until a save queues
        self._remote: Any = None  # the shared tier (snapstore._remote_tier.RemoteTier) when remote= is set
        self._closed = False
        self._gate = threading.Condition()  # guards _closed and _active (calls in flight)
        self._active = 0
        self._shut = False  # close() has finished
        self._inside = threading.local()  # depth of public calls on this thread (nested calls pass)
        self._identity_id = 0
        self._lease_owner: Owner | None = None
        self._owner = ""
        self._chunker: Chunker | None = None
        self._stages: Saver | None = None
        self._gone: dict[int, str] = {}  # ids this store dropped on purpose -> why (for error messages)

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, identity: Identity, layout: Layout,
             budget: Budget | None = None, drop_stale: bool = True, chunk_bytes: int | None = None,
             codec: str | None = None, staging_bytes: int | None = None,
             check_rows: bool | None = None, pending_lease: float | None = None, remote: str | None = None,
             remote_wait: bool | None = None, direct_io: bool | None = None,
             async_copy_bytes: int | None = None) -> Store:
        """Open (creating if needed) the store at ``path`` for ``identity``.

        path: None → ``$SNAPSTORE_DIR``, else the per-user cache dir. drop_stale: remove every
        snapshot of other identities now (one transaction, no chunk-file scan). chunk_bytes
        (``SNAPSTORE_CHUNK_MIB``, 32 MiB), codec (``SNAPSTORE_CODEC``: raw | zstd | zstd-shuffle2;
        raw), staging_bytes (``SNAPSTORE_STAGING_MIB``, 64 MiB), check_rows
        (``SNAPSTORE_CHECK_ROWS=1``: verify the rows a delta vouches for against the parent chain),
        pending_lease (``SNAPSTORE_PENDING_LEASE_S``, 300 s: how long this store's pending captures
        outlive a stalled renewal, as seen from another host; docs/format.md "Owners and liveness"),
        direct_io (``SNAPSTORE_DIRECT_IO``, on: raw chunks written with O_DIRECT where the file system
        allows it; docs/benchmarks.md has the trade-off), async_copy_bytes
        (``SNAPSTORE_ASYNC_COPY_MIB``, 1024 MiB: what saves with ``wait=False`` may hold copied).
        remote (``SNAPSTORE_REMOTE``): ``s3://BUCKET/PREFIX``, a shared tier behind this local one;
        remote_wait (``SNAPSTORE_REMOTE_WAIT=1``): save() waits for the bucket (docs/engine.md).
        """
        if not isinstance(identity, Identity):
            raise ConfigError("Store.open needs identity=snapstore.Identity(...)")
        if not isinstance(layout, Layout):
            raise ConfigError("Store.open needs layout=snapstore.Layout(...)")
        budget = (budget or Budget()).resolved()
        options = store_options(path, chunk_bytes=chunk_bytes, codec=codec, staging_bytes=staging_bytes,
                                check_rows=check_rows, pending_lease=pending_lease, codecs=CODECS)
        direct = direct_default(direct_io)  # a bad value is a ConfigError before anything is created
        copy = copy_budget(async_copy_bytes)
        repo = Repo.open(options.root)
        store = cls(repo, identity, layout, budget, options, direct_io=direct, async_copy_bytes=copy)
        try:
            store._start(drop_stale=drop_stale, remote=remote, remote_wait=remote_wait)
        except BaseException:
            store._teardown()
            raise
        return store

    def _start(self, *, drop_stale: bool, remote: str | None = None, remote_wait: bool | None = None) -> None:
        """The I/O of opening: the identity row, the owner (lock file, lease thread), housekeeping,
        then the shared tier (``remote``)."""
        repo = self._repo
        self._ensure_identity()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snapstore")
        self._chunker = Chunker(repo.blob_path, repo.tmp, self.chunk_bytes, self.codec, self._staging, self._pool,
                                repo.db, direct=self.direct_io)
        self._lease_owner = Owner(repo.db, repo.root, self.pending_lease)
        self._owner = self._lease_owner.token
        self._stages = Saver(layout=self.layout, identity_key=self.identity.key, owner=self._owner,
                            chunk_bytes=self.chunk_bytes, chunker=self._chunker, capacity=self._capacity,
                            blob_path=repo.blob_path, renew=self._lease_owner.renew, mine=self._mine)
        self._housekeeping(drop_stale=drop_stale)
        from ._remote_tier import open_remote  # imported on demand: obstore only where remote= is used
        self._remote = open_remote(remote, repo, self.identity, self._owner, self._ledger.count, remote_wait)

    def _teardown(self) -> None:
        """Release what :meth:`_start` acquired (a failed open)."""
        try:
            if self._lease_owner is not None:
                self._lease_owner.release()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        finally:
            self._repo.close()

    @property
    def path(self) -> str:
        """The store directory."""
        return self._repo.root

    def _housekeeping(self, *, drop_stale: bool) -> None:
        """At open: drop pending captures of dead owners, stale identities, expired snapshots."""
        now = time.time()
        ttl = self.budget.ttl
        dead_owners: list[str] = []

        def run(t: Txn) -> None:
            live = Liveness(self._repo.root, t, self.pending_lease, now)
            _, _, dead = drop_dead_pending(t, live)
            dead_owners[:] = dead
            if drop_stale:
                drop_identities(t, lambda key: key != self.identity.key, live)
            if ttl:
                expire(t, now - ttl)

        self._write(run)
        reap_lock_files(self._repo.root, dead_owners)

    # -- helpers -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the store is closed; open it again with Store.open()")

    @contextmanager
    def _in_operation(self) -> Iterator[None]:
        """Count a public call in flight; StateError once close() has begun."""
        depth = getattr(self._inside, "depth", 0)
        if depth == 0:
            with self._gate:
                if self._closed:
                    raise StateError("the store is closed (or closing); open it again with Store.open()")
                self._active += 1
        self._inside.depth = depth + 1
        try:
            yield
        finally:
            self._inside.depth = depth
            if depth == 0:
                with self._gate:
                    self._active -= 1
                    if self._active == 0:
                        self._gate.notify_all()

    def _ensure_identity(self) -> int:
        """Create (or refresh) this identity's row in a transaction of its own, and cache the id
        only once that transaction has committed.

        Never inside a larger transaction: a row created there and rolled back (a skipped save)
        would hand its id to the next identity that opens, while this store kept it cached.
        """
        now = time.time()
        iid = self._repo.db.write(lambda t: t.ensure_identity(self.identity.key, self.identity.canonical, now))
        self._identity_id = iid
        return iid

    def _iid(self, t: Txn) -> int:
        """This identity's row id as of this transaction; Retry(identity_gone) when another process
        dropped it as stale (the caller re-creates it with :meth:`_ensure_identity` and redoes)."""
        row = t.identity_id(self.identity.key)
        if row is None:
            raise Retry(identity_gone=True)
        return row

    def _mine(self, t: Txn, snap: SnapRow) -> bool:
        """Does ``snap`` belong to this store's identity? Decided by the identity *key*, not the id."""
        return t.identity_key(snap.identity_id) == self.identity.key

    def _write(self, fn: Callable[[Txn], T], *, durable: bool = True, discard: Iterable[bytes] = (),
               committed: Callable[[], None] | None = None) -> T:
        """A write transaction through :meth:`Repo.write` (freed files unlinked after the commit) that
        also persists what this store recorded in memory — before ``fn``, so eviction in ``fn``
        sees recent use. The bookkeeping is taken out of the ledger and given back if the
        transaction fails, so a retried or rolled-back transaction neither loses nor doubles it.
        """
        batch = self._ledger.take()

        def run(t: Txn) -> T:
            batch.apply(t)
            return fn(t)

        try:
            return self._repo.write(run, durable=durable, discard=discard, committed=committed,
                                    deferred=lambda: self._ledger.count("unlink_deferred"))
        except BaseException:
            self._ledger.give_back(batch)
            raise

    def _try_flush(self) -> None:
        """Persist the bookkeeping now if the write lock is free; otherwise leave it for later."""
        batch = self._ledger.take()
        try:
            ran, _ = self._repo.db.try_write(batch.apply)
        except SnapstoreError:
            ran = False  # bookkeeping only: a full disk must not fail a restore that worked
        if not ran:
            self._ledger.give_back(batch)

    def _tokens_of(self, t: Txn, chain: list[SnapRow]) -> np.ndarray:
        segs = [decode_tokens(s.tokens, s.token_width, s.n_tokens - s.base_tokens) for s in chain]
        return np.concatenate(segs) if segs else np.zeros(0, dtype="<u8")

    def _own(self, t: Txn, snap: SnapRow | None, namespace: str | None = None) -> SnapRow:
        """The one ownership check: ``snap`` exists, is of this identity and of ``namespace``."""
        if snap is None:
            raise NotFoundError("no such snapshot (evicted, superseded, abandoned or never saved)")
        if not self._mine(t, snap):
            raise IdentityError(f"snapshot {snap.id} belongs to another identity than this store was opened for")
        if namespace is not None and snap.namespace != namespace:
            raise IdentityError(f"snapshot {snap.id} belongs to another namespace")
        return snap

    # -- save --------------------------------------------------------------------------------
    # issue 12: save(wait=False) -> SaveHandle (snapstore/_async_save.py)
    @overload
    def save(self, tokens: Any, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: Literal[True] = True) -> SaveResult: ...

    @overload
    def save(self, tokens: Any, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: Literal[False]) -> SaveHandle: ...

    @overload
    def save(self, tokens: Any, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: bool) -> SaveResult | SaveHandle: ...

    def save(self, tokens: Any, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: bool = True) -> SaveResult | SaveHandle:
        """Save the state after ``tokens``; a delta over ``parent`` ("auto", None or an id).

        Returns a SaveResult; a save that does not fit the budget is skipped with a reason.
        ``wait=False``: returns a SaveHandle at once and writes in the background (docs/api.md).
        """
        if not wait:
            kw = {"session": session, "parent": parent, "commit": commit, "namespace": namespace}
            with self._in_operation():
                return self._saver.submit(self, tokens, parts, rows, kw)
        return self._save(tokens, parts, rows, session=session, parent=parent, commit=commit, namespace=namespace)

    def _validate_parts(self, parts: Mapping[str, Any], rows: Any, n: int
                        ) -> tuple[dict[str, Source], dict[str, int]]:
        """Stage 1 of a save for this store's layout (also run by ``save(wait=False)`` before it queues)."""
        return validate_parts(self.layout, parts, rows, n)

    @_operation
    def _save(self, tokens: Any, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
              session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
              namespace: str | None = None) -> SaveResult:
        """The synchronous save (``save(wait=True)``)."""
        arr = as_token_array(tokens)
        n = len(arr)
        if n == 0:
            raise InvalidInputError("save() needs at least one token")
        if session is not None and (not isinstance(session, str) or not session):
            raise InvalidInputError(f"session must be None or a non-empty string, got {session!r}")
        ns = namespace_key(namespace)
        sources, row_counts = self._validate_parts(parts, rows, n)
        index = TokenIndex(arr)
        for attempt in range(MAX_ATTEMPTS):
            # "auto" whose parent keeps being evicted under it: after WHOLE_AFTER tries store it whole
            use = None if parent == "auto" and attempt >= WHOLE_AFTER else parent
            try:
                res = self._save_once(arr, index, sources, row_counts, session, use, commit, ns)
                self._remote_saved(res)
                return res
            except Retry as r:
                if r.identity_gone:
                    self._ensure_identity()  # committed on its own before the save is redone
                if r.parent_gone and use not in ("auto", None):
                    raise NotFoundError(f"parent {snapshot_id(use)} was removed (evicted, superseded or "
                                        "abandoned) during the save; save again with parent='auto'") from None
        raise StateError(f"save() lost a race with concurrent evictions {MAX_ATTEMPTS} times; try again")

    def _save_once(self, arr: np.ndarray, index: TokenIndex, sources: dict[str, Any], row_counts: dict[str, int],
                   session: str | None, parent: Any, commit: bool, ns: str) -> SaveResult:
        """One attempt: parent, plan, capacity pre-check, publish, commit (Retry / Skip / saved)."""
        saver = self._stages
        assert saver is not None and self._chunker is not None
        n = len(arr)
        db = self._repo.db
        par, prows = db.read(lambda t: saver.resolve_parent(t, parent, index, ns, row_counts, commit))
        vouched = par
        if vouched is not None and self.check_rows and not db.read(
                lambda t: saver.rows_vouched(t, vouched, prows, sources)):
            self._ledger.count("rows_mismatch")
            if parent != "auto":
                raise InvalidInputError(
                    f"check_rows: rows below parent {vouched.id}'s boundary differ from what it stored; "
                    "the engine changed rows it vouched for (save with parent=None to store them whole)")
            par, prows = None, {}
        plan = saver.plan(sources, row_counts, par, prows, ns)
        reason = self._capacity.precheck(plan.upper_bytes, db.read(lambda t: t.stored_bytes()))
        if reason is not None:
            return self._skipped(reason, par, plan.logical_bytes, n, ns)
        refs = self._chunker.store(plan.pieces)
        created = [r.id for rs in refs for r in rs if r.created]
        try:
            done = self._write(lambda t: saver.commit(t, iid=self._iid(t), plan=plan, refs=refs, arr=arr,
                                                      index=index, session=session, commit=commit, ns=ns),
                               discard=created, committed=lambda: _hook("save_committed"))
        except Skip as s:
            return self._skipped(s.reason, par, plan.logical_bytes, n, ns)
        return SaveResult(snapshot_id=done.snapshot_id, skipped=None, parent_id=done.parent_id,
                          stored_bytes=0 if done.existed else done.new_bytes, logical_bytes=plan.logical_bytes,
                          n_tokens=n, pending=not commit and not done.existed, namespace=ns or None)

    def _skipped(self, reason: str, par: SnapRow | None, logical: int, n: int, ns: str) -> SaveResult:
        self._repo.db.write(lambda t: t.add_counter(f"skipped:{reason}", 1))
        return SaveResult(snapshot_id=None, skipped=reason, parent_id=par.id if par else None, stored_bytes=0,
                          logical_bytes=logical, n_tokens=n, pending=False, namespace=ns or None)

    # -- pending captures --------------------------------------------------------------------
    @_operation
    def commit(self, res: SnapshotRef, *, namespace: str | None = None) -> SaveResult:
        """Make a pending capture (and its pending ancestors, root first) visible to match().

        Refused for the budget: the capture and its own pending descendants are dropped; its
        pending ancestors stay pending (their other children untouched) — invariant 5.
        """
        sid = snapshot_id(res)
        ns = ref_namespace(res, namespace)
        now = time.time()

        def done(snap: SnapRow) -> SaveResult:
            return SaveResult(snapshot_id=sid, skipped=None, parent_id=snap.parent_id, stored_bytes=0,
                              logical_bytes=snap.logical_bytes, n_tokens=snap.n_tokens, namespace=ns or None)

        def txn(t: Txn) -> SaveResult:
            snap = self._own(t, t.snapshot(sid), ns)
            if snap.state == SnapState.COMMITTED:
                return done(snap)
            if snap.owner != self._owner:
                raise StateError(f"snapshot {sid} is a pending capture of another process")
            chain = self._chain(t, snap)
            tokens = self._tokens_of(t, chain)
            for link in chain:
                if link.state == SnapState.COMMITTED:
                    continue
                t.set_state(link.id, SnapState.COMMITTED, None, now)
                new = t.snapshot(link.id)
                assert new is not None
                supersede(t, new, TokenIndex(tokens[:link.n_tokens]))
            ok, _ = evict_until(t, lambda _freed: self._capacity.excess(t) is None, {s.id for s in chain})
            if not ok:
                raise Skip(self._capacity.excess(t) or "disk_reserve")
            return done(snap)

        try:
            result = self._write(txn)
        except Skip as s:
            self._drop_mine(sid, refused=True)
            return self._skipped(s.reason, None, 0, 0, ns)
        self._remote_saved(result)
        return result

    def _remote_saved(self, res: SaveResult) -> None:
        """Shared-tier hook: a committed snapshot is durable locally; upload it (queued, or now in wait mode)."""
        if self._remote is not None and res.snapshot_id is not None and not res.pending:
            self._remote.saved(res.snapshot_id)

    def _drop_mine(self, sid: int, *, refused: bool) -> None:
        """Drop this store's pending capture ``sid`` and its pending descendants, nothing else."""

        def txn(t: Txn) -> None:
            snap = t.snapshot(sid)
            if snap is None or snap.state == SnapState.COMMITTED or snap.owner != self._owner:
                return  # committed meanwhile by another thread of this store, or already gone
            gone, _ = drop_subtree(t, sid)
            t.add_counter("abandoned", len(gone))

        self._write(txn)

    @_operation
    def abandon(self, res: SnapshotRef, *, namespace: str | None = None) -> None:
        """Drop a pending capture and its pending descendants; their pins and bytes are released."""
        sid = snapshot_id(res)
        ns = ref_namespace(res, namespace)

        def txn(t: Txn) -> None:
            snap = t.snapshot(sid)
            if snap is None:
                return
            self._own(t, snap, ns)
            if snap.state == SnapState.COMMITTED:
                raise StateError(f"snapshot {sid} is committed; abandon() only drops pending captures "
                                 "(delete() drops committed snapshots)")
            if snap.owner != self._owner:
                raise StateError(f"snapshot {sid} is a pending capture of another process")
            gone, _ = drop_subtree(t, sid)
            t.add_counter("abandoned", len(gone))
            self._note_gone(gone, f"abandoned: its turn was abandoned (abandon({sid}))")

        self._write(txn)

    def _note_gone(self, ids: Iterable[int], why: str) -> None:
        """Remember why this store dropped ``ids`` (bounded), so a later restore can say so."""
        for i in ids:
            self._gone[i] = why
        while len(self._gone) > 4096:
            del self._gone[next(iter(self._gone))]

    def _gone_why(self, sid: int) -> str:
        return self._gone.get(sid, "evicted for the budget, superseded within its session, deleted, or a pending "
                                   "capture that was abandoned or whose process is gone")

    @_operation
    def delete(self, ref: SnapshotRef, *, namespace: str | None = None) -> DeleteResult:
        """Drop a snapshot of this identity and every descendant; returns what went.

        ``ref`` is a snapshot id, Match or SaveResult. Superseded ancestors left without children
        go too (they were only chain links). Refused with StateError while a live process has a
        pending capture in the subtree (it would lose the parent it is extending); a dead owner's
        capture goes with the subtree (the liveness rule of :mod:`._owner`).
        """
        sid = snapshot_id(ref)
        ns = ref_namespace(ref, namespace)

        def txn(t: Txn) -> DeleteResult:
            snap = self._own(t, t.snapshot(sid), ns)
            live = Liveness(self._repo.root, t, self.pending_lease)
            for d in [sid, *t.descendants(sid)]:
                row = t.snapshot(d)
                if row is not None and row.state == SnapState.PENDING and row.owner != self._owner \
                        and live.alive(row.owner, row.created):
                    raise StateError(f"snapshot {d} (in the subtree of {snap.id}) is a pending capture of "
                                     "another process; delete it after that capture is committed or abandoned")
            before = t.stored_bytes()
            gone, pruned = drop_subtree(t, sid)
            t.add_counter("deleted", len(gone) + len(pruned))
            self._note_gone(gone + pruned, f"deleted (delete({sid}))")
            return DeleteResult(tuple(gone + pruned), before - t.stored_bytes())

        return self._write(txn)

    # -- match -------------------------------------------------------------------------------
    @_operation
    def match(self, tokens: Any, *, namespace: str | None = None,
              exclude: Iterable[SnapshotRef] | None = ()) -> Match | None:
        """The longest committed snapshot whose tokens are a prefix of ``tokens``, or None.

        ``exclude``: snapshot ids (or Match / SaveResult) to pass over (None: none) — after a failed restore,
        match again excluding it to fall back to the next-longest prefix.
        """
        arr = as_token_array(tokens)
        ns = namespace_key(namespace)
        skip = excluded(exclude)
        if len(arr) == 0:
            return None
        index = TokenIndex(arr)
        not_before = time.time() - self.budget.ttl if self.budget.ttl else 0.0

        def find(c: Txn) -> tuple[SnapRow, int] | None:
            broken = c.quarantined_users()
            exact: tuple[SnapRow, int] | None = None
            for sid, cn, key in c.match_candidates(self.identity.key, ns, index.chain, len(arr),
                                                          not_before):
                if key != index.prefix_key(cn) or sid in skip:
                    continue
                chain = c.chain(sid)
                if needs_quarantined(chain, broken, leaf=True):
                    continue  # it cannot restore until a save heals its chunk: the next-longest serves
                if np.array_equal(self._tokens_of(c, chain), arr[:cn]):
                    exact = (chain[-1], cn)
                    break
            # -- block-granular prefixes (_prefix_match.py): rows [0, k) of any longer snapshot --
            def usable(snap: SnapRow, k: int) -> bool:
                chain = c.chain(snap.id)
                return snap.id not in skip and snap.last_used >= not_before and not needs_quarantined(
                    chain, broken, leaf=True) and np.array_equal(self._tokens_of(c, chain)[:k], arr[:k])
            more = find_prefix(c, self.layout, self.identity.key, ns, arr, exact[1] if exact else 0, usable)
            return (more.snap, more.n_tokens) if more is not None else exact

        found = self._repo.db.read(find)
        if self._remote is not None:  # the shared tier, when it may hold something longer
            far = self._remote.lookup(arr, ns, found[1] if found is not None else 0)
            if far is not None:
                return far  # type: ignore[no-any-return]
        if found is None:
            self._ledger.count("misses")
            return None
        hit, n_hit = found
        self._ledger.count("hits")
        self._ledger.count("hit_tokens", n_hit)
        return Match(hit.id, n_hit, namespace)

    # -- restore -----------------------------------------------------------------------------
    def _chain(self, c: Txn, snap: SnapRow) -> list[SnapRow]:
        """``snap``'s chain, root first; every link must be of this identity (by key) and of the
        snapshot's namespace, so a damaged or reused parent link can never serve another's rows."""
        chain = c.chain(snap.id)
        for link in chain:
            if link.namespace != snap.namespace or (link.identity_id != snap.identity_id
                                                    and not self._mine(c, link)):
                raise SnapshotUnavailableError(
                    f"snapshot {snap.id}: chain link {link.id} belongs to another identity or namespace; "
                    "nothing was written (run `snapstore verify`)", snapshot_id=snap.id)
        return chain

    def _wanted(self, components: Iterable[str] | None) -> set[str]:
        if isinstance(components, str):
            raise InvalidInputError(f"components must be a collection of names, e.g. [{components!r}]")
        wanted = set(self.layout.components) if components is None else set(components)
        unknown = wanted - set(self.layout.components)
        if unknown:
            raise InvalidInputError(f"unknown components {sorted(unknown)}; the layout has "
                                    f"{sorted(self.layout.components)}")
        return wanted

    def _plan(self, c: Txn, sid: int, ns: str, into: Mapping[str, Destination] | None,
              wanted: set[str], rows_from: int = 0, upto: int | None = None) -> tuple[SnapRow, RestorePlan]:
        """Check that ``sid`` is this store's to restore and build (and validate) its plan."""
        snap = c.snapshot(sid)
        if snap is None:
            raise SnapshotUnavailableError(f"snapshot {sid} no longer exists ({self._gone_why(sid)}); "
                                           "nothing was written", snapshot_id=sid)
        if not self._mine(c, snap):
            raise IdentityError(f"snapshot {sid} belongs to another identity than this store was opened for")
        if snap.namespace != ns:
            raise IdentityError(f"snapshot {sid} belongs to another namespace")
        if snap.state == SnapState.PENDING and snap.owner != self._owner:
            raise SnapshotUnavailableError(f"snapshot {sid} is a pending capture of another process",
                                           snapshot_id=sid)
        if rows_from < 0 or rows_from > snap.n_tokens:
            raise InvalidInputError(f"rows_from={rows_from} is outside snapshot {sid}'s [0, {snap.n_tokens}] tokens")
        rows_to = rows_limit(self.layout, snap, upto)  # a block-granular prefix match: rows [0, rows_to)
        return snap, build_plan(c, sid, self._chain(c, snap), self.layout, into, wanted, rows_from, rows_to)

    @_operation
    def restore(self, m: SnapshotRef, into: Mapping[str, Destination] | Callable[[MatchDetails], Mapping[str, Any]],
                components: Iterable[str] | None = None, *, namespace: str | None = None,
                rows_from: int = 0) -> RestoreResult:
        """Write the snapshot's state into ``into`` (name → writable buffer), exactly, or raise.

        ``m`` is a Match (its namespace applies), a SaveResult or a snapshot id (then ``namespace``
        must name the snapshot's namespace). ``into`` may be a callable: it gets the checked plan
        (``describe``) and returns the mapping (plan, then write). ``rows_from``: rows the engine
        already holds, not written. Raises a RestoreError whose ``touched`` says whether ``into``
        was modified.
        """
        if self._remote is not None and getattr(m, "remote", None) is not None:
            # a shared-tier match: fetch its missing chunks (verified) into the local tier first
            try:
                m = self._remote.materialize(m, lambda t, _freed: self._capacity.excess(t) is None, self._iid)
            except Retry:
                raise SnapshotUnavailableError("this store's identity was dropped as stale by another store "
                                               "during the fetch; match again", snapshot_id=None) from None
        sid = snapshot_id(m)
        ns = ref_namespace(m, namespace)
        k = count_of(rows_from, "rows_from")
        wanted = self._wanted(components)
        t0 = time.perf_counter()
        if callable(into) and not isinstance(into, Mapping):  # plan, then write: see _batch.py
            into = planned_destination(self.describe(m, components, namespace=ns or None, rows_from=k), into)
        if not isinstance(into, Mapping):
            raise InvalidInputError("into must be a mapping of part name to writable buffer, or a callable "
                                    "that takes the plan (MatchDetails) and returns one")
        dest = into
        upto = match_tokens(m)  # a block-granular prefix match restores rows [0, upto // g) only
        _, plan = self._repo.db.read(lambda c: self._plan(c, sid, ns, dest, wanted, k, upto))
        damage: Damage = []
        try:
            stream_plan(plan, self._repo.blob_path, self._staging, self._ram, damage)
        except RestoreError as e:
            if e.snapshot_id is None:
                e.snapshot_id = sid
            self._ledger.count("restore_errors")
            if damage:  # in the same call: snapshots using it stop matching until a save heals it
                try:
                    quarantine(self._repo.db, self._repo.blob_path, damage)
                except (StoreIOError, CorruptionError):
                    pass  # a later restore finds (and quarantines) it again
            raise
        # last use and the hit are bookkeeping: recorded in memory and written now only if the
        # write lock is free; a restore never queues behind a long writer for them
        self._ledger.record_use(sid, time.time())
        self._try_flush()
        return RestoreResult(plan.n_tokens, plan.rows, frozenset(plan.missing_components), plan.chain,
                             plan.nbytes, time.perf_counter() - t0)

    @_operation
    def describe(self, m: SnapshotRef, components: Iterable[str] | None = None, *,
                 namespace: str | None = None, rows_from: int = 0) -> MatchDetails:
        """What restoring ``m`` would write — rows per stream, components, bytes — checked like a
        restore's plan but without destinations, so an engine can size its buffers first."""
        sid = snapshot_id(m)
        ns = ref_namespace(m, namespace)
        wanted = self._wanted(components)
        k = count_of(rows_from, "rows_from")

        def run(c: Txn) -> MatchDetails:
            snap, plan = self._plan(c, sid, ns, None, wanted, k, match_tokens(m))
            held = {p.component for p in c.parts(sid) if p.component is not None}
            return MatchDetails(
                snapshot_id=sid, n_tokens=plan.n_tokens, namespace=ns or None, rows=dict(plan.rows),
                components=frozenset(held), missing_components=frozenset(plan.missing_components),
                part_bytes=dict(plan.part_bytes), nbytes=sum(plan.part_bytes.values()),
                chain=list(plan.chain), pending=snap.state == SnapState.PENDING, rows_from=k)

        return self._repo.db.read(run)

    # -- batches and turns (logic in _batch.py and _turn.py) ---------------------------------
    def match_many(self, token_lists: Iterable[Any], *, namespace: str | None = None) -> list[Match | None]:
        """``match()`` for each of many prompts (a scheduler admitting a batch), in order."""
        return [self.match(t, namespace=namespace) for t in token_lists]

    @_operation
    def restore_many(self, requests: Iterable[tuple[Any, Mapping[str, Any]]], components: Iterable[str] | None = None,
                     *, namespace: str | None = None, rows_from: int = 0) -> list[RestoreResult]:
        """Restore many (match, into) pairs at once; a chunk their chains share is read once."""
        return restore_batch(self, list(requests), self._wanted(components), namespace,
                             count_of(rows_from, "rows_from"))

    def turn(self, *, session: str | None = None, namespace: str | None = None, parent: Any = "auto") -> Turn:
        """A capture chain for one turn: ``with store.turn(session=...) as t: t.capture(tokens, parts)``."""
        self._check_open()
        return Turn(self, session=session, namespace=namespace, parent=parent)

    # -- inspection --------------------------------------------------------------------------
    @_operation
    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot of this store's identity (all namespaces), oldest first."""
        return self._repo.db.read(lambda t: snapshot_infos(t, self.identity.key))

    @_operation
    def stats(self) -> Stats:
        """Counters and totals (see docs/api.md)."""
        self._write(lambda t: None, durable=False)
        return self._repo.db.read(lambda t: stats_of(t, self.budget.disk_bytes or 0,
                                                     self._ram.used if self._ram else 0))

    @_operation
    def verify(self, deep: bool = True) -> VerifyReport:
        """Check the store (see snapstore verify); returns a VerifyReport."""
        from ._verify import verify
        report = verify(self._repo, deep=deep, pending_lease=self.pending_lease)
        if self._ram is not None:
            for cid in report.damaged_chunks:
                self._ram.discard(cid)
        return report

    @_operation
    def gc(self, *, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
        """Collect orphan and temp files, dead pending captures, expired snapshots, over-budget leaves."""
        from ._gc import gc
        return gc(self._repo, budget=self.budget, grace=grace, dry_run=dry_run, pending_lease=self.pending_lease)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Wait for every save made with ``wait=False`` so far, then (with a shared tier) for their
        uploads. A FlushResult (uploads published/failed/dropped); false when ``timeout`` ran out."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._saver.flush(timeout):
            return FlushResult(timed_out=True)
        if self._remote is None:
            return FlushResult()
        try:
            res: FlushResult = self._remote.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
            return res
        except RemoteError as e:
            if e.errno != 110:
                raise
            return FlushResult(timed_out=True, errors=[str(e)])

    def close(self) -> None:
        """Abandon this store's pending captures (and dead owners'), flush counters, release resources.

        Safe against other threads: calls that start after close() began raise StateError; calls
        already running finish first (close waits for them). Idempotent; a second close() (from
        any thread) returns once the first has finished.
        """
        if getattr(self._inside, "depth", 0):
            raise StateError("close() was called from inside a call on this same store (a part source "
                             "or destination?); close the store after that call returns")
        self._saver.close()  # issue 12: saves made with wait=False finish first
        with self._gate:
            if self._closed:
                while not self._shut:
                    self._gate.wait()
                return
            self._closed = True  # from here on every new call raises StateError
            while self._active:
                self._gate.wait()
        dead_owners: list[str] = []
        owner, pool = self._lease_owner, self._pool
        assert owner is not None and pool is not None  # set by open(); a Store is only handed out open
        try:
            if self._remote is not None:
                try:
                    self._remote.close()  # finishes the queued uploads first
                finally:
                    self._remote = None
            owner.stop()  # no renewal may re-register the row this transaction deletes

            def txn(t: Txn) -> None:
                mine = 0
                for snap in t.pending():
                    if snap.owner == self._owner and t.snapshot(snap.id) is not None:
                        gone, _ = drop_subtree(t, snap.id)
                        mine += len(gone)
                if mine:
                    t.add_counter("abandoned", mine)
                owner.retire(t)
                _, _, dead = drop_dead_pending(t, Liveness(self._repo.root, t, self.pending_lease))
                dead_owners[:] = dead

            if not owner.inherited:  # a forked child's copy: the parent's captures and row stay
                self._write(txn)
        finally:
            try:
                owner.release()  # after the transaction: our captures are gone before the lock is free
                reap_lock_files(self._repo.root, dead_owners)
                pool.shutdown(wait=True)
                if self._ram is not None:
                    self._ram.clear()
                self._repo.close()
            finally:
                with self._gate:
                    self._shut = True
                    self._gate.notify_all()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
