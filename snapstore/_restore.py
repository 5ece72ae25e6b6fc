"""Restore side: stream a validated plan's chunks into the destination buffers.

Phase 1 opens every chunk file and checks its header against the catalog (an open descriptor
keeps the bytes readable even if a concurrent eviction unlinks the file), so a snapshot that
vanished is reported before anything is written. Phase 2 reads each chunk straight into the
destination when it is raw and the destination is contiguous (a reader thread reads chunk k+1
while this thread checks chunk k), else through the staging buffer, and checks every chunk's
XXH3-128 as it lands. No posix_fadvise(WILLNEED): on this kernel it fills the page cache with
4 KiB folios and made both cold and later warm reads slower than plain readahead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ._chunker import StagingBuffer
from ._chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    ChunkHeader,
    checksum,
    checksum_stream,
    decode_payload,
    parse_header,
    read_exact,
)
from ._errors import CorruptChunkError, CorruptionError, RestoreError, SnapshotUnavailableError
from ._plan import PlanItem, RestorePlan
from ._ramtier import RamTier

__all__ = ["stream_plan"]

def _ensure_fd_room(needed: int) -> None:
    """Raise the soft open-file limit (up to the hard one) so every chunk of a plan can be held open."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = needed + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(hard, want)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError):
        pass


def _open_all(plan: RestorePlan, blob_path: Callable[[bytes], str],
              ram: RamTier | None) -> list[tuple[PlanItem, int, ChunkHeader | None, bytes | None]]:
    opened: list[tuple[PlanItem, int, ChunkHeader | None, bytes | None]] = []
    fds: dict[bytes, int] = {}
    _ensure_fd_room(len({item.chunk.id for item in plan.items}))
    try:
        for item in plan.items:
            cid = item.chunk.id
            data = ram.get(cid) if ram is not None else None
            if data is not None:  # held from here on: a RAM eviction cannot pull it away mid-restore
                opened.append((item, -1, None, data))
                continue
            if cid not in fds:
                try:
                    path = blob_path(cid)
                except CorruptionError as e:
                    raise SnapshotUnavailableError(f"snapshot {plan.snapshot_id}: {e}; nothing was written",
                                                   snapshot_id=plan.snapshot_id) from None
                try:
                    fds[cid] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise SnapshotUnavailableError(
                        f"snapshot {plan.snapshot_id}: chunk {cid.hex()} is gone (evicted or deleted); "
                        "nothing was written", snapshot_id=plan.snapshot_id) from None
                except OSError as e:
                    raise SnapshotUnavailableError(
                        f"snapshot {plan.snapshot_id}: cannot open chunk {cid.hex()}: {e.strerror}; "
                        "nothing was written", snapshot_id=plan.snapshot_id) from None
            fd = fds[cid]
            try:
                head = parse_header(os.pread(fd, HEADER_SIZE, 0))
                size = os.fstat(fd).st_size
            except (CorruptionError, OSError) as e:
                raise CorruptChunkError(f"snapshot {plan.snapshot_id}: chunk {cid.hex()} is damaged ({e}); "
                                        "nothing was written", snapshot_id=plan.snapshot_id) from None
            if (head.raw_len != item.chunk.raw_len or head.checksum != item.chunk.checksum
                    or size != HEADER_SIZE + head.payload_len):
                raise CorruptChunkError(
                    f"snapshot {plan.snapshot_id}: chunk {cid.hex()} does not match the catalog "
                    f"(size {size}, header says {HEADER_SIZE + head.payload_len}); nothing was written",
                    snapshot_id=plan.snapshot_id)
            opened.append((item, fd, head, None))
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return opened


class _Reader:
    """Reads raw chunks straight into their destinations on ``threads`` threads, ahead of the checker.

    Job ``j`` starts only once the checker is through with job ``j - depth`` (at most ``depth``
    chunks read or being read but not yet verified), and ``stop()`` returns only once every
    thread is idle: after a restore raises, nothing writes into the destination any more.
    """

    def __init__(self, jobs: list[tuple[int, memoryview, int]], depth: int, threads: int):
        self._jobs = jobs
        self._depth = depth
        self._ready = [False] * len(jobs)
        self._errors: dict[int, BaseException] = {}
        self._cv = threading.Condition()
        self._checked = 0
        self._stop = False
        self.started = False  # some destination bytes may have been written
        self._threads = [threading.Thread(target=self._run, args=(t, threads), name="snapstore-restore",
                                          daemon=True) for t in range(threads)]
        for th in self._threads:
            th.start()

    def _run(self, first: int, step: int) -> None:
        for j in range(first, len(self._jobs), step):
            with self._cv:
                while j >= self._checked + self._depth and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                self.started = True
            fd, target, offset = self._jobs[j]
            try:
                read_exact(fd, target, offset)
            except BaseException as e:  # handed to the checker, which raises it in order
                self._errors[j] = e
            with self._cv:
                self._ready[j] = True
                self._cv.notify_all()

    def wait(self, j: int) -> None:
        """Block until job ``j`` is read; raise what reading it raised."""
        with self._cv:
            while not self._ready[j]:
                self._cv.wait()
        err = self._errors.pop(j, None)
        if err is not None:
            raise err

    def done(self) -> None:
        """The checker is through with one more job: another may start."""
        with self._cv:
            self._checked += 1
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for th in self._threads:
            th.join()


