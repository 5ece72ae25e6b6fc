"""Save side: cut part byte ranges into chunks, hash, compress and publish them as chunk files.

Work per chunk (BLAKE3 content address, XXH3 checksum, optional zstd, write + fsync + link) runs
on a small thread pool so hashing one chunk overlaps the write and fsync of the previous one. A
zero-copy source is hashed and written straight from the engine's buffer; other sources are
copied into slots of the store's staging buffer first, so memory stays bounded by that buffer.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ._buffers import Source
from ._chunkfile import HEADER_SIZE, ChunkHeader, checksum, chunk_id, encode_payload
from ._errors import StoreIOError
from ._publish import fsync_dirs, publish, write_temp

__all__ = ["ChunkRef", "Chunker", "Piece"]


@dataclass(frozen=True)
class ChunkRef:
    """A chunk as a snapshot references it, with what the chunks table needs."""

    id: bytes
    raw_len: int
    stored_len: int
    codec: int
    checksum: bytes
    created: bool  # this save published the file (it did not exist)


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of a part's source that become one or more chunks."""

    source: Source
    start: int
    end: int


class StagingBuffer:
    """One reusable host buffer split into equal slots; at most len(slots) chunks in flight."""

    def __init__(self, nbytes: int, slot_bytes: int):
        count = max(1, nbytes // slot_bytes)
        self.slot_bytes = slot_bytes
        self._buf: np.ndarray | None = None
        self._count = count
        self._free: list[int] = list(range(count))
        self._cv = threading.Condition()

    @property
    def slots(self) -> int:
        """How many chunks may be in flight at once."""
        return self._count

    def acquire(self) -> tuple[int, memoryview]:
        """Wait for a free slot; return its index and a view of it."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            i = self._free.pop()
            if self._buf is None:
                self._buf = np.empty(self._count * self.slot_bytes, dtype=np.uint8)
            return i, self._buf.data[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def release(self, i: int) -> None:
        """Give a slot back."""
        with self._cv:
            self._free.append(i)
            self._cv.notify()


class Chunker:
    """Turns pieces of parts into published chunk files of at most ``chunk_bytes`` each."""

    def __init__(self, blob_path: Callable[[bytes], str], tmp_dir: str, chunk_bytes: int, codec: int,
                 staging: StagingBuffer, pool: ThreadPoolExecutor, known: Callable[[bytes], bool]):
        self._blob_path = blob_path
        self._tmp = tmp_dir
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self._staging = staging
        self._pool = pool
        self._known = known

    def store(self, pieces: Sequence[Piece], key: bytes) -> list[list[ChunkRef]]:
        """Publish every piece; returns, per piece, its chunks in order. Files are durable on return."""
        jobs: list[tuple[int, Future[ChunkRef]]] = []
        window = max(2, self._staging.slots)
        results: list[list[ChunkRef]] = [[] for _ in pieces]
        try:
            for idx, piece in enumerate(pieces):
                for off in range(piece.start, piece.end, self.chunk_bytes):
                    end = min(off + self.chunk_bytes, piece.end)
                    if len(jobs) >= window:  # bound the chunks in flight (and staging slots held)
                        i, fut = jobs.pop(0)
                        results[i].append(fut.result())
                    if piece.source.zero_copy:
                        jobs.append((idx, self._pool.submit(self._one, piece.source.view(off, end), None, key)))
                    else:
                        slot, mv = self._staging.acquire()
                        try:
                            view = mv[:end - off]
                            piece.source.copy_into(off, view)
                        except BaseException:
                            self._staging.release(slot)
                            raise
                        jobs.append((idx, self._pool.submit(self._one, view, slot, key)))
            for i, fut in jobs:
                results[i].append(fut.result())
            jobs = []
        finally:
            for _, fut in jobs:  # an error above: let in-flight work finish before buffers go away
                try:
                    fut.result()
                except BaseException:  # noqa: S110 - the first error is the one raised
                    pass
        # every file this save published (codec known), new or replacing an orphan: its name must be
        # durable before the catalog row that references it commits
        dirs = {os.path.dirname(self._blob_path(r.id)) for rs in results for r in rs if r.codec >= 0}
        fsync_dirs(dirs, self._pool)
        return results

    def _one(self, raw: memoryview, slot: int | None, key: bytes) -> ChunkRef:
        try:
            cid = chunk_id(raw, key)
            csum = checksum(raw)
            path = self._blob_path(cid)
            if self._known(cid):
                try:
                    os.utime(path, follow_symlinks=False)  # keep it young for a concurrent gc
                    st = os.stat(path, follow_symlinks=False)
                    return ChunkRef(cid, len(raw), st.st_size, -1, csum, False)
                except FileNotFoundError:
                    pass  # row without file: republish below; the commit re-checks anyway
            codec, payload = encode_payload(raw, self.codec)
            header = ChunkHeader(codec, len(raw), len(payload), csum).pack()
            for attempt in range(3):
                tmp = write_temp(self._tmp, [header, payload])
                try:
                    created = publish(tmp, path)
                    break
                except StoreIOError as e:
                    # a gc run with no grace period may remove a temp file between write and link
                    if e.errno != errno.ENOENT or attempt == 2 or os.path.exists(tmp):
                        raise
            return ChunkRef(cid, len(raw), HEADER_SIZE + len(payload), codec, csum, created)
        finally:
            if slot is not None:
                self._staging.release(slot)
