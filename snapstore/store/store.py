"""The Store: an engine's view of one store directory, bound to one identity and layout.

Short orchestrations over the subsystem packages (docs/design.md, "Layers"): save (:mod:`snapstore.save`),
match and restore plans (:mod:`snapstore.plan`), restore (:mod:`snapstore.restore`), the lifecycle
transactions and other calls (:mod:`snapstore.store`, over the policies of :mod:`snapstore.lifecycle`).
Writes go through :meth:`Repo.write`, which unlinks the files a transaction freed after it commits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar, overload

from snapstore._config import Budget, StoreOptions, resolved_budget, store_options
from snapstore._errors import ConfigError, InvalidInputError, StateError
from snapstore._identity import Identity
from snapstore._layout import Layout
from snapstore._numbers import wait_seconds
from snapstore._refs import SnapshotRef, excluded, namespace_key, ref_namespace, session_key, snapshot_id
from snapstore._results import DeleteResult, Match, SaveResult
from snapstore._tokens import TokensLike, as_token_array
from snapstore.catalog.queries import Txn
from snapstore.chunks.chunkfile import CODECS
from snapstore.chunks.direct_io import direct_default, direct_reads_setting
from snapstore.chunks.repo import Repo
from snapstore.chunks.staging import StagingBuffer
from snapstore.lifecycle.access import Access
from snapstore.lifecycle.admission import Admission, admission_of
from snapstore.lifecycle.bookkeeping import Ledger, write_with
from snapstore.lifecycle.capacity import Capacity
from snapstore.lifecycle.liveness import reap_lock_files
from snapstore.lifecycle.owner import Owner
from snapstore.lifecycle.rules import log_drops
from snapstore.parts.buffers import PartSource
from snapstore.plan.match import Prompt, best_match
from snapstore.remote.uploader import FlushResult, flush_all
from snapstore.restore.hot import HotRestores
from snapstore.restore.read_path import ReadPaths
from snapstore.save.asynchronous import AsyncSaver, SaveHandle, copy_budget
from snapstore.save.chain import parent_after
from snapstore.save.chunker import Chunker
from snapstore.save.run import HOOKS as _HOOKS  # noqa: F401  (tests set race-window hooks as _store._HOOKS)
from snapstore.save.run import SaveRun, skipped
from snapstore.save.stages import Saver, Skip
from snapstore.save.token_keys import TokenKeys
from snapstore.store.batch import StoreBatches
from snapstore.store.gate import CallGate, operation
from snapstore.store.lookup import StoreLookup
from snapstore.store.names import StoreNames
from snapstore.store.recompute import RestoreRates, StoreRecompute, choose_match
from snapstore.store.reports import StoreReports
from snapstore.store.restoring import StoreRestore
from snapstore.store.snapshot_ops import (
    abandon_capture,
    commit_capture,
    delete_subtree,
    drop_capture,
    housekeep,
    retire,
)
from snapstore.store.transfer import StoreTransfer
from snapstore.store.turn import Turn
from snapstore.tiers.stack import Tiers

__all__ = ["Store"]

T = TypeVar("T")


class Store(StoreRestore, StoreReports, StoreNames, StoreBatches, StoreTransfer, StoreRecompute, StoreLookup):
    """An open snapstore directory, bound to one identity and layout. Thread-safe.

    Open with :meth:`Store.open` (``__init__`` only assigns); see docs/api.md.
    """

    def __init__(self, repo: Repo, identity: Identity, layout: Layout, budget: Budget, options: StoreOptions, *,
                 direct_io: bool = False, async_copy_bytes: int = 0, direct_reads: bool | None = False) -> None:
        self._repo = repo
        self.identity = identity
        self.layout = layout
        self.budget = budget
        self.chunk_bytes = options.chunk_bytes
        self.codec = CODECS[options.codec]
        self.check_rows = options.check_rows
        self.staging_bytes = options.staging_bytes
        self.pending_lease = options.pending_lease
        # issue 12: O_DIRECT writes; issue 48: cold reads forced (direct_reads True/False) or measured (None)
        self.direct_io = direct_io
        self._reads: ReadPaths = ReadPaths(direct_reads, ram_tier=bool(budget.ram_bytes), reserve=budget.reserve_bytes,
                                           background=budget.write_bytes_per_hour is None)
        self._pool: ThreadPoolExecutor | None = None
        self._staging = StagingBuffer(options.staging_bytes, options.chunk_bytes)
        self._tiers = Tiers(repo, budget.ram_bytes)  # RAM (or none), the chunk files, the shared tier (set by _start)
        # restores repeated into the same arrays, replayed while the catalog stands (restore/hot.py, issue 48)
        self._hot = HotRestores(repo.db_path, repo.blob_path, enabled=repo.plans.enabled and not repo.readonly,
                                files=repo.files)
        repo.plans.on_move(self._hot)
        self._rates = RestoreRates()  # restore throughput per tier (issue 32); loaded from the catalog by open()
        self._ledger = Ledger(self._tiers.ram.take_hits if self._tiers.ram is not None else None, self._rates)
        self._capacity = Capacity(repo.root, budget, repo.blob_path)
        self._saver = AsyncSaver(async_copy_bytes)  # issue 12: save(wait=False); no thread until a save queues
        self._gate = CallGate()  # public calls in flight versus close()
        self._access = Access(identity)  # the ownership checks; its owner token is set by _start
        self._lease_owner: Owner | None = None
        self._chunker: Chunker | None = None
        self._run: SaveRun | None = None  # the save stages, once the owner exists
        self._admission = Admission()  # write admission (issue 32); set by open()

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, identity: Identity, layout: Layout,
             budget: Budget | None = None, drop_stale: bool = True, chunk_bytes: int | None = None,
             codec: str | None = None, staging_bytes: int | None = None,
             check_rows: bool | None = None, pending_lease: float | None = None, remote: str | None = None,
             remote_wait: bool | None = None, direct_io: bool | None = None,
             async_copy_bytes: int | None = None, direct_reads: bool | None = None, read_only: bool = False,
             admit: str | None = None) -> Store:
        """Open (creating if needed) the store at ``path`` for ``identity``.

        path: None → ``$SNAPSTORE_DIR``, else the per-user cache dir. drop_stale: remove this model's
        stale identities' snapshots now (same pack and extra; never another model's; logged). chunk_bytes
        (``SNAPSTORE_CHUNK_MIB``, 16 MiB), codec (``SNAPSTORE_CODEC``: raw | zstd | zstd-shuffle2;
        raw), staging_bytes (``SNAPSTORE_STAGING_MIB``, 64 MiB), check_rows
        (``SNAPSTORE_CHECK_ROWS=1``: verify the rows a delta vouches for against the parent chain),
        pending_lease (``SNAPSTORE_PENDING_LEASE_S``, 300 s: how long this store's pending captures
        outlive a stalled renewal, as seen from another host; docs/format.md "Owners and liveness"),
        direct_io (``SNAPSTORE_DIRECT_IO``, on: raw chunks written with O_DIRECT where the file system
        allows it; docs/benchmarks.md has the trade-off), direct_reads (``SNAPSTORE_DIRECT_READS=1/0``; unset:
        the faster way on the store's storage, measured, docs/api.md "Cold reads"), async_copy_bytes
        (``SNAPSTORE_ASYNC_COPY_MIB``, 1024 MiB: what saves with ``wait=False`` may hold copied).
        remote (``SNAPSTORE_REMOTE``): ``s3://BUCKET/PREFIX``, a shared tier behind this local one;
        remote_wait (``SNAPSTORE_REMOTE_WAIT=1``): save() waits for the bucket (docs/engine.md).
        read_only: read an existing store without writing a byte; every change raises StateError (docs/api.md).
        admit (``SNAPSTORE_ADMIT``): "always" (the default) or "second_hit": a prefix is written the second
        time it is seen within ``SNAPSTORE_ADMIT_WINDOW_S`` (3600 s); docs/api.md "Write admission".
        """
        if not isinstance(identity, Identity):
            raise ConfigError("Store.open needs identity=snapstore.Identity(...)")
        if not isinstance(layout, Layout):
            raise ConfigError("Store.open needs layout=snapstore.Layout(...)")
        budget = resolved_budget(budget)
        options = store_options(path, chunk_bytes=chunk_bytes, codec=codec, staging_bytes=staging_bytes,
                                check_rows=check_rows, pending_lease=pending_lease, codecs=CODECS)
        admission = admission_of(admit, budget)  # issue 32: a bad mode is a ConfigError before anything is created
        direct = direct_default(direct_io)  # a bad value is a ConfigError before anything is created
        copy, rd = copy_budget(async_copy_bytes), direct_reads_setting(direct_reads)
        if read_only and remote:
            raise ConfigError("a read_only store cannot have a shared tier (remote=): fetching writes the local store")
        repo = Repo.open(options.root, readonly=bool(read_only), create=not read_only)
        store = cls(repo, identity, layout, budget, options, direct_io=direct, async_copy_bytes=copy, direct_reads=rd)
        store._admission = admission
        try:
            store._rates.load(repo.db.read(lambda t: t.restore_rates()))  # read-only stores too
            store._reads.load(repo.root, repo.db.read(lambda t: t.read_paths()),  # the measured cold-read path
                              lambda: store._rates.rates().get("cold", 0.0))
            if not read_only:  # read-only: nothing to start (no owner, lease, housekeeping or writer threads)
                store._start(drop_stale=drop_stale, remote=remote, remote_wait=remote_wait)
        except BaseException:
            store._teardown()
            raise
        return store

    def _start(self, *, drop_stale: bool, remote: str | None = None, remote_wait: bool | None = None) -> None:
        """The I/O of opening: the identity row, the owner (lock file, lease thread), housekeeping,
        then the shared tier (``remote``)."""
        repo = self._repo
        self._access.ensure_identity(repo.db)
        self._pool = ThreadPoolExecutor(max_workers=self._staging.writers, thread_name_prefix="snapstore")
        self._chunker = Chunker(repo.blob_path, repo.tmp, self.chunk_bytes, self.codec, self._staging, self._pool,
                                repo.db, sweep=repo.sweep, direct=self.direct_io)
        self._lease_owner = Owner(repo.db, repo.root, self.pending_lease)
        owner = self._access.owner = self._lease_owner.token
        stages = Saver(layout=self.layout, identity_key=self.identity.key, owner=owner,
                       chunk_bytes=self.chunk_bytes, chunker=self._chunker, capacity=self._capacity,
                       blob_path=repo.blob_path, renew=self._lease_owner.renew, own=self._access.own)
        self._run = SaveRun(stages=stages, chunker=self._chunker, capacity=self._capacity, repo=repo,
                            ledger=self._ledger, access=self._access, count=self._ledger.count,
                            check_rows=self.check_rows, admission=self._admission)
        dead, dropped = self._write(lambda t: housekeep(  # dead owners' captures, stale identities, expired ones
            t, root=repo.root, lease=self.pending_lease, now=time.time(), identity_key=self.identity.key,
            drop_stale=drop_stale, ttl=self.budget.ttl))
        log_drops(dropped, "stale at this open (the same model; Store.open(drop_stale=False) keeps them)")
        reap_lock_files(repo.root, dead)
        self._tiers.open_shared(remote, self.identity, owner, self._ledger.count, remote_wait)

    def _teardown(self, dead_owners: Iterable[str] = ()) -> None:
        """Release what :meth:`_start` acquired (a failed open, or close() after its transaction):
        the owner lock (then the lock files of ``dead_owners``), the threads, the RAM tier, the catalog."""
        try:
            if self._lease_owner is not None:
                self._lease_owner.release()
                reap_lock_files(self._repo.root, dead_owners)
            if self._pool is not None and not self._gate.forked:  # a forked child's: the parent's threads
                self._pool.shutdown(wait=True)
            self._tiers.close_local()
            self._hot.close()
            self._reads.stop()  # a read-path probe in flight (restore.read_path)
        finally:
            self._repo.close()

    @property
    def path(self) -> str:
        """The store directory."""
        return self._repo.root

    @property
    def read_only(self) -> bool:
        """Whether this store was opened with ``read_only=True`` (it writes nothing)."""
        return self._repo.readonly

    # -- helpers -----------------------------------------------------------------------------
    def _write(self, fn: Callable[[Txn], T], *, durable: bool = True, discard: Iterable[bytes] = (),
               committed: Callable[[], None] | None = None) -> T:
        """A write transaction that also persists this store's bookkeeping (see :func:`write_with`)."""
        return write_with(self._repo, self._ledger, fn, durable=durable, discard=discard, committed=committed)

    # -- save --------------------------------------------------------------------------------
    @overload
    def save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | SaveHandle | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: Literal[True] = True) -> SaveResult: ...

    @overload
    def save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | SaveHandle | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: Literal[False]) -> SaveHandle: ...

    @overload
    def save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | SaveHandle | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: bool) -> SaveResult | SaveHandle: ...

    def save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
             session: str | None = None, parent: SnapshotRef | SaveHandle | str | None = "auto", commit: bool = True,
             namespace: str | None = None, wait: bool = True) -> SaveResult | SaveHandle:
        """Save the state after ``tokens``; a delta over ``parent`` ("auto", None or an id).

        Returns a SaveResult; a save that does not fit the budget is skipped with a reason.
        ``wait=False``: returns a SaveHandle at once and writes in the background (docs/api.md).
        """
        self._repo.refuse_write("save")  # before any chunk file is published
        if not wait:
            kw = {"session": session, "parent": parent, "commit": commit, "namespace": namespace}
            with self._gate.call():
                return self._saver.submit(self, self._save, self.layout, tokens, parts, rows, kw,
                                          self._run.parent_rows_now if self._run else None)
        if isinstance(parent, SaveHandle):
            if parent._saver is not self._saver:  # another store's id would name one of this store's snapshots
                raise InvalidInputError("parent=<SaveHandle> must be a handle of a save(wait=False) of this store")
            parent = parent_after(parent)  # waits for it: the rule of snapstore.save.chain
        return self._save(tokens, parts, rows, session=session, parent=parent, commit=commit, namespace=namespace)

    @operation
    def _save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None, *,
              session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
              namespace: str | None = None, hashed: TokenKeys | None = None) -> SaveResult:
        """The synchronous save (``save(wait=True)``); ``hashed``: the keys of ``tokens`` a ``save(wait=False)``
        computed at the call (its parent's prediction), not computed again."""
        assert self._run is not None  # set by open(); a Store is only handed out open
        res = self._run.run(tokens, parts, rows, session, parent, commit, namespace, hashed)
        self._tiers.shared.saved(res)
        return res

    # -- pending captures --------------------------------------------------------------------
    @operation
    def commit(self, res: SnapshotRef, *, namespace: str | None = None) -> SaveResult:
        """Make a pending capture (and its pending ancestors, root first) visible to match().

        Refused for the budget: the capture and its own pending descendants are dropped; its
        pending ancestors stay pending (their other children untouched) — invariant 5.
        """
        sid = snapshot_id(res)
        ns = ref_namespace(res, namespace)
        now = time.time()
        try:
            snap = self._write(lambda t: commit_capture(t, self._access, sid, ns, self._capacity, now))
        except Skip as s:
            self._write(lambda t: drop_capture(t, self._access.owner, sid))
            return skipped(self._repo.db, s.reason, None, 0, 0, ns)
        result = SaveResult(snapshot_id=sid, skipped=None, parent_id=snap.parent_id, stored_bytes=0,
                            logical_bytes=snap.logical_bytes, n_tokens=snap.n_tokens, namespace=ns or None)
        self._tiers.shared.saved(result)
        return result

    @operation
    def abandon(self, res: SnapshotRef, *, namespace: str | None = None) -> None:
        """Drop a pending capture and its pending descendants; their pins and bytes are released."""
        sid = snapshot_id(res)
        ns = ref_namespace(res, namespace)
        self._write(lambda t: abandon_capture(t, self._access, sid, ns))

    @operation
    def delete(self, ref: SnapshotRef, *, namespace: str | None = None) -> DeleteResult:
        """Drop a snapshot of this identity and every descendant; returns what went.

        ``ref`` is a snapshot id, Match or SaveResult. Superseded ancestors left without children
        go too (they were only chain links). Refused with StateError while a live process has a
        pending capture in the subtree (it would lose the parent it is extending); a dead owner's
        capture goes with the subtree (the liveness rule of :mod:`snapstore.lifecycle.liveness`).
        """
        sid = snapshot_id(ref)
        ns = ref_namespace(ref, namespace)
        return self._write(lambda t: delete_subtree(t, self._access, sid, ns, root=self._repo.root,
                                                    lease=self.pending_lease))

    # -- match -------------------------------------------------------------------------------
    @operation
    def match(self, tokens: TokensLike, *, namespace: str | None = None,
              exclude: Iterable[SnapshotRef] | None = (), prefill_tokens_per_s: float | None = None) -> Match | None:
        """The longest committed snapshot whose tokens are a prefix of ``tokens``, or None.

        ``exclude``: snapshot ids (or Match / SaveResult) to pass over (None: none) — after a failed restore,
        match again excluding it to fall back to the next-longest prefix. ``prefill_tokens_per_s``: store/recompute.py.
        """
        arr = as_token_array(tokens, borrow=True)  # read only during this call: an int64 prompt is not copied
        ns = namespace_key(namespace)
        skip = excluded(exclude)
        if len(arr) == 0:
            return None
        not_before = time.time() - self.budget.ttl if self.budget.ttl else 0.0
        prompt = Prompt(arr)  # kept: restore or recompute matches it again past each prefix it weighs
        found = self._repo.db.read(lambda c: best_match(c, self.layout, self.identity.key, ns, prompt, skip,
                                                        not_before))
        far = self._tiers.shared.lookup(arr, ns, found[1] if found is not None else 0)
        if prefill_tokens_per_s is not None:  # restore or recompute: store/recompute.py weighs the prefixes
            return choose_match(self, prompt, ns, namespace, skip, not_before, found, far, prefill_tokens_per_s)
        if far is not None:
            return far
        if found is None:
            self._ledger.count("misses")
            return None
        hit, n_hit = found
        self._ledger.count("hits")
        self._ledger.count("hit_tokens", n_hit)
        return Match(hit.id, n_hit, namespace)

    # -- turns (logic in store/turn.py; batches: store/batch.py) ----------------------------
    def turn(self, *, session: str | None = None, namespace: str | None = None,
             parent: SnapshotRef | str | None = "auto") -> Turn:
        """A capture chain for one turn: ``with store.turn(session=...) as t: t.capture(tokens, parts)``."""
        self._gate.check()
        self._repo.refuse_write("capture a turn")
        namespace_key(namespace)  # each checked now, as the captures would check them
        session_key(session)
        if parent is not None and parent != "auto" and not isinstance(parent, SaveHandle):
            snapshot_id(parent)  # a snapshot reference (another store's SaveHandle: at the capture)
        return Turn(self, session=session, namespace=namespace, parent=parent)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Wait for every save made with ``wait=False`` so far, then (with a shared tier) for their
        uploads. A FlushResult (uploads published/failed/dropped); false when ``timeout`` ran out."""
        self._gate.check()
        limit = wait_seconds(timeout)
        return flush_all(self._saver.flush, self._tiers.shared.flush, limit)

    def close(self) -> None:
        """Abandon this store's pending captures (and dead owners'), flush counters, release resources.

        Safe against other threads: calls that start after close() began raise StateError; calls
        already running finish first (close waits for them). Idempotent; a second close() (from
        any thread) returns once the first has finished. In a process forked from the opener's it
        returns at once and releases only that process's copies (docs/api.md).
        """
        if self._gate.depth:
            raise StateError("close() was called from inside a call on this same store (a part source "
                             "or destination?); close the store after that call returns")
        self._saver.close()  # issue 12: saves made with wait=False finish first
        if not self._gate.begin_close():  # from here on every new call raises StateError
            return
        dead_owners: list[str] = []
        owner = self._lease_owner
        assert owner is not None or self._repo.readonly  # set by open(); a Store is only handed out open
        try:
            self._tiers.close_shared(self._gate.forked)  # finishes the queued uploads first
            if owner is None:
                return  # read-only: nothing was started, nothing to retire
            self._rates.flush_next()  # the restore rates measured since the last hand-over: written by retire's txn
            owner.stop()  # no renewal may re-register the row this transaction deletes
            if not owner.inherited:  # a forked child's copy: the parent's captures and row stay
                dead_owners = self._write(lambda t: retire(t, owner, root=self._repo.root, lease=self.pending_lease))
        finally:
            try:
                self._teardown(dead_owners)  # after the transaction: our captures are gone before the lock is free
            finally:
                self._gate.finish_close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
