"""The Store: save / match / restore / commit / abandon for one identity, with budgets.

Save: validate → pick the parent → (optional) check the rows the caller vouches for → capacity
pre-check → chunker publishes chunk files (durable) → one metadata transaction that inserts the
snapshot, supersedes, evicts to the budget or skips → unlink what it freed. Restore: one read
transaction builds and validates the plan, then the chunks stream into the destination.
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

import blake3
import numpy as np

from ._async_save import AsyncSaver, SaveHandle, copy_budget
from ._batch import planned_destination, restore_batch
from ._buffers import Source, as_source
from ._chunker import Chunker, Piece, StagingBuffer
from ._chunkfile import CODECS, HEADER_SIZE, checksum, header_at, scope_key
from ._config import MIB, Budget, default_dir, env_int
from ._config import pending_lease as resolve_lease
from ._db import Conn, Database, SnapRow
from ._direct_io import direct_default
from ._errors import (
    ConfigError,
    CorruptionError,
    IdentityError,
    InvalidInputError,
    LayoutError,
    NotFoundError,
    RemoteError,
    RestoreError,
    SnapshotUnavailableError,
    SnapstoreError,
    StateError,
    StoreIOError,
)
from ._identity import Identity
from ._layout import Fixed, Layout, Rows
from ._lifecycle import drop_subtree, evict_until, over_budget, supersede
from ._owner import Liveness, Owner, collect_dead, reap_lock_files
from ._plan import RestorePlan, build_plan
from ._ramtier import RamTier
from ._repo import Repo
from ._restore import Damage, quarantine, stream_plan
from ._results import DeleteResult, Match, MatchDetails, RestoreResult, SaveResult, SnapshotInfo, Stats
from ._tokens import TokenIndex, as_token_array, decode_tokens, encode_tokens
from ._turn import Turn
from ._uploader import FlushResult

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

DEFAULT_CHUNK_MIB = 32  # measured: docs/benchmarks.md (chunk size sweep)
DEFAULT_STAGING_MIB = 64


class _Skip(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class _Retry(Exception):
    """The commit found a chunk file gone (concurrent eviction), the parent gone, or this store's
    identity row dropped by another process (re-created in its own transaction first): redo."""

    def __init__(self, parent_gone: bool = False, identity_gone: bool = False):
        self.parent_gone = parent_gone
        self.identity_gone = identity_gone


_MAX_ID = 2**63 - 1  # SQLite's INTEGER range: no snapshot id lies beyond it


def _needs_quarantined(chain: list[SnapRow], broken: dict[int, bool], *, leaf: bool) -> bool:
    """Does restoring the chain's leaf (``leaf``), or a delta over it, read a quarantined chunk?

    ``broken`` is Database.quarantined_users: a snapshot whose row segments use one breaks every
    descendant; one whose fixed parts do breaks only itself (a delta over it never reads them).
    """
    if not broken:
        return False
    if leaf and chain and chain[-1].id in broken:
        return True
    return any(broken.get(link.id, False) for link in chain)


def _snapshot_id(ref: Any) -> int:
    sid = getattr(ref, "snapshot_id", ref)
    if isinstance(sid, (int, np.integer)) and not isinstance(sid, bool):
        if not 0 <= int(sid) <= _MAX_ID:
            raise InvalidInputError(f"snapshot id {int(sid)} is out of range: snapshot ids are integers in "
                                    "[1, 2**63) as save() and match() report them")
        return int(sid)
    if isinstance(ref, SaveResult) and ref.skipped is not None:
        raise InvalidInputError(f"that save was skipped ({ref.skipped}): no snapshot was stored, so there is nothing "
                                "to commit, abandon or restore; skipped saves are counted in stats().skipped")
    raise InvalidInputError(f"expected a snapshot id, Match or SaveResult, got {ref!r}")


def _operation(fn: Callable[Concatenate[Store, P], T]) -> Callable[Concatenate[Store, P], T]:
    """A public Store call: refused with StateError once close() began; close() waits for it."""

    def call(self: Store, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._in_operation():
            return fn(self, *args, **kwargs)

    functools.update_wrapper(call, fn)  # name, docstring and signature for help() and the docs
    return call


def _count_of(value: Any, what: str) -> int:
    """A row count: an int (numpy ints too), never a float or a string."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise InvalidInputError(f"{what} must be an int, got {value!r}")


def _ref_ns(ref: Any, namespace: str | None) -> str:
    """The namespace a snapshot reference speaks for: a Match/SaveResult's own, else the keyword."""
    ns = getattr(ref, "namespace", None) if isinstance(ref, (Match, SaveResult)) else None
    if namespace is not None and ns is not None and namespace != ns:
        raise IdentityError(f"namespace {namespace!r} given for a result of namespace {ns!r}")
    return _ns(namespace if namespace is not None else ns)


def _ns(namespace: str | None) -> str:
    if namespace is None:
        return ""
    if not isinstance(namespace, str) or not namespace or len(namespace) > 256:
        raise InvalidInputError(f"namespace must be None or a non-empty string (<= 256 chars), got {namespace!r}")
    return namespace


