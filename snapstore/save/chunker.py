"""Save side: cut part byte ranges into chunks, hash, compress and publish them as chunk files.

Every chunk is first copied into a slot of the store's staging buffer — one read of the engine's
buffer — and its content address (BLAKE3), checksum (XXH3) and file bytes all come from that
private copy, so an engine thread that changes its buffer during a save can only spoil this
save's own snapshot, never a chunk another snapshot deduplicates onto. Chunks of host memory are
copied on a small thread pool, each piece hashed from the copy while it is still in cache
(:func:`copy_addressed`: one pass over memory), so the copies and hashes of several chunks overlap
each other's writes and fsyncs; memory stays bounded by the staging buffer and the disk stays busy:
O_DIRECT writes go one at a time (they would otherwise share the device and free every slot at
once), and a slot is free again once its write returned, before the file's fsync. An engine's
reader (``read_into``) is only ever called from the saving thread.

A source that lends its own private host memory (the torch adapter's page-locked staging halves:
``view``/``release`` of the reader protocol, see ``parts.buffers``) is hashed, compressed and written
straight from it instead — that memory is already a private copy, so the rule above holds with
one host memcpy fewer. Not when the chunk would be written raw with O_DIRECT: that needs the
slot's aligned frame, and copying into it costs the same memcpy the buffered write would.

A save that fails before its catalog transaction (a source's device error, a full disk) removes
the chunk files it had published and no row references, so nothing of it is left behind.

A chunk file is placed by ``link()`` when its name is free; when the name is taken, the catalog
decides under the write lock (:func:`settle`): a file a live row vouches for is kept (this save
deduplicates onto it, whatever codec wrote it), anything else — an orphan, a quarantined or
mismatched file — is replaced and the row, if any, made to describe the new file.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from snapstore._errors import SnapstoreError, StoreIOError
from snapstore.catalog.db import Database
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    ChunkHeader,
    checksum,
    chunk_id,
    compress_stream,
    copy_addressed,
)
from snapstore.chunks.direct_io import write_direct
from snapstore.chunks.publish import create_temp, discard, finish_temp, fsync_dirs, link_new, write_all, write_temp
from snapstore.chunks.settle import settle
from snapstore.chunks.staging import StagingBuffer
from snapstore.parts.buffers import Source

__all__ = ["ChunkRef", "Chunker", "Piece"]

# Raw chunks below this size are written buffered even with direct_io on: they stay in the page
# cache, so the next restore of a small prefix (a system prompt's boundary deltas, in this process
# or the next) reads memory, not the disk; O_DIRECT pays off in bandwidth, which small chunks do not
# need (issue 31: a 3,000-token vLLM prompt is 12 chunks of 256 KiB, restored cold after a direct save).
DIRECT_SAVE_MIN = 1 << 20

# Test hook: called as _TEST_HOOK(stage, chunker, chunk_id) at "hashed" (address and checksum
# taken from the private copy), "publish" (the catalog had no healthy row: about to write a file)
# and "stored" (every chunk of a save durable; chunk_id b""). Tests pause a real thread there to
# force race windows; None in production.
_TEST_HOOK: Callable[[str, Chunker, bytes], None] | None = None


def _hook(stage: str, chunker: Chunker, cid: bytes) -> None:
    hook = _TEST_HOOK
    if hook is not None:
        hook(stage, chunker, cid)


class _Lost(StoreIOError):
    """A chunk's temp file vanished before its link (a gc run with no grace period) after its slot
    was freed at its O_DIRECT write: the bytes are gone, so :meth:`Chunker.store` copies the chunk
    from its source again (on its own thread: a pool thread waiting for a slot could deadlock)."""


@dataclass(frozen=True)
class ChunkRef:
    """A chunk as a snapshot references it, with what the chunks table needs."""

    id: bytes
    raw_len: int
    stored_len: int
    codec: int  # -1: an existing file was reused (this save wrote nothing)
    checksum: bytes
    created: bool  # this save published the file at the address (new, or replacing an unvouched one)


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of a part's source that become one or more chunks, addressed with ``key``."""

    source: Source
    start: int
    end: int
    key: bytes = b""  # the scope key of the part (identity, namespace, dtype, shape); b"": Chunker.store's


def _copy(source: Source, start: int, out: memoryview) -> None:
    """Copy bytes [start, start + len(out)) of a part into a staging slot: the save's one read of it."""
    if source.zero_copy:
        # numpy copies without holding the GIL, so the pool keeps hashing and writing meanwhile
        np.copyto(np.frombuffer(out, dtype=np.uint8),
                  np.frombuffer(source.view(start, start + len(out)), dtype=np.uint8))
    else:
        source.copy_into(start, out)


def _taken(fut: Future[ChunkRef], again: Callable[[], ChunkRef] | None) -> ChunkRef:
    """A chunk job's result; a chunk whose bytes were lost with its temp file is published again."""
    try:
        return fut.result()
    except _Lost:
        if again is None:
            raise
        return again()


