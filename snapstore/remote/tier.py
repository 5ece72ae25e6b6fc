"""The shared tier: one Store's view of S3-compatible object storage behind its local tier.

This module wires the jobs together and holds the one restore policy; each job has its module:
object names and timing (``remote.keys``), upload (``remote.upload_chain`` behind the background
queue of ``remote.uploader``), lookup from a prompt (``remote.find_chain``), fetch into the local tier
(``remote.fetch``), restore chunk by chunk and import in the background (``remote.tee``),
restore straight from the bucket (``remote.bucket_restore``), the checks every fetched chunk passes
(``remote.check``). A restore checks the chain's plan once (``bucket_restore.plan_remote``) and binds
it to the destinations as often as it needs. Layout and protocol: docs/format.md "Shared tier".

Restore policy (``SNAPSTORE_REMOTE_RESTORE``): ``tee`` (default) streams the chain into the
destination, each chunk checked whole before it is written, and returns, while a background
thread imports the same bytes into the local tier, so the next request for the prompt is local;
``fetch`` imports first, then restores locally (a failure never touches the destination); a chain
that cannot fit the local budget (or the disk) is streamed by both. ``stream`` always streams: nothing
is written locally (docs/benchmarks.md "Shared tier" measures the three).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Set
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from snapstore._config import env_flag, env_int
from snapstore._errors import ConfigError, InvalidInputError, RemoteError, SnapshotUnavailableError
from snapstore._identity import Identity
from snapstore._layout import Layout
from snapstore._results import Match, RestoreResult, SaveResult
from snapstore.catalog.db import Conn
from snapstore.chunks.chunkfile import scope_key
from snapstore.chunks.repo import Repo
from snapstore.lifecycle.access import Retry
from snapstore.plan.prefix import granularity
from snapstore.remote.bucket_restore import describe_remote, plan_remote, remote_details, stream_restore
from snapstore.remote.fetch import Fetcher, NoRoom
from snapstore.remote.find_chain import Lookup, RemoteHit, RemoteMatch
from snapstore.remote.keys import LAYOUT, LEASE_TTL, chunk_key, gc_window, manifest_key, use_key
from snapstore.remote.manifest import ChunkEntry
from snapstore.remote.s3client import S3Client
from snapstore.remote.tee import Importer, hold_limit, tee_restore
from snapstore.remote.upload_chain import Publisher
from snapstore.remote.uploader import FlushResult, Uploader
from snapstore.restore.read import Planned, planned_destination

# LAYOUT, LEASE_TTL and the key functions are re-exported: they lived here before the split
__all__ = ["LAYOUT", "LEASE_TTL", "RemoteHit", "RemoteMatch", "RemoteTier", "chunk_key", "gc_window",
           "manifest_key", "open_remote", "restore_mode", "use_key"]

_WIDTH = 4  # objects read or written at once (docs/benchmarks.md "Shared tier")
_MODES = ("tee", "fetch", "stream")


def restore_mode() -> str:
    """``SNAPSTORE_REMOTE_RESTORE``: ``tee`` (default: streamed, imported in the background),
    ``fetch`` (import, then restore locally) or ``stream`` (never import); tee and fetch stream what cannot fit."""
    mode = os.environ.get("SNAPSTORE_REMOTE_RESTORE", "").strip().lower() or "tee"
    if mode not in _MODES:
        raise ConfigError(f"$SNAPSTORE_REMOTE_RESTORE must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


class RemoteTier:
    """One Store's shared tier: upload queue, lookup, fetch into the local tier or stream to the caller
    (the S3 implementation of :class:`snapstore.tiers.interface.SharedTier`)."""

    present = True

    def __init__(self, client: S3Client, repo: Repo, identity: Identity, owner: str,
                 count: Callable[[str, int], None], *, wait: bool, queue: int):
        self.client = client
        self._identity = identity
        self._count = count
        self.wait = wait
        self._pool = ThreadPoolExecutor(max_workers=_WIDTH, thread_name_prefix="snapstore-remote")
        writer = f"{owner.split(':')[0][:40]}-{secrets.token_hex(6)}"
        self._publisher = Publisher(client, repo, identity, writer, self.scope, count, self._pool)
        self._lookup = Lookup(client, identity, self.scope, count, self._pool)
        self._fetcher = Fetcher(client, repo, identity, count, self._pool)
        # the importer writes on its own threads: a restore's reads never queue behind its fsyncs
        self._import_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snapstore-import-io")
        self._importer = Importer(Fetcher(client, repo, identity, count, self._import_pool), count, hold_limit())
        self._uploader = Uploader(self.publish, count, maxsize=queue) if not wait else None

    def scope(self, ns: str) -> str:
        """The hex scope (BLAKE3 key of this identity and a namespace) that names its objects."""
        return scope_key(self._identity.key, ns).hex()

    # -- hooks the Store calls ---------------------------------------------------------------
    def saved(self, res: SaveResult) -> None:
        """After a save or commit made ``res`` durable locally: a committed snapshot is published (queued, or
        now in wait mode); a pending one waits for its commit."""
        if res.snapshot_id is None or res.pending:
            return
        if self._uploader is not None:
            self._uploader.enqueue(res.snapshot_id)
        else:
            self.publish(res.snapshot_id)

    def publish(self, sid: int) -> None:
        """Publish a committed snapshot's chain now (see remote.upload_chain)."""
        self._publisher.publish(sid)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Wait for the queued uploads (see Uploader.flush), then for the background imports of tee'd restores
        (``timed_out`` when ``timeout`` ran out on them; the uploads' counts are reported either way)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        res = FlushResult() if self._uploader is None else self._uploader.flush(timeout)
        if not self._importer.flush(None if deadline is None else max(0.0, deadline - time.monotonic())):
            # the uploads' counts were taken (reset) above: returned, not raised away with them
            return FlushResult(res.uploaded, res.failed, res.dropped,
                               [*res.errors, f"flush: imports of restored chains still pending after {timeout} s; "
                                             "they continue in the background"], timed_out=True)
        return res

    def uploads(self) -> dict[str, int]:
        """Uploads queued and in flight now (``Store.stats().remote``)."""
        queued, busy = self._uploader.pending() if self._uploader is not None else (0, 0)
        return {"upload_queue": queued, "uploading": busy}

    def close(self) -> None:
        """Finish queued uploads, then release threads."""
        try:
            if self._uploader is not None:
                self._uploader.close()
        finally:
            self._importer.close()  # finishes the imports queued: the restores' local copies
            self._import_pool.shutdown(wait=True)
            self._pool.shutdown(wait=True)

    def has(self, m: object) -> bool:
        """Whether ``m`` is a match this tier found (:meth:`lookup`): restored through :meth:`restore`."""
        return getattr(m, "remote", None) is not None

    def lookup(self, arr: np.ndarray, ns: str, have: int) -> RemoteMatch | None:
        """The longest chain in the bucket matching ``arr``, longer than ``have`` (see remote.find_chain)."""
        return self._lookup.lookup(arr, ns, have)

    # -- restore -----------------------------------------------------------------------------
    def materialize(self, m: RemoteMatch, fits: Callable[[Conn, list[bytes]], bool],
                    identity_id: Callable[[Conn], int], layout: Layout, protect: Set[int] = frozenset()) -> Match:
        """Fetch the chain into the local tier (every chunk checked), never evicting ``protect``; a local
        Match. SnapshotUnavailableError when it does not fit the local budget."""
        hit = _hit(m)
        try:
            sid = self._fetcher.materialize(hit, fits, identity_id, layout, protect=protect)
        except NoRoom:
            raise SnapshotUnavailableError(
                f"the shared tier's snapshot ({hit.chain[-1].n_tokens} tokens) does not fit the local budget "
                "even after evicting unpinned leaves; nothing was written") from None
        self._used(hit)
        return Match(sid, m.n_tokens, m.namespace)

    def localize(self, requests: list[Any], store: Any, wanted: set[str], rows_from: int) -> list[Any]:
        """``restore_many``'s requests (of ``store``) with each shared-tier match fetched into the local
        tier first (every chunk checked) and replaced by its local Match: a batch reads its shared chunks
        once, locally. SnapshotUnavailableError, before anything is written, for a chain that cannot fit;
        the plan's errors (DestinationError: a chain this layout cannot read) before anything is imported."""
        def fits(c: Conn, _freed: list[bytes]) -> bool:
            return bool(store._capacity.excess(c) is None)

        for pair in requests:  # every chain checked against this layout before any is imported
            if isinstance(pair, tuple) and len(pair) == 2 and getattr(pair[0], "remote", None) is not None:
                describe_remote(_hit(pair[0]), store.layout, wanted, rows_from)
        # the batch's local snapshots, and the chains fetched for it, are never evicted to fit the next
        keep: set[int] = set()
        for pair in requests:
            if isinstance(pair, tuple) and len(pair) == 2 and getattr(pair[0], "remote", None) is None:
                sid = getattr(pair[0], "snapshot_id", pair[0])
                if isinstance(sid, (int, np.integer)) and not isinstance(sid, bool):
                    keep.add(int(sid))  # a bad reference is refused later, by restore_batch
        out = []
        for pair in requests:
            if isinstance(pair, tuple) and len(pair) == 2 and getattr(pair[0], "remote", None) is not None:
                try:
                    pair = (self.materialize(pair[0], fits, store._access.iid, store.layout, keep), pair[1])
                    keep.add(pair[0].snapshot_id)
                except SnapshotUnavailableError as e:
                    raise SnapshotUnavailableError(
                        f"restore_many: a shared-tier match must be fetched into the local tier first and could "
                        f"not be: {e}; restore() it alone or in a smaller batch (a restore() streams what does not "
                        "fit; a batch's chains are never evicted for each other)") from None
            out.append(pair)
        return out

    def nbytes(self, m: RemoteMatch, layout: Layout, wanted: set[str]) -> int:
        """The bytes restoring shared-tier match ``m`` writes (``Store.estimate_restore``)."""
        return describe_remote(_hit(m), layout, wanted, 0).nbytes

    def restore(self, m: RemoteMatch, into: Any, layout: Layout, wanted: set[str], rows_from: int,
                fits: Callable[[Conn, list[bytes]], bool], room: Callable[[int], bool],
                identity_id: Callable[[Conn], int]) -> Match | RestoreResult:
        """Serve a shared-tier match: the RestoreResult of a tee (the default: imported in the background)
        or streamed restore, or a local Match to restore (``fetch``: imported first). ``room(n)``: could
        n more bytes fit locally."""
        hit = _hit(m)
        rows = hit.chain[-1].n_tokens // granularity(layout)  # rows_from counts rows, as a local restore checks
        if rows_from > rows:
            raise InvalidInputError(f"rows_from={rows_from} is past the {rows} rows (of {granularity(layout)} tokens) "
                                    "that restoring this shared-tier match writes; nothing was written")
        mode = restore_mode()
        # the plan's checks, once (a chain of another granularity, dtype or shape): a chain this layout
        # cannot read is never imported, where it would take the budget and match again; a tee or a
        # stream binds this one checked plan to the destinations (each checked before a byte is written)
        planned = plan_remote(hit, layout, wanted, rows_from)
        if mode != "stream":
            missing = self._fetcher.missing(hit)
            need = sum(e.stored_len for e in missing)
            if room(need) and mode == "tee":
                return self._tee(hit, planned, into, layout, rows_from, missing, fits, identity_id)
            if room(need):
                try:
                    sid = self._fetcher.materialize(hit, fits, identity_id, layout)
                    self._used(hit)
                    return Match(sid, m.n_tokens, m.namespace)
                except NoRoom:
                    pass  # pinned leaves hold the budget: stream it instead (counted below)
                except Retry:  # identity_id(): this store's identity row is gone
                    raise SnapshotUnavailableError("this store's identity was dropped as stale by another "
                                                   "store during the fetch; match again", snapshot_id=None) from None
            self._count("remote_no_room", 1)
        dest = planned_destination(into, lambda: remote_details(planned, hit, rows_from))
        res = stream_restore(self.client, hit, planned, dest, self._pool, _WIDTH, self._count)
        self._used(hit)
        return res

    def _tee(self, hit: RemoteHit, planned: Planned, into: Any, layout: Layout, rows_from: int,
             missing: list[ChunkEntry], fits: Callable[[Conn, list[bytes]], bool],
             identity_id: Callable[[Conn], int]) -> RestoreResult:
        """Restore chunk by chunk by the checked plan (each chunk checked before it is written), then queue
        the import (``remote.tee``)."""
        dest = planned_destination(into, lambda: remote_details(planned, hit, rows_from))
        busy = self._importer.busy(hit)  # an import of this chain is queued: read only what the restore needs
        reserved = [0]

        def keep(n: int) -> bool:  # the importer's memory bound: a chunk beyond it is read again by the import
            if self._importer.reserve(n):
                reserved[0] += n
                return True
            return False

        try:
            res, given = tee_restore(self.client, hit, planned, dest, [] if busy else missing, keep, self._pool,
                                     _WIDTH, self._count)
        except BaseException:
            self._importer.release(reserved[0])
            raise
        if busy:
            self._used(hit)
        else:
            self._importer.submit(hit, given, layout, fits, identity_id, lambda: self._used(hit))
        return res

    def _used(self, hit: RemoteHit) -> None:
        try:
            self.client.put(use_key(hit.scope, hit.chain[-1].name), b"")
        except RemoteError:
            pass  # last use is a hint for the budget, not worth failing a restore


def _hit(m: Any) -> RemoteHit:
    hit = getattr(m, "remote", None)
    if not isinstance(hit, RemoteHit):
        raise SnapshotUnavailableError("not a match from the shared tier; nothing was written")
    return hit


def open_remote(url: str | None, repo: Repo, identity: Identity, owner: str, count: Callable[[str, int], None],
                wait: bool | None) -> RemoteTier | None:
    """The shared tier for ``url`` (else ``$SNAPSTORE_REMOTE``), or None when neither is set."""
    url = url if url is not None else (os.environ.get("SNAPSTORE_REMOTE") or None)
    if not url:
        return None
    if wait is None:
        wait = env_flag("SNAPSTORE_REMOTE_WAIT", False)
    queue = env_int("SNAPSTORE_REMOTE_QUEUE") or 256
    gc_window()  # malformed settings fail at open, not in the background or mid-restore
    restore_mode()
    return RemoteTier(S3Client(url), repo, identity, owner, count, wait=bool(wait), queue=queue)
