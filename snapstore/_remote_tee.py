"""The default shared-tier restore: read the chain into memory checked, fill the destination, import later.

A fetch into the local tier before the restore is bound by the local disk (a write and an fsync
per chunk: 0.41x a raw GET, docs/benchmarks.md "Shared tier"). The tee takes the disk off the
restore's path: every chunk object the restore needs, and every other chunk of the chain the
local tier lacks, is read from the bucket a few at a time and checked whole (size, header,
XXH3-128: what a local restore checks) before a byte of any of them reaches the destination; the
destination is then filled from memory and the restore returns. The same checked bytes go to the
:class:`Importer`, one background thread that publishes them as local chunk files (address
checked too, each fsynced) and only then inserts the chain in one transaction (``Fetcher``), so
the next request for the prompt is local. A crash before that transaction leaves only chunk
files no row references (orphans ``gc`` removes); nothing half-imported is ever visible.

The bytes held for pending imports are bounded (``SNAPSTORE_REMOTE_TEE_MIB``, default 1024): a
chain that would exceed it is fetched into the local tier first, as ``SNAPSTORE_REMOTE_RESTORE=fetch``
does, so memory never grows with the fleet's traffic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ._catalog import ChunkRow
from ._chunkfile import HEADER_SIZE
from ._config import env_int
from ._db import Conn
from ._errors import RemoteError, RestoreError, SnapshotUnavailableError
from ._layout import Layout
from ._manifest import ChunkEntry
from ._plan import build_plan
from ._remote_check import BadObject, ChunkCheck, corrupt
from ._remote_fetch import Fetcher, NoRoom, fetch_failed
from ._remote_keys import chunk_key, pause_point
from ._remote_lookup import RemoteHit
from ._remote_stream import ManifestSource
from ._results import RestoreResult
from ._s3client import S3Client

__all__ = ["Importer", "hold_limit", "tee_restore"]


def hold_limit() -> int:
    """Bytes the pending imports may hold in memory (``SNAPSTORE_REMOTE_TEE_MIB``, default 1024)."""
    mib = env_int("SNAPSTORE_REMOTE_TEE_MIB")
    return (1024 if mib is None else mib) << 20


@dataclass
class _Held:
    """One chunk object read and checked: the object's bytes and the raw bytes they carry."""

    obj: memoryview
    raw: memoryview


def _entry(ch: ChunkRow | ChunkEntry) -> ChunkEntry:
    return ChunkEntry(ch.id, ch.raw_len, ch.stored_len, ch.codec, ch.checksum)


def _read_whole(client: S3Client, scope: str, e: ChunkEntry, stop: threading.Event) -> _Held | tuple[str, str]:
    """Read one chunk object into memory and check it; its bytes, or (kind, why) on a failure."""
    if stop.is_set():
        return ("stopped", "")
    pause_point("fetch")
    try:
        got = client.stream(chunk_key(scope, e.id))
    except RemoteError as err:
        return ("remote", str(err))
    if got is None:
        return ("missing", "")
    size, pieces = got
    try:
        check = ChunkCheck(e, None, size)
        buf = memoryview(bytearray(size))
        at = 0
        for piece in pieces:
            if stop.is_set():
                return ("stopped", "")
            check.feed(piece)  # raises before a piece could overrun the buffer
            buf[at:at + len(piece)] = piece
            at += len(piece)
        decoded = check.finish()
    except BadObject as bad:
        return ("corrupt", bad.why)
    except RemoteError as err:
        return ("remote", str(err))
    return _Held(buf, decoded if decoded is not None else buf[HEADER_SIZE:])