class Chunker:
    """Turns pieces of parts into published chunk files of at most ``chunk_bytes`` each."""

    def __init__(self, blob_path: Callable[[bytes], str], tmp_dir: str, chunk_bytes: int, codec: int,
                 staging: StagingBuffer, pool: ThreadPoolExecutor, db: Database,
                 sweep: Callable[[Iterable[bytes]], int], direct: bool = False):
        self._blob_path = blob_path
        self._sweep = sweep  # Repo.sweep: files no row references go, under the write lock
        self.direct = direct  # O_DIRECT for raw chunks; turned off for good once the file system refuses it
        self._tmp = tmp_dir
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self._staging = staging
        self._pool = pool
        self._db = db
        # one O_DIRECT chunk write at a time: concurrent ones share the device and finish together,
        # freeing every staging slot at once while the disk then idles through the copies and hashes
        # of the next round; one at a time, a slot frees at the disk's pace (docs/benchmarks.md,
        # "Issue 12, save pipeline, writes in turn")
        self._disk = threading.Lock()

    def store(self, pieces: Sequence[Piece], key: bytes = b"") -> list[list[ChunkRef]]:
        """Publish every piece; returns, per piece, its chunks in order. Files are durable on return.

        On an error, the files this call published that no catalog row references are removed.
        """
        # (piece index, its result, how to copy and publish the chunk again: None for lent memory)
        jobs: list[tuple[int, Future[ChunkRef], Callable[[], ChunkRef] | None]] = []
        window = max(2, 2 * self._staging.slots)  # a chunk frees its slot once written, before its fsync
        results: list[list[ChunkRef]] = [[] for _ in pieces]
        # lend: hash and write from the source's own memory, unless this chunk goes raw with O_DIRECT
        lend = not (self.direct and self.codec == CODEC_RAW)
        ok = False
        try:
            for idx, piece in enumerate(pieces):
                pkey = piece.key or key
                for off in range(piece.start, piece.end, self.chunk_bytes):
                    end = min(off + self.chunk_bytes, piece.end)
                    if len(jobs) >= window:  # bound the chunks in flight (the slots bound the bytes held)
                        i, fut, again = jobs[0]  # still listed while awaited: an interrupt waits for it below
                        results[i].append(_taken(fut, again))
                        jobs.pop(0)
                    lent = piece.source.borrow(off, end - off) if lend else None
                    if lent is not None:
                        back = functools.partial(piece.source.give_back, off, end - off)
                        try:
                            jobs.append((idx, self._pool.submit(self._one, lent, -1, pkey, back), None))
                        except BaseException:
                            back()
                            raise
                        continue
                    slot, mv = self._staging.acquire()
                    try:
                        view = mv[:end - off]
                        if piece.source.zero_copy:  # copied and hashed in one pass, on the pool
                            fut = self._pool.submit(self._staged, piece.source.view(off, end), view, slot, pkey)
                        else:  # an engine's reader is called from the saving thread only
                            _copy(piece.source, off, view)
                            fut = self._pool.submit(self._one, view, slot, pkey)
                    except BaseException:
                        self._staging.release(slot)
                        raise
                    jobs.append((idx, fut, functools.partial(self._again, piece.source, off, end, pkey)))
            while jobs:
                i, fut, again = jobs[0]
                results[i].append(_taken(fut, again))
                jobs.pop(0)
            ok = True
        finally:
            for i, fut, _ in jobs:  # an error above: let in-flight work finish before buffers go away
                try:
                    results[i].append(fut.result())
                except BaseException:  # noqa: S110 - the first error is the one raised
                    pass
            if not ok:
                created = [r.id for rs in results for r in rs if r.created]
                try:  # what no row references goes now, not as orphans for gc
                    self._sweep(created)
                except SnapstoreError:
                    pass  # the first error is the one raised; gc removes what stays
        # every file this save published (codec known), new or replacing an orphan: its name must be
        # durable before the catalog row that references it commits
        dirs = {os.path.dirname(self._blob_path(r.id)) for rs in results for r in rs if r.codec >= 0}
        fsync_dirs(dirs, self._pool)
        _hook("stored", self, b"")
        return results

    def _again(self, source: Source, start: int, end: int, key: bytes) -> ChunkRef:
        """Copy bytes [start, end) of ``source`` into a slot again and publish them, on the calling
        (saving) thread: a chunk whose temp file was lost after its slot was freed (:class:`_Lost`).
        The copy is hashed afresh, so a source changed meanwhile spoils only this save's snapshot."""
        for attempt in range(2):
            slot, mv = self._staging.acquire()
            try:
                view = mv[:end - start]
                _copy(source, start, view)
            except BaseException:
                self._staging.release(slot)
                raise
            try:
                return self._one(view, slot, key)  # gives the slot back
            except _Lost:
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _state(self, cid: bytes) -> int:
        # a read transaction: retried while SQLite is busy, errors translated
        return self._db.read(lambda c: c.chunk_state(cid))

    def _staged(self, src: memoryview, raw: memoryview, slot: int, key: bytes) -> ChunkRef:
        """Copy a chunk of host memory into staging slot ``slot`` (``raw``), hashing it on the way,
        then publish it as :meth:`_one` does (which gives the slot back, also on an error)."""
        try:
            ids = copy_addressed(src, raw, key)
        except BaseException:
            self._staging.release(slot)
            raise
        return self._one(raw, slot, key, ids=ids)

    def _one(self, raw: memoryview, slot: int, key: bytes, done: Callable[[], None] | None = None,
             ids: tuple[bytes, bytes] | None = None) -> ChunkRef:
        """Address, checksum and publish one chunk from its private copy: staging slot ``slot``, or
        (slot -1) memory a source lent, handed back by ``done``. A slot written with O_DIRECT is
        given back as soon as its bytes are on their way to the disk, before the file's fsync (which
        waits for the next chunk's write too) and link: the copy of a later chunk needs it."""
        freed = [False]

        def free() -> None:
            if not freed[0]:
                freed[0] = True
                if done is not None:
                    done()
                else:
                    self._staging.release(slot)

        try:
            cid, csum = ids if ids is not None else (chunk_id(raw, key), checksum(raw))
            _hook("hashed", self, cid)
            path = self._blob_path(cid)
            state = self._state(cid)
            if state == 1:
                try:
                    os.utime(path, follow_symlinks=False)  # keep it young for a concurrent gc
                    st = os.stat(path, follow_symlinks=False)
                    return ChunkRef(cid, len(raw), st.st_size, -1, csum, False)
                except FileNotFoundError:
                    pass  # row without file: republish below (settle makes the row describe it)
            # no row, a quarantined row (this save holds the right bytes: it heals it), or a lost file
            _hook("publish", self, cid)
            for attempt in range(3):
                tmp, codec, payload_len = self._write(raw, csum, slot, free)
                stored = HEADER_SIZE + payload_len
                try:
                    if state == 0 and link_new(tmp, path):
                        return ChunkRef(cid, len(raw), stored, codec, csum, True)
                    kept = settle(self._db, cid, tmp, path, stored, codec)
                except StoreIOError as e:
                    # a gc run with no grace period may remove a temp file between write and link:
                    # written again while this chunk's bytes are still held; once its slot is free,
                    # copied again from its source by store()
                    if e.errno != errno.ENOENT or attempt == 2 or os.path.exists(tmp):
                        discard(tmp)
                        raise
                    if freed[0]:
                        lost = _Lost(e.errno, e.strerror or str(e))
                        lost.filename = e.filename
                        raise lost from None
                    continue
                if kept is not None:
                    return ChunkRef(cid, len(raw), kept, -1, csum, False)
                return ChunkRef(cid, len(raw), stored, codec, csum, True)
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            free()

    def _write(self, raw: memoryview, csum: bytes, slot: int = -1,
               written: Callable[[], None] | None = None) -> tuple[str, int, int]:
        """Write one chunk file to a durable temp file; returns (temp path, codec used, payload length).
        ``written`` is called once an O_DIRECT write has taken the bytes of slot ``slot``.

        Compressed output streams into the file piece by piece (constant memory); once it is no
        smaller than the raw bytes it covers, the chunk is written raw instead.
        """
        if self.codec != CODEC_RAW and len(raw):
            fd, tmp = create_temp(self._tmp)
            out = [0]

            def fill(fd: int) -> bool:
                write_all(fd, bytes(HEADER_SIZE))  # the header goes in once the payload length is known
                for done, piece in compress_stream(raw, self.codec):
                    out[0] += len(piece)
                    if out[0] >= len(raw) or (done < len(raw) and out[0] >= done):
                        return False  # does not pay: dropped unsynced, written raw below
                    write_all(fd, piece)
                os.pwrite(fd, ChunkHeader(self.codec, len(raw), out[0], csum).pack(), 0)
                return True

            path = finish_temp(fd, tmp, fill)
            if path is not None:
                return path, self.codec, out[0]
        header = ChunkHeader(CODEC_RAW, len(raw), len(raw), csum).pack()
        if self.direct and slot >= 0 and len(raw) >= DIRECT_SAVE_MIN:
            frame = self._staging.frame(slot, len(raw))
            frame[:HEADER_SIZE] = header  # in front of the data already in the slot: no payload copy
            path = write_direct(self._tmp, frame, HEADER_SIZE + len(raw), self._disk, written)
            if path is not None:
                return path, CODEC_RAW, len(raw)
            self.direct = False  # the file system refuses O_DIRECT (tmpfs, ...): buffered from now on
        return write_temp(self._tmp, [header, raw]), CODEC_RAW, len(raw)
