"""Restore a shared-tier chain straight from the bucket into the destination, publishing nothing locally.

Used when the chain does not fit the local budget (or ``SNAPSTORE_REMOTE_RESTORE=stream``). The
plan is the local restore's (:func:`check_plan` over the chain's manifests, :func:`plan_remote`):
chain contiguous, parts checked once per restore, then bound to the destinations as often as the
restore needs (each destination checked before a byte is written), as a local restore's
:class:`~snapstore.restore.read.Planned` is. Then a few chunk objects are read at once;
each is checked as it arrives (size, header, XXH3-128 of the raw bytes: what a local restore
checks; there is no BLAKE3 address to check because nothing is published under it). A raw chunk
bound for a contiguous host destination is copied piece by piece into place (one copy, as a local
restore reads a file into place) and checked as it lands; any other is assembled in a buffer,
checked, then written by the calling thread (engines' writers are never called from pool threads).
A failure stops every reader before the error reaches the caller, with ``touched`` saying whether
the destination was modified.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from snapstore._errors import RemoteError, RestoreError
from snapstore._layout import Layout
from snapstore._results import MatchDetails, RestoreResult
from snapstore.catalog.queries import ChunkRow, PartRow, SnapRow
from snapstore.plan.restore_plan import PlanItem, RestorePlan, check_plan
from snapstore.remote.check import BadObject, ChunkCheck
from snapstore.remote.fetch import read_error
from snapstore.remote.find_chain import RemoteHit
from snapstore.remote.keys import chunk_key, pause_point
from snapstore.remote.manifest import ChunkEntry
from snapstore.remote.s3client import S3Client
from snapstore.restore.read import Planned

__all__ = ["ManifestSource", "describe_remote", "plan_by_chunk", "plan_remote", "remote_details", "stream_restore"]

_AHEAD = 2  # chunks fetched beyond the pool's width, waiting to be written (bounds the memory held)


class ManifestSource:
    """A remote chain's manifests as a plan reads them: links numbered 1..k, root first."""

    def __init__(self, hit: RemoteHit):
        self.chain: list[SnapRow] = []
        self._parts: dict[int, list[PartRow]] = {}
        self._chunks: dict[tuple[int, str], list[ChunkRow | None]] = {}
        for i, mf in enumerate(hit.chain, start=1):
            self.chain.append(SnapRow(
                id=i, identity_id=0, namespace=mf.namespace, parent_id=i - 1 if i > 1 else None, depth=i - 1,
                n_tokens=mf.n_tokens, base_tokens=mf.base_tokens, token_width=mf.token_width, tokens=mf.tokens,
                anchor=mf.anchor, prefix_key=mf.prefix_key, content_key=mf.content_key, session=None, state=1,
                owner=None, matchable=int(mf.matchable), created=mf.created, last_used=mf.created, hits=0,
                logical_bytes=mf.logical_bytes))
            self._parts[i] = [PartRow(i, p.name, p.kind, p.dtype, tuple(p.shape), p.component, p.row_start,
                                      p.row_end, p.nbytes, p.tokens_per_row) for p in mf.parts]
            for p in mf.parts:
                self._chunks[(i, p.name)] = [ChunkRow(ch.id, ch.raw_len, ch.stored_len, ch.codec, ch.checksum,
                                                      0, mf.created, b"") for ch in p.chunks]

    def parts(self, sid: int) -> list[PartRow]:
        """The parts of link ``sid``."""
        return self._parts.get(sid, [])

    def part_chunks(self, sid: int, name: str) -> list[ChunkRow | None]:
        """The chunks of one part of link ``sid``, in order."""
        return self._chunks.get((sid, name), [])


@dataclass
class _Got:
    """One chunk read and checked: its raw bytes to write (None: already copied into place)."""

    items: list[PlanItem]
    raw: memoryview | None = None
    error: tuple[str, str] | None = None  # (kind, why): "corrupt" | "remote" | "missing" | "stopped"


