"""The default shared-tier restore: stream the chain into the destination, import the same bytes later.

A fetch into the local tier before the restore is bound by the local disk (a write and an fsync
per chunk: 0.41x a raw GET, docs/benchmarks.md "Shared tier"). The tee takes the disk off the
restore's path: the chunk objects the restore needs, then the rest of the chain the local tier
lacks, are read from the bucket a few at a time, each checked whole (size, header, XXH3-128: what
a local restore checks) before any of its bytes is written into the destination, so nothing
unchecked ever reaches the engine; the restore returns when the destination is filled. The same
checked bytes go to the :class:`Importer`, one background thread that publishes them as local
chunk files (content address checked too, each fsynced) and only then inserts the chain in one
transaction (``Fetcher``), so the next request for the prompt is local. A crash before that
transaction leaves only chunk files no row references (orphans ``gc`` removes); nothing
half-imported is ever visible.

The bytes held for queued imports are bounded (``SNAPSTORE_REMOTE_TEE_MIB``, default 1024): a
chunk read beyond the bound is written into the destination and dropped, and its import reads it
from the bucket again, so memory never grows with the fleet's traffic and the restore never waits
for the local disk.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from snapstore._config import env_int
from snapstore._errors import RemoteError, RestoreError
from snapstore._layout import Layout
from snapstore._results import RestoreResult
from snapstore.catalog.db import Conn
from snapstore.catalog.queries import ChunkRow
from snapstore.chunks.chunkfile import HEADER_SIZE
from snapstore.plan.restore_plan import PlanItem
from snapstore.remote.bucket_restore import plan_by_chunk
from snapstore.remote.check import BadObject, ChunkCheck
from snapstore.remote.fetch import Fetcher, NoRoom, read_error
from snapstore.remote.find_chain import RemoteHit
from snapstore.remote.keys import chunk_key, pause_point
from snapstore.remote.manifest import ChunkEntry
from snapstore.remote.s3client import S3Client
from snapstore.restore.read import Planned

__all__ = ["Importer", "hold_limit", "tee_restore"]

_AHEAD = 2  # chunks read beyond the pool's width, waiting to be written (bounds what a restore holds)


def hold_limit() -> int:
    """Bytes the pending imports may hold in memory (``SNAPSTORE_REMOTE_TEE_MIB``, default 1024)."""
    mib = env_int("SNAPSTORE_REMOTE_TEE_MIB")
    return (1024 if mib is None else mib) << 20


@dataclass
class _Held:
    """One chunk object read and checked: its pieces as the client handed them (no copy), and the
    decoded raw bytes of a compressed one (None: the raw bytes are the pieces after the header)."""

    pieces: list[memoryview]
    decoded: memoryview | None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces)

    def write(self, item: PlanItem) -> None:
        """Write the chunk's raw bytes from ``item.skip`` on into ``item.sink`` at ``item.offset``."""
        if self.decoded is not None:
            item.sink.write(item.offset + item.skip, self.decoded[item.skip:])
            return
        start = HEADER_SIZE + item.skip  # the first object byte to write
        pos = 0
        for piece in self.pieces:
            lo = max(start - pos, 0)
            if lo < len(piece):
                item.sink.write(item.offset + pos + lo - HEADER_SIZE, piece[lo:])
            pos += len(piece)


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
    held: list[memoryview] = []
    try:
        check = ChunkCheck(e, None, size)
        for piece in pieces:
            if stop.is_set():
                return ("stopped", "")
            check.feed(piece)
            held.append(piece)  # kept as the client handed it: no copy while the GETs run
        decoded = check.finish()
    except BadObject as bad:
        return ("corrupt", bad.why)
    except RemoteError as err:
        return ("remote", str(err))
    return _Held(held, decoded)