# Raw chunks are read and checked in pieces: the checksum reads each piece right after the reader
# wrote it, while it is still in the CPU cache, instead of streaming the whole chunk from memory a
# second time (warm restores are memory-bandwidth bound).
_PIECE = 4 << 20
_DEPTH = 3  # pieces read ahead of the one being checked
_THREADS = 1  # reader threads (more did not help on 2 vCPUs; see docs/benchmarks.md)
_PIPELINE_MIN = 2 * (1 << 20)  # below this much raw data a reader thread costs more than it saves


def stream_plan(plan: RestorePlan, blob_path: Callable[[bytes], str], staging: StagingBuffer,
                ram: RamTier | None) -> None:
    """Write every chunk of ``plan``; RestoreError(touched=...) on any failure."""
    opened = _open_all(plan, blob_path, ram)
    touched = False
    # Raw chunks with a contiguous destination are read in place by a reader thread while this
    # thread checks the previous one (preadv releases the GIL); everything else goes in order here.
    targets: list[memoryview | None] = []
    pieces: list[range] = []  # per item: its jobs
    jobs: list[tuple[int, memoryview, int]] = []
    for item, fd, head, data in opened:
        target = None
        first = len(jobs)
        if data is None and head is not None and head.codec == CODEC_RAW:
            target = item.sink.view(item.offset, item.offset + item.chunk.raw_len)
            if target is not None:
                for off in range(0, item.chunk.raw_len, _PIECE):
                    jobs.append((fd, target[off:off + _PIECE], HEADER_SIZE + off))
        targets.append(target)
        pieces.append(range(first, len(jobs)))
    big = len(jobs) > 1 and sum(len(t) for _, t, _ in jobs) >= _PIPELINE_MIN
    reader = _Reader(jobs, depth=_DEPTH, threads=_THREADS) if big else None
    try:
        for k, (item, fd, head, data) in enumerate(opened):
            cid, n = item.chunk.id, item.chunk.raw_len
            if data is not None:
                touched = True
                item.sink.write(item.offset, memoryview(data))
                continue
            assert head is not None
            target = targets[k]
            try:
                if target is not None:
                    touched = True
                    h = checksum_stream()
                    for j in pieces[k]:
                        _, piece, offset = jobs[j]
                        if reader is not None:
                            try:
                                reader.wait(j)
                            finally:
                                reader.done()
                        else:
                            read_exact(fd, piece, offset)
                        h.update(piece)
                    good = h.digest() == item.chunk.checksum
                    out = target
                else:
                    slot, buf = staging.acquire()
                    try:
                        out = buf[:n] if n <= len(buf) else memoryview(bytearray(n))
                        if head.codec == CODEC_RAW:
                            read_exact(fd, out, HEADER_SIZE)
                        else:
                            payload = memoryview(bytearray(head.payload_len))
                            read_exact(fd, payload, HEADER_SIZE)
                            decode_payload(head, payload, out)
                        good = checksum(out) == item.chunk.checksum
                        if good:
                            touched = True
                            item.sink.write(item.offset, out)
                            if ram is not None:
                                ram.put(cid, out)
                    finally:
                        staging.release(slot)
                    if good:
                        continue
            except CorruptionError as e:
                good = False
                reason = str(e)
            except OSError as e:
                touched = touched or (reader is not None and reader.started)
                raise RestoreError(
                    f"snapshot {plan.snapshot_id}: reading chunk {cid.hex()} failed ({e.strerror}); "
                    + ("the destination was partly written: re-read the prompt" if touched
                       else "nothing was written"), touched=touched, snapshot_id=plan.snapshot_id) from None
            else:
                reason = "checksum mismatch"
            if not good:
                touched = touched or (reader is not None and reader.started)
                if ram is not None:
                    ram.discard(cid)
                raise CorruptChunkError(
                    f"snapshot {plan.snapshot_id}: chunk {cid.hex()} is corrupt ({reason}); "
                    + ("the destination was partly written: re-read the prompt" if touched
                       else "nothing was written"), touched=touched, snapshot_id=plan.snapshot_id)
            if ram is not None:
                ram.put(cid, out)
    finally:
        if reader is not None:
            reader.stop()  # before the descriptors close, and before an error reaches the caller
        for fd in {entry[1] for entry in opened if entry[1] >= 0}:
            try:
                os.close(fd)
            except OSError:
                pass