class _Run:
    """The shared state of one streamed restore: the stop flag and whether a destination was written."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.touched = False


def _entry(ch: ChunkRow) -> ChunkEntry:
    return ChunkEntry(ch.id, ch.raw_len, ch.stored_len, ch.codec, ch.checksum)


def _read_one(client: S3Client, scope: str, items: list[PlanItem], run: _Run) -> _Got:
    """Read and check one chunk object; copy it into place when it can go there directly."""
    e = _entry(items[0].chunk)
    if run.stop.is_set():
        return _Got(items, error=("stopped", ""))
    pause_point("fetch")
    try:
        got = client.stream(chunk_key(scope, e.id))
    except RemoteError as err:
        return _Got(items, error=("remote", str(err)))
    if got is None:
        return _Got(items, error=("missing", ""))
    size, pieces = got
    # one destination, from its first byte, contiguous host memory: straight into place
    place = items[0].sink.view(items[0].offset, items[0].offset + e.raw_len) if (
        len(items) == 1 and not items[0].skip) else None
    buf: memoryview | None = None
    at = 0
    try:
        check = ChunkCheck(e, None, size)
        for piece in pieces:
            if run.stop.is_set():
                return _Got(items, error=("stopped", ""))
            raw = check.feed(piece)
            if raw is None or not len(raw):
                continue
            if place is not None:
                run.touched = True
                place[at:at + len(raw)] = raw
            else:
                if buf is None:
                    buf = memoryview(bytearray(e.raw_len))
                buf[at:at + len(raw)] = raw
            at += len(raw)
        decoded = check.finish()
    except BadObject as bad:
        return _Got(items, error=("corrupt", bad.why))
    except RemoteError as err:
        return _Got(items, error=("remote", str(err)))
    if decoded is not None:
        return _Got(items, decoded)
    return _Got(items, None if place is not None else buf)


def plan_remote(hit: RemoteHit, layout: Layout, wanted: set[str], rows_from: int) -> Planned:
    """The plan of ``hit`` from its manifests, checked once (chain, parts, chunks: every check that does
    not depend on the destinations): described and bound to destinations from then on, never checked again."""
    src = ManifestSource(hit)
    return Planned(src.chain[-1], check_plan(src, len(src.chain), src.chain, layout, wanted, rows_from), None)


def remote_details(planned: Planned, hit: RemoteHit, rows_from: int) -> MatchDetails:
    """What streaming ``hit`` by its checked plan would write (what a callable ``into`` is handed)."""
    c = planned.checked
    return MatchDetails(snapshot_id=0, n_tokens=c.n_tokens, namespace=hit.namespace or None, rows=dict(c.rows),
                        components=c.held, missing_components=c.missing_components,
                        part_bytes=dict(c.part_bytes), nbytes=sum(c.part_bytes.values()), chain=[],
                        pending=False, rows_from=rows_from)


def describe_remote(hit: RemoteHit, layout: Layout, wanted: set[str], rows_from: int) -> MatchDetails:
    """What streaming ``hit`` would write: :func:`plan_remote`, described (a batch's checks, an estimate)."""
    return remote_details(plan_remote(hit, layout, wanted, rows_from), hit, rows_from)


def plan_by_chunk(planned: Planned, into: Mapping[str, Any]) -> tuple[RestorePlan, dict[bytes, list[PlanItem]]]:
    """The checked plan bound to ``into`` (each destination checked here, before any read), and its
    items grouped by chunk id in plan order: each chunk object is read once for all its items."""
    plan = planned.bind(into)
    groups: dict[bytes, list[PlanItem]] = {}
    for item in plan.items:
        groups.setdefault(item.chunk.id, []).append(item)
    return plan, groups


def stream_restore(client: S3Client, hit: RemoteHit, planned: Planned, into: Mapping[str, Any],
                   pool: ThreadPoolExecutor, width: int, count: Callable[[str, int], None]) -> RestoreResult:
    """Restore ``hit`` into ``into`` from the bucket by its checked plan (:func:`plan_remote`);
    RestoreError(touched=...) on any failure."""
    t0 = time.perf_counter()
    plan, groups = plan_by_chunk(planned, into)
    todo = deque(groups.values())
    run = _Run()
    pending: deque[Future[_Got]] = deque()
    failure: BaseException | None = None
    fetched = 0
    try:
        while todo and len(pending) < width + _AHEAD:
            pending.append(pool.submit(_read_one, client, hit.scope, todo.popleft(), run))
        while pending:
            got = pending.popleft().result()
            if got.error is not None:
                failure = _error(got, run.touched, count)
                break
            if got.raw is not None:
                raw: memoryview = got.raw
                for item in got.items:
                    run.touched = True
                    item.sink.write(item.offset + item.skip, raw[item.skip:])
            fetched += got.items[0].chunk.stored_len
            if todo:
                pending.append(pool.submit(_read_one, client, hit.scope, todo.popleft(), run))
    except BaseException as e:  # an engine's writer failed (a RestoreError already), or an interrupt
        failure = e
    finally:
        run.stop.set()
        wait(pending)  # nothing writes into the destination once the caller sees the error
    count("remote_streamed_chunks", len(groups) if failure is None else 0)
    count("remote_fetched_bytes", fetched)
    if failure is not None:
        if isinstance(failure, RestoreError) and run.touched:
            failure.touched = True
        raise failure
    count("remote_streamed_restores", 1)
    return RestoreResult(plan.n_tokens, plan.rows, frozenset(plan.missing_components), [], plan.nbytes,
                         time.perf_counter() - t0)


def _error(got: _Got, touched: bool, count: Callable[[str, int], None]) -> RestoreError:
    assert got.error is not None
    return read_error(_entry(got.items[0].chunk), got.error[0], got.error[1], count, touched)