def tee_restore(client: S3Client, hit: RemoteHit, planned: Planned, into: Mapping[str, Any], also: list[ChunkEntry],
                keep: Callable[[int], bool], pool: ThreadPoolExecutor, width: int,
                count: Callable[[str, int], None]) -> tuple[RestoreResult, dict[bytes, list[memoryview]]]:
    """Restore ``hit`` into ``into`` by its checked plan (:func:`~snapstore.remote.bucket_restore.plan_remote`,
    bound here), each chunk written once it has been read and checked whole; the
    chunks in ``also`` (the rest of what the local tier lacks) are read and checked too, not written.
    Returns the result and, by chunk id, the checked pieces of the chunks ``also`` names that
    ``keep(nbytes)`` (the Importer's memory bound) let it hold. ``touched`` on a failure says whether
    a destination byte was written (a failure stops every reader before the error is raised)."""
    t0 = time.perf_counter()
    plan, groups = plan_by_chunk(planned, into)
    entries = {cid: _entry(items[0].chunk) for cid, items in groups.items()}
    for e in also:
        entries.setdefault(e.id, e)
    wanted_ids = {e.id for e in also}
    todo = deque(entries.values())  # the restore's chunks first, in plan order
    stop = threading.Event()
    pending: deque[tuple[ChunkEntry, Future[_Held | tuple[str, str]]]] = deque()
    given: dict[bytes, list[memoryview]] = {}
    failure: BaseException | None = None
    touched = False
    fetched = [0, 0]

    def more() -> None:
        while todo and len(pending) < width + _AHEAD:
            e = todo.popleft()
            pending.append((e, pool.submit(_read_whole, client, hit.scope, e, stop)))

    try:
        more()
        while pending:
            e, fut = pending.popleft()
            got = fut.result()
            if isinstance(got, tuple):
                err = _error(e, got, count, touched)  # a corrupt object is counted either way
                if e.id in groups:
                    failure = err
                    break
                # read only for the import (not written here): the import fetches it again and fails
                # alone (counted), and the restore, its destination filled with checked bytes, stands
                more()
                continue
            fetched[0] += 1
            fetched[1] += got.nbytes
            for item in groups.get(e.id, ()):  # the calling thread writes (engines' writers never run on pools)
                touched = True
                got.write(item)
            if e.id in wanted_ids and keep(got.nbytes):
                given[e.id] = got.pieces
            more()
    except BaseException as err:  # an engine's writer failed (a RestoreError already), or an interrupt
        failure = err
    finally:
        stop.set()
        wait([f for _e, f in pending])  # nothing reads on once the caller sees the error
    count("remote_fetched_chunks", fetched[0])
    count("remote_fetched_bytes", fetched[1])
    if failure is not None:
        if isinstance(failure, RestoreError) and touched:
            failure.touched = True
        raise failure
    count("remote_tee_restores", 1)
    res = RestoreResult(plan.n_tokens, plan.rows, frozenset(plan.missing_components), [], plan.nbytes,
                        time.perf_counter() - t0)
    return res, given


def _error(e: ChunkEntry, got: tuple[str, str], count: Callable[[str, int], None], touched: bool) -> RestoreError:
    return read_error(e, got[0], got[1], count, touched)


class Importer:
    """One background thread: publish a tee'd chain's checked bytes locally, then insert the chain.

    Holds at most ``limit`` bytes for the imports queued (:meth:`reserve`); one import per chain leaf at a time.
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

    def reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more for an import if the bound allows (else the import fetches that chunk)."""
        with self._lock:
            if self._held + nbytes > self.limit:
                return False
            self._held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` granted (a restore that failed, an import that finished)."""
        with self._lock:
            self._held -= nbytes

    def busy(self, hit: RemoteHit) -> bool:
        """Is an import of this chain's leaf already queued (then a restore need not queue another)?"""
        with self._lock:
            return hit.chain[-1].name in self._leaves

    def submit(self, hit: RemoteHit, given: dict[bytes, list[memoryview]], layout: Layout,
               fits: Callable[[Conn, list[bytes]], bool], identity_id: Callable[[Conn], int],
               used: Callable[[], None]) -> None:
        """Queue the import of ``hit`` from ``given`` (reserved; the restore already returned)."""
        nbytes = sum(len(p) for v in given.values() for p in v)
        leaf = hit.chain[-1].name
        with self._lock:
            if leaf in self._leaves:
                self._held -= nbytes
                return
            self._leaves.add(leaf)

        def run() -> None:
            try:
                pause_point("import")
                self._fetcher.materialize(hit, fits, identity_id, layout, given)
                self._count("remote_tee_imports", 1)
            except NoRoom:
                self._count("remote_no_room", 1)  # pinned leaves hold the budget: it stays in the bucket
            except Exception:  # noqa: BLE001 - the restore it follows succeeded; nobody waits on this thread
                self._count("remote_import_errors", 1)  # the chain stays in the bucket: the next restore tees again
            finally:
                given.clear()
                with self._lock:
                    self._held -= nbytes
                    self._leaves.discard(leaf)
            used()  # the restore used the chain whether or not it was imported: the bucket's gc sees that

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