def tee_restore(client: S3Client, hit: RemoteHit, layout: Layout, into: Mapping[str, Any], wanted: set[str],
                rows_from: int, also: list[ChunkEntry], pool: ThreadPoolExecutor,
                count: Callable[[str, int], None]) -> tuple[RestoreResult, dict[bytes, memoryview]]:
    """Restore ``hit`` into ``into`` from memory once every chunk it needs and every chunk in ``also``
    (the rest of what the local tier lacks) has been read and checked; the result and the checked
    object bytes by chunk id, for the Importer. On any failure nothing was written (``touched``
    False) unless an engine's writer failed part-way."""
    t0 = time.perf_counter()
    src = ManifestSource(hit)
    plan = build_plan(src, len(src.chain), src.chain, layout, into, wanted, rows_from)
    entries = {item.chunk.id: _entry(item.chunk) for item in plan.items}
    for e in also:
        entries.setdefault(e.id, e)
    stop = threading.Event()
    futs: dict[bytes, Future[_Held | tuple[str, str]]] = {
        cid: pool.submit(_read_whole, client, hit.scope, e, stop) for cid, e in entries.items()}
    held: dict[bytes, _Held] = {}
    failure: RestoreError | None = None
    try:
        for cid, fut in futs.items():
            got = fut.result()
            if isinstance(got, tuple):
                failure = _error(entries[cid], got, count)
                break
            held[cid] = got
    finally:
        stop.set()
        wait(futs.values())
    count("remote_fetched_chunks", len(held))
    count("remote_fetched_bytes", sum(h.obj.nbytes for h in held.values()))
    if failure is not None:
        raise failure
    touched = False
    try:
        for item in plan.items:  # the calling thread writes (engines' writers are never called from pools)
            raw = held[item.chunk.id].raw
            touched = True
            item.sink.write(item.offset + item.skip, raw[item.skip:])
    except RestoreError as e:
        e.touched = e.touched or touched
        raise
    count("remote_tee_restores", 1)
    res = RestoreResult(plan.n_tokens, plan.rows, frozenset(plan.missing_components), [], plan.nbytes,
                        time.perf_counter() - t0)
    return res, {cid: h.obj for cid, h in held.items()}


def _error(e: ChunkEntry, got: tuple[str, str], count: Callable[[str, int], None]) -> RestoreError:
    kind, why = got
    if kind == "corrupt":
        return corrupt(e, why, count)
    if kind == "remote":
        return fetch_failed(e, why)
    return SnapshotUnavailableError(f"chunk {e.id.hex()} is missing from the shared tier (removed by gc or lost); "
                                    "nothing was written")


class Importer:
    """One background thread: publish a tee'd chain's checked bytes locally, then insert the chain.

    Holds at most ``limit`` bytes for the imports queued; one import per chain leaf at a time.
    """

    def __init__(self, fetcher: Fetcher, count: Callable[[str, int], None], limit: int):
        self._fetcher = fetcher
        self._count = count
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0
        self._leaves: set[str] = set()
        self._pending: set[Future[None]] = set()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapstore-import")

    def room(self, nbytes: int) -> bool:
        """Could ``nbytes`` more be held for an import now?"""
        with self._lock:
            return self._held + nbytes <= self.limit

    def busy(self, hit: RemoteHit) -> bool:
        """Is an import of this chain's leaf already queued (then a restore need not queue another)?"""
        with self._lock:
            return hit.chain[-1].name in self._leaves

    def submit(self, hit: RemoteHit, given: dict[bytes, memoryview], layout: Layout,
               fits: Callable[[Conn, list[bytes]], bool], identity_id: Callable[[Conn], int],
               used: Callable[[], None]) -> None:
        """Queue the import of ``hit`` from ``given`` (the restore already returned)."""
        nbytes = sum(v.nbytes for v in given.values())
        leaf = hit.chain[-1].name
        with self._lock:
            if leaf in self._leaves:
                return
            self._leaves.add(leaf)
            self._held += nbytes

        def run() -> None:
            try:
                pause_point("import")
                self._fetcher.materialize(hit, fits, identity_id, layout, given)
                self._count("remote_tee_imports", 1)
                used()
            except NoRoom:
                self._count("remote_no_room", 1)  # pinned leaves hold the budget: it stays in the bucket
            except Exception:  # noqa: BLE001 - the restore it follows succeeded; nobody waits on this thread
                self._count("remote_import_errors", 1)  # the chain stays in the bucket: the next restore tees again
            finally:
                given.clear()
                with self._lock:
                    self._held -= nbytes
                    self._leaves.discard(leaf)

        fut = self._thread.submit(run)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def flush(self, timeout: float | None) -> bool:
        """Wait for the queued imports; False when ``timeout`` ran out first."""
        with self._lock:
            pending = set(self._pending)
        _done, left = wait(pending, timeout=timeout)
        return not left

    def close(self) -> None:
        """Finish the queued imports, then stop the thread."""
        self._thread.shutdown(wait=True)