class Store:
    """An open snapstore directory, bound to one identity and layout. Thread-safe.

    Open with :meth:`Store.open`; see docs/api.md.
    """

    def __init__(self, repo: Repo, identity: Identity, layout: Layout, budget: Budget, *,
                 chunk_bytes: int, codec: int, staging_bytes: int, check_rows: bool,
                 pending_lease: float | None = None, direct_io: bool | None = None,
                 async_copy_bytes: int | None = None):
        self._repo = repo
        self.identity = identity
        self.layout = layout
        self.budget = budget
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.check_rows = check_rows
        self.staging_bytes = staging_bytes
        self.pending_lease = resolve_lease(pending_lease)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snapstore")
        self._staging = StagingBuffer(staging_bytes, chunk_bytes)
        self._ram = RamTier(budget.ram_bytes or 0) if budget.ram_bytes else None
        self._saver = AsyncSaver(copy_budget(async_copy_bytes))  # issue 12: save(wait=False)
        self._mem_counters: dict[str, int] = {}
        # restores recorded but not yet written: sid -> (latest use, hits); flushed by the next
        # write of this store or by a restore that finds the write lock free (never waits for it)
        self._touches: dict[int, tuple[float, int]] = {}
        self._counter_lock = threading.Lock()
        self._closed = False
        self._remote: Any = None  # the shared tier (snapstore._remote_tier.RemoteTier) when remote= is set
        self._gate = threading.Condition()  # guards _closed and _active (calls in flight)
        self._active = 0
        self._shut = False  # close() has finished
        self._inside = threading.local()  # depth of public calls on this thread (nested calls pass)
        self._identity_id = 0
        self._ensure_identity()
        self._chunker = Chunker(repo.blob_path, repo.tmp, chunk_bytes, codec, self._staging, self._pool, repo.db,
                                direct=direct_default(direct_io))  # issue 12: O_DIRECT saves, see _direct_io
        try:  # last: nothing after it can fail and leave the lock held and its thread running
            self._lease_owner = Owner(repo.db, repo.root, self.pending_lease)
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        self._owner = self._lease_owner.token
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
        env_chunk, env_staging = env_int("SNAPSTORE_CHUNK_MIB"), env_int("SNAPSTORE_STAGING_MIB")
        if env_chunk == 0 or env_staging == 0:
            raise ConfigError("$SNAPSTORE_CHUNK_MIB and $SNAPSTORE_STAGING_MIB must be >= 1")
        chunk = chunk_bytes if chunk_bytes is not None else (env_chunk or DEFAULT_CHUNK_MIB) * MIB
        staging = staging_bytes if staging_bytes is not None else (env_staging or DEFAULT_STAGING_MIB) * MIB
        if not isinstance(chunk, int) or chunk < 4096 or chunk % 4096 or chunk > (1 << 30):
            raise ConfigError(f"chunk_bytes must be a multiple of 4096 in [4 KiB, 1 GiB], got {chunk!r}")
        if not isinstance(staging, int) or staging < chunk:
            raise ConfigError(f"staging_bytes ({staging}) must be >= chunk_bytes ({chunk}): chunks are "
                              "bounded by the staging buffer")
        codec_name = codec if codec is not None else os.environ.get("SNAPSTORE_CODEC", "raw")
        if codec_name not in CODECS:
            raise ConfigError(f"codec must be one of {sorted(CODECS)}, got {codec_name!r}")
        if check_rows is None:
            flag = os.environ.get("SNAPSTORE_CHECK_ROWS", "0").strip().lower()
            if flag not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
                raise ConfigError(f"$SNAPSTORE_CHECK_ROWS must be 0/1 (or true/false), got {flag!r}")
            check_rows = flag in ("1", "true", "yes", "on")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path must be a directory path or None, got {path!r}")
        root = os.fspath(path) if path is not None else default_dir()
        if not isinstance(root, str):
            raise ConfigError(f"path must be a str (or os.PathLike of str), got {path!r}")
        if not root.strip():
            # "" would silently become the current directory; None is how to ask for the default
            raise ConfigError(f"store path {root!r} is empty; pass a directory, or path=None for "
                              "$SNAPSTORE_DIR / the per-user cache directory")
        lease = resolve_lease(pending_lease)
        direct_default(direct_io)  # a bad value is a ConfigError before anything is created
        copy_budget(async_copy_bytes)
        repo = Repo(root)
        try:
            store = cls(repo, identity, layout, budget, chunk_bytes=chunk, codec=CODECS[codec_name],
                        staging_bytes=staging, check_rows=bool(check_rows), pending_lease=lease,
                        direct_io=direct_io, async_copy_bytes=async_copy_bytes)
        except BaseException:
            repo.close()
            raise
        try:
            store._housekeeping(drop_stale=drop_stale)
            from ._remote_tier import open_remote
            store._remote = open_remote(remote, repo, identity, store._owner, store._count, remote_wait)
        except BaseException:
            store._lease_owner.release()
            store._pool.shutdown(wait=True)
            repo.close()
            raise
        return store

    @property
    def path(self) -> str:
        """The store directory."""
        return self._repo.root

    def _housekeeping(self, *, drop_stale: bool) -> None:
        """At open: drop pending captures of dead owners, stale identities, expired snapshots."""
        now = time.time()
        ttl = self.budget.ttl
        dead_owners: list[str] = []

        def run(c: Conn) -> list[bytes]:
            live = Liveness(self._repo.root, c, self.pending_lease, now)
            freed, gone, dead = collect_dead(c, self._repo.root, self.pending_lease, live)
            dead_owners[:] = dead
            if gone:
                Database.add_counter(c, "abandoned", len(gone))
            if drop_stale:
                for ident_id, key, *_ in Database.identities(c):
                    if key == self.identity.key:
                        continue
                    n = 0
                    for snap in sorted(Database.snapshots(c, ident_id), key=lambda s: -s.depth):
                        # deepest first; a live process's pending capture (and the chain it pins) stays
                        if snap.state == 0 and live.alive(snap.owner, snap.created):
                            continue
                        if Database.snapshot(c, snap.id) is not None and not Database.has_children(c, snap.id):
                            freed += Database.delete_snapshot(c, snap.id)
                            n += 1
                    Database.delete_identity(c, ident_id)
                    Database.add_counter(c, "stale_dropped", n)
            if ttl:
                freed += self._expire(c, now - ttl)
            return freed

        self._release(self._repo.db.write(run))
        reap_lock_files(self._repo.root, dead_owners)

    def _expire(self, c: Conn, before: float) -> list[bytes]:
        freed: list[bytes] = []
        n = 0
        for snap in Database.expired(c, before):
            if Database.snapshot(c, snap.id) is None or Database.has_children(c, snap.id):
                continue
            f, gone = drop_subtree(c, snap.id)
            freed += f
            n += len(gone)
        if n:
            Database.add_counter(c, "expired", n)
        return freed

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
        iid = self._repo.db.write(
            lambda c: Database.ensure_identity(c, self.identity.key, self.identity.canonical, now))
        self._identity_id = iid
        return iid

    def _iid(self, c: Conn) -> int:
        """This identity's row id as of this transaction; _Retry(identity_gone) when another process
        dropped it as stale (the caller re-creates it with :meth:`_ensure_identity` and redoes)."""
        row = Database.identity_id(c, self.identity.key)
        if row is None:
            raise _Retry(identity_gone=True)
        return row

    def _mine(self, c: Conn, snap: SnapRow) -> bool:
        """Does ``snap`` belong to this store's identity? Decided by the identity *key*, not the id."""
        return Database.identity_key(c, snap.identity_id) == self.identity.key

    def _count(self, name: str, delta: int = 1) -> None:
        with self._counter_lock:
            self._mem_counters[name] = self._mem_counters.get(name, 0) + delta

    def _record_use(self, sid: int, now: float) -> None:
        """Remember a successful restore (last use, one hit) for the next write to persist."""
        with self._counter_lock:
            last, hits = self._touches.get(sid, (0.0, 0))
            self._touches[sid] = (max(last, now), hits + 1)
            self._mem_counters["restores"] = self._mem_counters.get("restores", 0) + 1

    def _bookkeeping(self) -> Callable[[Conn], Callable[[], None]]:
        """What this store has recorded in memory (counters, restores' last use and hits), as a
        function that writes it inside a transaction and returns the one to call after COMMIT.

        Everything is taken before and subtracted only after the commit, so a transaction that is
        retried or rolled back neither loses nor doubles it.
        """
        if self._ram is not None:
            hits = self._ram.take_hits()
            if hits:
                self._count("ram_hits", hits)
        with self._counter_lock:
            counts = dict(self._mem_counters)
            touches = dict(self._touches)

        def settle() -> None:
            with self._counter_lock:
                for k, v in counts.items():
                    left = self._mem_counters.get(k, 0) - v
                    if left:
                        self._mem_counters[k] = left
                    else:
                        self._mem_counters.pop(k, None)
                for sid, (_when, n) in touches.items():
                    last, now_hits = self._touches.get(sid, (0.0, 0))
                    if now_hits - n > 0:
                        self._touches[sid] = (last, now_hits - n)
                    else:
                        self._touches.pop(sid, None)

        def apply(c: Conn) -> Callable[[], None]:
            for sid, (when, n) in touches.items():
                Database.touch(c, sid, when, n)
            for k, v in counts.items():
                Database.add_counter(c, k, v)
            return settle

        return apply

    def _write(self, fn: Callable[[Conn], T], *, durable: bool = True) -> T:
        """A write transaction that also persists what this store recorded in memory (counters,
        last use of restored snapshots) — before ``fn``, so eviction in ``fn`` sees recent use."""
        apply = self._bookkeeping()
        box: list[Callable[[], None]] = []

        def run(c: Conn) -> T:
            box[:] = [apply(c)]
            return fn(c)

        result = self._repo.db.write(run, durable=durable)
        box[0]()
        return result

    def _try_flush(self) -> None:
        """Persist the bookkeeping now if the write lock is free; otherwise leave it for later."""
        apply = self._bookkeeping()
        try:
            ran, settle = self._repo.db.try_write(apply)
        except SnapstoreError:
            return  # bookkeeping only: a full disk must not fail a restore that worked
        if ran and settle is not None:
            settle()

    def _release(self, ids: Iterable[bytes]) -> None:
        """Unlink chunk files whose last reference a committed transaction removed.

        After the commit nothing may fail the call: a file that cannot be unlinked now (the
        catalog locked too long, an I/O error) stays as an orphan, which gc removes later.
        """
        try:
            self._repo.unlink_unreferenced(ids)
        except SnapstoreError:
            self._count("unlink_deferred")

    def _tokens_of(self, c: Conn, chain: list[SnapRow]) -> np.ndarray:
        segs = [decode_tokens(s.tokens, s.token_width, s.n_tokens - s.base_tokens) for s in chain]
        return np.concatenate(segs) if segs else np.zeros(0, dtype="<u8")

    def _own(self, c: Conn, snap: SnapRow | None, namespace: str | None = None) -> SnapRow:
        if snap is None:
            raise NotFoundError("no such snapshot (evicted, superseded, abandoned or never saved)")
        if not self._mine(c, snap):
            raise IdentityError(f"snapshot {snap.id} belongs to another identity than this store was opened for")
        if namespace is not None and snap.namespace != namespace:
            raise IdentityError(f"snapshot {snap.id} belongs to another namespace")
        return snap

    # -- save --------------------------------------------------------------------------------
    def _validate_parts(self, parts: Mapping[str, Any], rows: Any, n: int) -> tuple[dict[str, Source], dict[str, int]]:
        if not isinstance(parts, Mapping):
            raise LayoutError("parts must be a mapping of part name to buffer")
        specs = self.layout.parts
        unknown = sorted(set(parts) - set(specs))
        if unknown:
            raise LayoutError(f"parts not in the layout: {unknown}; layout parts are {sorted(specs)}")
        present_components = {specs[name].component for name in parts}
        missing = sorted(name for name, s in specs.items() if name not in parts and (
            s.component is None or s.component in present_components))
        if missing:
            raise LayoutError(f"parts missing from save(): {missing} (a component is saved whole or not at all)")
        if rows is None:
            row_counts = {name: n for name in parts if isinstance(specs[name], Rows)}
        elif isinstance(rows, Mapping):
            extra = sorted(set(rows) - {k for k in parts if isinstance(specs[k], Rows)})
            if extra:
                raise LayoutError(f"rows given for parts that are not saved row streams: {extra}")
            row_counts = {name: _count_of(rows.get(name, n), f"rows[{name!r}]") for name in parts
                          if isinstance(specs[name], Rows)}
        elif isinstance(rows, (int, np.integer)) and not isinstance(rows, bool):
            row_counts = {name: int(rows) for name in parts if isinstance(specs[name], Rows)}
        else:
            raise InvalidInputError(f"rows must be None, an int or a mapping of stream to int, got {rows!r}")
        for name, r in row_counts.items():
            if r < 0:
                raise InvalidInputError(f"rows[{name!r}] must be >= 0, got {r}")
            if r > n:
                raise InvalidInputError(f"rows[{name!r}] = {r} but only {n} tokens are saved: a stream holds at "
                                        "most one row per token")
        sources = {name: as_source(name, obj, specs[name], row_counts.get(name, 0)) for name, obj in parts.items()}
        return sources, row_counts

    def _resolve_parent(self, c: Conn, parent: Any, index: TokenIndex, ns: str, row_counts: dict[str, int],
                        commit: bool) -> tuple[SnapRow | None, dict[str, int]]:
        n = len(index)

        def parent_rows(p: SnapRow) -> dict[str, int] | None:
            stored = {q.name: q for q in Database.parts(c, p.id) if q.kind == 1}
            out: dict[str, int] = {}
            for name, r in row_counts.items():
                q = stored.get(name)
                if q is None or q.row_end > r or q.dtype != self.layout.rows[name].dtype or \
                        tuple(q.shape) != self.layout.rows[name].row_shape:
                    return None
                out[name] = q.row_end
            return out

        if parent is None:
            return None, {}
        if isinstance(parent, str):
            if parent != "auto":
                raise InvalidInputError(f"parent must be 'auto', None or a snapshot id, got {parent!r}")
            broken = Database.quarantined_users(c)
            for sid, cn, key in list(Database.match_candidates(c, self.identity.key, ns, index.chain, n - 1, 0.0)):
                if key != index.prefix_key(cn):
                    continue
                if broken and _needs_quarantined(Database.chain(c, sid), broken, leaf=False):
                    continue  # a delta over it could not restore until its chunk is healed
                cand = Database.snapshot(c, sid)
                pr = parent_rows(cand) if cand is not None else None
                if cand is not None and pr is not None:
                    return cand, pr
            return None, {}
        sid = _snapshot_id(parent)
        snap = self._own(c, Database.snapshot(c, sid), ns)
        if snap.state == 0 and snap.owner != self._owner:
            raise InvalidInputError(f"parent {sid} is a pending capture of another process")
        if snap.state == 0 and commit:
            raise InvalidInputError(f"parent {sid} is pending: parents commit before children; save this one "
                                    "with commit=False (commit() then commits the chain) or commit the parent first")
        if snap.n_tokens > n or snap.prefix_key != index.prefix_key(snap.n_tokens):
            raise InvalidInputError(f"parent {sid} is not a prefix of these tokens")
        pr = parent_rows(snap)
        if pr is None:
            raise LayoutError(f"parent {sid} lacks a row stream being saved, or has more rows than this save")
        return snap, pr

    def _rows_vouched(self, c: Conn, parent: SnapRow, prows: dict[str, int], sources: dict[str, Source]) -> bool:
        """check_rows: do the caller's rows below the parent boundary equal the parent chain's?"""
        for link in Database.chain(c, parent.id):
            for part in Database.parts(c, link.id):
                if part.kind != 1 or part.name not in prows:
                    continue
                off = part.row_start * self.layout.rows[part.name].row_bytes
                src = sources[part.name]
                for ch in Database.part_chunks(c, link.id, part.name):
                    if ch is None:
                        return False
                    buf = memoryview(bytearray(ch.raw_len))
                    src.copy_into(off, buf)
                    if checksum(buf) != ch.checksum:
                        return False
                    off += ch.raw_len
        return True

    # -- issue 12: save(wait=False) -> SaveHandle (snapstore/_async_save.py) -----------------
    @overload
    def save(self, tokens: Any, parts: Mapping[str, Any], rows: Any = None, *, session: str | None = None,
             parent: Any = "auto", commit: bool = True, namespace: str | None = None,
             wait: Literal[True] = True) -> SaveResult: ...

    @overload
    def save(self, tokens: Any, parts: Mapping[str, Any], rows: Any = None, *, session: str | None = None,
             parent: Any = "auto", commit: bool = True, namespace: str | None = None,
             wait: Literal[False]) -> SaveHandle: ...

    @overload
    def save(self, tokens: Any, parts: Mapping[str, Any], rows: Any = None, *, session: str | None = None,
             parent: Any = "auto", commit: bool = True, namespace: str | None = None,
             wait: bool) -> SaveResult | SaveHandle: ...

    def save(self, tokens: Any, parts: Mapping[str, Any], rows: Any = None, *, session: str | None = None,
             parent: Any = "auto", commit: bool = True, namespace: str | None = None,
             wait: bool = True) -> SaveResult | SaveHandle:
        """Save the state after ``tokens``; a delta over ``parent`` ("auto", None or an id).

        Returns a SaveResult; a save that does not fit the budget is skipped with a reason.
        ``wait=False``: returns a SaveHandle at once and writes in the background (docs/api.md).
        """
        if not wait:
            kw = {"session": session, "parent": parent, "commit": commit, "namespace": namespace}
            with self._in_operation():
                return self._saver.submit(self, tokens, parts, rows, kw)
        return self._save(tokens, parts, rows, session=session, parent=parent, commit=commit, namespace=namespace)


    @_operation
    def _save(self, tokens: Any, parts: Mapping[str, Any], rows: Any = None, *, session: str | None = None,
              parent: Any = "auto", commit: bool = True, namespace: str | None = None) -> SaveResult:
        """The synchronous save (``save(wait=True)``)."""
        arr = as_token_array(tokens)
        n = len(arr)
        if n == 0:
            raise InvalidInputError("save() needs at least one token")
        if session is not None and (not isinstance(session, str) or not session):
            raise InvalidInputError(f"session must be None or a non-empty string, got {session!r}")
        ns = _ns(namespace)
        sources, row_counts = self._validate_parts(parts, rows, n)
        index = TokenIndex(arr)
        for attempt in range(8):
            # "auto" whose parent keeps being evicted under it: after 3 tries store the state whole
            use = None if parent == "auto" and attempt >= 3 else parent
            try:
                res = self._save_once(arr, index, sources, row_counts, session, use, commit, ns)
                self._remote_saved(res)
                return res
            except _Retry as r:
                if r.identity_gone:
                    self._ensure_identity()  # committed on its own before the save is redone
                if r.parent_gone and use not in ("auto", None):
                    raise NotFoundError(f"parent {_snapshot_id(use)} was removed (evicted, superseded or "
                                        "abandoned) during the save; save again with parent='auto'") from None
        raise StateError("save() lost a race with concurrent evictions 8 times; try again")

    def _save_once(self, arr: np.ndarray, index: TokenIndex, sources: dict[str, Source],
                   row_counts: dict[str, int], session: str | None, parent: Any, commit: bool,
                   ns: str) -> SaveResult:
        n = len(arr)
        db = self._repo.db
        par, prows = db.read(lambda c: self._resolve_parent(c, parent, index, ns, row_counts, commit))
        vouched = par
        if vouched is not None and self.check_rows and not db.read(
                lambda c: self._rows_vouched(c, vouched, prows, sources)):
            self._count("rows_mismatch")
            if parent != "auto":
                raise InvalidInputError(
                    f"check_rows: rows below parent {vouched.id}'s boundary differ from what it stored; "
                    "the engine changed rows it vouched for (save with parent=None to store them whole)")
            par, prows = None, {}
        specs = self.layout.parts
        pieces: list[Piece] = []
        meta: list[tuple[str, int, int]] = []  # name, row_start, row_end
        for name, src in sources.items():
            spec = specs[name]
            # the chunk scope covers the part's dtype and (row) shape: bytes saved under another
            # layout never deduplicate onto chunks, or a snapshot, that this layout cannot restore
            if isinstance(spec, Fixed):
                pieces.append(Piece(src, 0, spec.nbytes, scope_key(self.identity.key, ns, spec.dtype, spec.shape)))
                meta.append((name, 0, 0))
            else:
                r0, r1 = prows.get(name, 0), row_counts[name]
                pieces.append(Piece(src, r0 * spec.row_bytes, r1 * spec.row_bytes,
                                    scope_key(self.identity.key, ns, spec.dtype, spec.row_shape)))
                meta.append((name, r0, r1))
        logical = sum(s.nbytes if isinstance(s, Fixed) else row_counts[k] * s.row_bytes
                      for k, s in specs.items() if k in sources)
        upper = sum(p.end - p.start for p in pieces) + HEADER_SIZE * sum(
            max(1, -(-(p.end - p.start) // self.chunk_bytes)) for p in pieces)
        reason = self._precheck(upper)
        if reason is not None:
            return self._skipped(reason, par, logical, n, ns)
        refs = self._chunker.store(pieces)
        created = [r.id for rs in refs for r in rs if r.created]
        keys = {r.id: p.key for p, rs in zip(pieces, refs) for r in rs}
        tokens_blob, width = encode_tokens(arr[par.n_tokens if par else 0:])
        # what the whole chain holds, independent of snapshot ids: the same state saved again
        # (through an equal chain) has the same key however its links are numbered
        h = blake3.blake3(b"content v2")
        h.update(par.content_key if par else bytes(16))
        for (name, r0, r1), rs in sorted(zip(meta, refs), key=lambda x: x[0]):
            spec = specs[name]
            kind, shape = (0, spec.shape) if isinstance(spec, Fixed) else (1, spec.row_shape)
            h.update(f"|{name}:{kind}:{spec.dtype}:{list(shape)}:{r0}:{r1}:".encode())
            for r in rs:
                h.update(r.id)
        content_key = h.digest(16)
        now = time.time()
        new_bytes = [0]

        def txn(c: Conn) -> tuple[int, int | None, list[bytes], bool]:
            if par is not None:
                p = Database.snapshot(c, par.id)
                if p is None or (p.state == 0 and (p.owner != self._owner or commit)):
                    raise _Retry(parent_gone=True)
            iid = self._iid(c)
            if not Database.quarantined_ids(c).isdisjoint(keys):
                raise _Retry()  # a chunk found damaged since this save looked: the retry republishes it
            if not commit:
                self._lease_owner.renew(c)  # a capture is never younger than its owner's lease
            if commit:
                same = Database.same_content(c, iid, ns, index.prefix_key(n), content_key)
                if same is not None:
                    Database.touch(c, same.id, now, False)
                    retired: list[bytes] = []
                    if session is not None and same.session == session:
                        retired, _ = supersede(c, same, index)
                    return same.id, same.parent_id, retired, True
            missing: set[bytes] = set()
            new_bytes[0] = 0
            for rs in refs:
                for r in rs:
                    if Database.chunk(c, r.id) is not None:
                        continue
                    path = self._repo.blob_path(r.id)
                    try:
                        head, size = header_at(path)
                    except (OSError, CorruptionError):
                        missing.add(r.id)
                        continue
                    if head.raw_len != r.raw_len or head.checksum != r.checksum:
                        missing.add(r.id)  # a damaged file sits at the address: republish it
                        continue
                    if Database.add_chunk(c, r.id, r.raw_len, size, head.codec, r.checksum, keys[r.id], now):
                        new_bytes[0] += size
            if missing:
                raise _Retry()
            sid = Database.insert_snapshot(
                c, identity_id=iid, namespace=ns, parent_id=par.id if par else None,
                depth=(par.depth + 1) if par else 0, n_tokens=n, base_tokens=par.n_tokens if par else 0,
                token_width=width, tokens=tokens_blob, anchor=index.anchor(n), prefix_key=index.prefix_key(n),
                content_key=content_key, session=session, state=1 if commit else 0,
                owner=None if commit else self._owner, now=now, logical_bytes=logical)
            for (name, r0, r1), rs in zip(meta, refs):
                spec = specs[name]
                if isinstance(spec, Fixed):
                    Database.insert_part(c, sid, name, 0, spec.dtype, spec.shape, spec.component, 0, 0,
                                         spec.nbytes, [r.id for r in rs])
                else:
                    Database.insert_part(c, sid, name, 1, spec.dtype, spec.row_shape, spec.component, r0, r1,
                                         (r1 - r0) * spec.row_bytes, [r.id for r in rs])
            freed: list[bytes] = []
            if commit:
                new = Database.snapshot(c, sid)
                assert new is not None
                f, _ = supersede(c, new, index)
                freed += f
            protect = {sid} | ({s.id for s in Database.chain(c, par.id)} if par else set())
            ok, f, _ = evict_until(c, lambda fr: self._excess(c, fr) is None, protect)
            freed += f
            if not ok:
                raise _Skip(self._excess(c, freed) or "disk_reserve")
            Database.add_counter(c, "inserts", 1)
            Database.add_counter(c, "logical_in", logical)
            return sid, par.id if par else None, freed, False

        try:
            sid, parent_id, freed, existed = self._write(txn)
        except _Skip as s:
            self._repo.unlink_unreferenced(created)
            return self._skipped(s.reason, par, logical, n, ns)
        except _Retry:
            self._repo.unlink_unreferenced(created)  # the retry republishes what it needs: no orphans
            raise
        except BaseException:
            self._repo.unlink_unreferenced(created)
            raise
        _hook("save_committed")
        self._release(freed)  # the snapshot is saved: nothing after the commit may fail the call
        return SaveResult(sid, None, parent_id, 0 if existed else new_bytes[0], logical, n,
                          pending=not commit and not existed, namespace=ns or None)

    def _skipped(self, reason: str, par: SnapRow | None, logical: int, n: int, ns: str) -> SaveResult:
        self._repo.db.write(lambda c: Database.add_counter(c, f"skipped:{reason}", 1))
        return SaveResult(None, reason, par.id if par else None, 0, logical, n, False, namespace=ns or None)

    def _free_space(self) -> int:
        try:
            st = os.statvfs(self._repo.root)
        except OSError:
            return 1 << 62  # cannot tell: the budget still applies, the reserve cannot
        return st.f_bavail * st.f_frsize

    def _precheck(self, upper: int) -> str | None:
        """Reasons to skip before writing anything: larger than the budget, or than the disk."""
        disk = self.budget.disk_bytes or 0
        if upper > disk:
            return "larger_than_budget"
        stored = self._repo.db.read(lambda c: Database.stored_bytes(c))
        if self._free_space() + stored - upper < (self.budget.reserve_bytes or 0):
            return "disk_full"
        return None

    def _excess(self, c: Conn, freed: list[bytes]) -> str | None:
        """Why the store does not fit its budget now (a skip reason), or None when it does."""
        b = self.budget
        reason = over_budget(c, b.disk_bytes or 0, b.max_entries)
        if reason is not None or not b.reserve_bytes:
            return reason
        free = self._free_space()
        if free < b.reserve_bytes:
            # chunk files freed in this transaction are unlinked right after it commits
            for cid in set(freed):
                try:
                    free += os.stat(self._repo.blob_path(cid)).st_size
                except (OSError, CorruptionError):
                    pass
        return "disk_reserve" if free < b.reserve_bytes else None

    # -- pending captures --------------------------------------------------------------------
    @_operation
    def commit(self, res: Any, *, namespace: str | None = None) -> SaveResult:
        """Make a pending capture (and its pending ancestors, root first) visible to match().

        Refused for the budget: the capture and its own pending descendants are dropped; its
        pending ancestors stay pending (their other children untouched) — invariant 5.
        """
        sid = _snapshot_id(res)
        ns = _ref_ns(res, namespace)
        now = time.time()

        def txn(c: Conn) -> tuple[SaveResult, list[bytes]]:
            snap = self._own(c, Database.snapshot(c, sid), ns)
            if snap.state == 1:
                return SaveResult(sid, None, snap.parent_id, 0, snap.logical_bytes, snap.n_tokens,
                                  namespace=ns or None), []
            if snap.owner != self._owner:
                raise StateError(f"snapshot {sid} is a pending capture of another process")
            chain = self._chain(c, snap)
            freed: list[bytes] = []
            tokens = self._tokens_of(c, chain)
            for link in chain:
                if link.state == 1:
                    continue
                Database.set_state(c, link.id, 1, None, now)
                new = Database.snapshot(c, link.id)
                assert new is not None
                f, _ = supersede(c, new, TokenIndex(tokens[:link.n_tokens]))
                freed += f
            protect = {s.id for s in chain}
            ok, f, _ = evict_until(c, lambda fr: self._excess(c, fr) is None, protect)
            freed += f
            if not ok:
                raise _Skip(self._excess(c, freed) or "disk_reserve")
            return SaveResult(sid, None, snap.parent_id, 0, snap.logical_bytes, snap.n_tokens,
                              namespace=ns or None), freed

        try:
            result, freed = self._write(txn)
        except _Skip as s:
            self._drop_refused(sid)
            return self._skipped(s.reason, None, 0, 0, ns)
        self._release(freed)
        self._remote_saved(result)
        return result

    def _remote_saved(self, res: SaveResult) -> None:
        """Shared-tier hook: a committed snapshot is durable locally; upload it (queued, or now in wait mode)."""
        if self._remote is not None and res.snapshot_id is not None and not res.pending:
            self._remote.saved(res.snapshot_id)

    def _drop_refused(self, sid: int) -> None:
        """A refused commit: drop the capture asked for and its pending descendants, nothing else."""

        def txn(c: Conn) -> list[bytes]:
            snap = Database.snapshot(c, sid)
            if snap is None or snap.state == 1 or snap.owner != self._owner:
                return []  # committed meanwhile by another thread of this store, or already gone
            freed, gone = drop_subtree(c, sid)
            Database.add_counter(c, "abandoned", len(gone))
            return freed

        self._release(self._write(txn))

    @_operation
    def abandon(self, res: Any, *, namespace: str | None = None) -> None:
        """Drop a pending capture and its pending descendants; their pins and bytes are released."""
        sid = _snapshot_id(res)
        ns = _ref_ns(res, namespace)

        def txn(c: Conn) -> list[bytes]:
            snap = Database.snapshot(c, sid)
            if snap is None:
                return []
            self._own(c, snap, ns)
            if snap.state == 1:
                raise StateError(f"snapshot {sid} is committed; abandon() only drops pending captures "
                                 "(delete() drops committed snapshots)")
            if snap.owner != self._owner:
                raise StateError(f"snapshot {sid} is a pending capture of another process")
            freed, gone = drop_subtree(c, sid)
            Database.add_counter(c, "abandoned", len(gone))
            self._note_gone(gone, f"abandoned: its turn was abandoned (abandon({sid}))")
            return freed

        self._release(self._write(txn))

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
    def delete(self, ref: Any, *, namespace: str | None = None) -> DeleteResult:
        """Drop a snapshot of this identity and every descendant; returns what went.

        ``ref`` is a snapshot id, Match or SaveResult. Superseded ancestors left without children
        go too (they were only chain links). Refused with StateError while another process has a
        pending capture in the subtree (it would lose the parent it is extending).
        """
        sid = _snapshot_id(ref)
        ns = _ref_ns(ref, namespace)

        def txn(c: Conn) -> tuple[DeleteResult, list[bytes]]:
            snap = self._own(c, Database.snapshot(c, sid), ns)
            for d in [sid, *Database.descendants(c, sid)]:
                row = Database.snapshot(c, d)
                if row is not None and row.state == 0 and row.owner != self._owner:
                    raise StateError(f"snapshot {d} (in the subtree of {snap.id}) is a pending capture of "
                                     "another process; delete it after that capture is committed or abandoned")
            before = Database.stored_bytes(c)
            freed, gone = drop_subtree(c, sid)
            Database.add_counter(c, "deleted", len(gone))
            self._note_gone(gone, f"deleted (delete({sid}))")
            return DeleteResult(tuple(gone), before - Database.stored_bytes(c)), freed

        result, freed = self._write(txn)
        self._release(freed)
        return result

    # -- match -------------------------------------------------------------------------------
    @_operation
    def match(self, tokens: Any, *, namespace: str | None = None, exclude: Iterable[Any] = ()) -> Match | None:
        """The longest committed snapshot whose tokens are a prefix of ``tokens``, or None.

        ``exclude``: snapshot ids (or Match / SaveResult) to pass over — after a failed restore,
        match again excluding it to fall back to the next-longest prefix.
        """
        arr = as_token_array(tokens)
        ns = _ns(namespace)
        if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
            raise InvalidInputError(f"exclude must be a collection of snapshot ids, got {exclude!r}")
        skip = {_snapshot_id(x) for x in exclude}
        if len(arr) == 0:
            return None
        index = TokenIndex(arr)
        not_before = time.time() - self.budget.ttl if self.budget.ttl else 0.0

        def find(c: Conn) -> SnapRow | None:
            broken = Database.quarantined_users(c)
            for sid, cn, key in Database.match_candidates(c, self.identity.key, ns, index.chain, len(arr),
                                                          not_before):
                if key != index.prefix_key(cn) or sid in skip:
                    continue
                chain = Database.chain(c, sid)
                if _needs_quarantined(chain, broken, leaf=True):
                    continue  # it cannot restore until a save heals its chunk: the next-longest serves
                if np.array_equal(self._tokens_of(c, chain), arr[:cn]):
                    return chain[-1]
            return None

        hit = self._repo.db.read(find)
        if self._remote is not None:  # the shared tier, when it may hold something longer
            far = self._remote.lookup(arr, ns, hit.n_tokens if hit is not None else 0)
            if far is not None:
                return far  # type: ignore[no-any-return]
        if hit is None:
            self._count("misses")
            return None
        self._count("hits")
        self._count("hit_tokens", hit.n_tokens)
        return Match(hit.id, hit.n_tokens, namespace)

    # -- restore -----------------------------------------------------------------------------
    def _chain(self, c: Conn, snap: SnapRow) -> list[SnapRow]:
        """``snap``'s chain, root first; every link must be of this identity (by key) and of the
        snapshot's namespace, so a damaged or reused parent link can never serve another's rows."""
        chain = Database.chain(c, snap.id)
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

    def _plan(self, c: Conn, sid: int, ns: str, into: Mapping[str, Any] | None,
              wanted: set[str], rows_from: int = 0) -> tuple[SnapRow, RestorePlan]:
        """Check that ``sid`` is this store's to restore and build (and validate) its plan."""
        snap = Database.snapshot(c, sid)
        if snap is None:
            raise SnapshotUnavailableError(f"snapshot {sid} no longer exists ({self._gone_why(sid)}); "
                                           "nothing was written", snapshot_id=sid)
        if not self._mine(c, snap):
            raise IdentityError(f"snapshot {sid} belongs to another identity than this store was opened for")
        if snap.namespace != ns:
            raise IdentityError(f"snapshot {sid} belongs to another namespace")
        if snap.state == 0 and snap.owner != self._owner:
            raise SnapshotUnavailableError(f"snapshot {sid} is a pending capture of another process",
                                           snapshot_id=sid)
        if rows_from < 0 or rows_from > snap.n_tokens:
            raise InvalidInputError(f"rows_from={rows_from} is outside snapshot {sid}'s [0, {snap.n_tokens}] tokens")
        return snap, build_plan(c, sid, self._chain(c, snap), self.layout, into, wanted, rows_from)

    @_operation
    def restore(self, m: Any, into: Mapping[str, Any] | Callable[[MatchDetails], Mapping[str, Any]],
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
                m = self._remote.materialize(m, lambda c, fr: self._excess(c, fr) is None, self._iid)
            except _Retry:
                raise SnapshotUnavailableError("this store's identity was dropped as stale by another store "
                                               "during the fetch; match again", snapshot_id=None) from None
        sid = _snapshot_id(m)
        ns = _ref_ns(m, namespace)
        k = _count_of(rows_from, "rows_from")
        wanted = self._wanted(components)
        t0 = time.perf_counter()
        if callable(into) and not isinstance(into, Mapping):  # plan, then write: see _batch.py
            into = planned_destination(self.describe(sid, components, namespace=ns or None, rows_from=k), into)
        if not isinstance(into, Mapping):
            raise InvalidInputError("into must be a mapping of part name to writable buffer, or a callable "
                                    "that takes the plan (MatchDetails) and returns one")
        _, plan = self._repo.db.read(lambda c: self._plan(c, sid, ns, into, wanted, k))
        damage: Damage = []
        try:
            stream_plan(plan, self._repo.blob_path, self._staging, self._ram, damage)
        except RestoreError as e:
            if e.snapshot_id is None:
                e.snapshot_id = sid
            self._count("restore_errors")
            if damage:  # in the same call: snapshots using it stop matching until a save heals it
                try:
                    quarantine(self._repo.db, self._repo.blob_path, damage)
                except (StoreIOError, CorruptionError):
                    pass  # a later restore finds (and quarantines) it again
            raise
        # last use and the hit are bookkeeping: recorded in memory and written now only if the
        # write lock is free; a restore never queues behind a long writer for them
        self._record_use(sid, time.time())
        self._try_flush()
        return RestoreResult(plan.n_tokens, plan.rows, frozenset(plan.missing_components), plan.chain,
                             plan.nbytes, time.perf_counter() - t0)

    @_operation
    def describe(self, m: Any, components: Iterable[str] | None = None, *,
                 namespace: str | None = None, rows_from: int = 0) -> MatchDetails:
        """What restoring ``m`` would write — rows per stream, components, bytes — checked like a
        restore's plan but without destinations, so an engine can size its buffers first."""
        sid = _snapshot_id(m)
        ns = _ref_ns(m, namespace)
        wanted = self._wanted(components)
        k = _count_of(rows_from, "rows_from")

        def run(c: Conn) -> MatchDetails:
            snap, plan = self._plan(c, sid, ns, None, wanted, k)
            held = {p.component for p in Database.parts(c, sid) if p.component is not None}
            return MatchDetails(
                snapshot_id=sid, n_tokens=plan.n_tokens, namespace=ns or None, rows=dict(plan.rows),
                components=frozenset(held), missing_components=frozenset(plan.missing_components),
                part_bytes=dict(plan.part_bytes), nbytes=sum(plan.part_bytes.values()),
                chain=list(plan.chain), pending=snap.state == 0, rows_from=k)

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
                             _count_of(rows_from, "rows_from"))

    def turn(self, *, session: str | None = None, namespace: str | None = None, parent: Any = "auto") -> Turn:
        """A capture chain for one turn: ``with store.turn(session=...) as t: t.capture(tokens, parts)``."""
        self._check_open()
        return Turn(self, session=session, namespace=namespace, parent=parent)

    # -- inspection --------------------------------------------------------------------------
    @_operation
    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot of this store's identity (all namespaces), oldest first."""
        ident = self.identity.key

        def run(c: Conn) -> list[SnapshotInfo]:
            out: list[SnapshotInfo] = []
            iid = Database.identity_id(c, ident)  # by key, in this transaction: never a reused id
            if iid is None:
                return out
            for s in Database.snapshots(c, iid):
                parts = Database.parts(c, s.id)
                out.append(SnapshotInfo(
                    snapshot_id=s.id, identity=ident, namespace=s.namespace or None, parent_id=s.parent_id,
                    n_tokens=s.n_tokens, depth=s.depth, session=s.session, pending=s.state == 0,
                    matchable=bool(s.matchable), pinned=Database.has_children(c, s.id), created=s.created,
                    last_used=s.last_used, hits=s.hits, logical_bytes=s.logical_bytes,
                    segment_bytes=sum(p.nbytes for p in parts),
                    rows={p.name: p.row_end for p in parts if p.kind == 1},
                    components=sorted({p.component for p in parts if p.component is not None})))
            return out

        return self._repo.db.read(run)

    @_operation
    def stats(self) -> Stats:
        """Counters and totals (see docs/api.md)."""
        self._write(lambda c: None, durable=False)
        return self._repo.db.read(lambda c: stats_of(c, self.budget.disk_bytes or 0,
                                                     self._ram.used if self._ram else 0))

    @_operation
    def verify(self, deep: bool = True) -> Any:
        """Check the store (see snapstore verify); returns a VerifyReport."""
        from ._maintenance import verify
        report = verify(self._repo, deep=deep, pending_lease=self.pending_lease)
        if self._ram is not None:
            for cid in report.damaged_chunks:
                self._ram.discard(cid)
        return report

    @_operation
    def gc(self, *, grace: float = 3600.0, dry_run: bool = False) -> Any:
        """Collect orphan and temp files, dead pending captures, expired snapshots, over-budget leaves."""
        from ._maintenance import gc
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
        if self._remote is not None:
            try:
                self._remote.close()  # finishes the queued uploads first
            finally:
                self._remote = None
        try:
            self._lease_owner.stop()  # no renewal may re-register the row this transaction deletes

            def txn(c: Conn) -> list[bytes]:
                freed: list[bytes] = []
                for snap in Database.pending(c):
                    if snap.owner == self._owner and Database.snapshot(c, snap.id) is not None:
                        f, gone = drop_subtree(c, snap.id)
                        freed += f
                        Database.add_counter(c, "abandoned", len(gone))
                self._lease_owner.retire(c)
                f, gone, dead = collect_dead(c, self._repo.root, self.pending_lease)
                dead_owners[:] = dead
                if gone:
                    Database.add_counter(c, "abandoned", len(gone))
                return freed + f

            if not self._lease_owner.inherited:  # a forked child's copy: the parent's captures and row stay
                self._release(self._write(txn))
        finally:
            try:
                self._lease_owner.release()  # after the transaction: our captures are gone before the lock is free
                reap_lock_files(self._repo.root, dead_owners)
                self._pool.shutdown(wait=True)
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


def stats_of(c: Conn, disk_budget: int, ram_used: int) -> Stats:
    """Stats from the catalog (shared by Store.stats and the CLI)."""
    quarantined = Database.quarantined_count(c)
    counters = Database.counters(c)
    stored, logical, entries, allsnaps = Database.totals(c)
    pending, nchunks, raw = Database.census(c)
    return Stats(
        entries=entries, snapshots=allsnaps, pending=pending,
        inserts=counters.get("inserts", 0), hits=counters.get("hits", 0), misses=counters.get("misses", 0),
        hit_tokens=counters.get("hit_tokens", 0), restores=counters.get("restores", 0),
        evictions=counters.get("evictions", 0), supersedes=counters.get("supersedes", 0),
        expired=counters.get("expired", 0), abandoned=counters.get("abandoned", 0),
        stale_dropped=counters.get("stale_dropped", 0),
        skipped={k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("skipped:")},
        stored_bytes=stored, logical_bytes=logical,
        dedup_ratio=(raw / stored) if stored else 1.0,
        ram_hits=counters.get("ram_hits", 0), ram_bytes=ram_used, disk_budget=disk_budget, chunks=nchunks,
        quarantined=quarantined, healed=counters.get("healed", 0))
