"""Cold raw chunks read with O_DIRECT, several pieces in flight, through one staging slot.

A chunk file is a 64-byte header then the payload, so the payload is not aligned on the disk:
the file is read in aligned pieces (header included) into aligned bounce pieces cut from one
staging slot (the restore stays inside the staging bound; a slot is never held while another is
awaited), reader threads copy each piece's payload bytes into the destination, and this thread
folds every piece into the chunk's XXH3-128 in order, from the bounce piece, before the piece is
reused. Checksums stay on for every chunk. How many reads are in flight, of how many bytes, is the
store's :class:`~snapstore.chunks.direct_io.DirectReads` (measured: :mod:`snapstore.restore.read_path`).
Only chunks whose pages are not cached come here
(:func:`snapstore.chunks.residency.resident`): an O_DIRECT read neither uses nor fills the page cache.
"""

from __future__ import annotations

import bisect
import os

import numpy as np

from snapstore._errors import CorruptionError
from snapstore.chunks.chunkfile import HEADER_SIZE, ChunkHeader, checksum_stream
from snapstore.chunks.direct_io import ALIGN, DirectReads, align_up
from snapstore.chunks.staging import StagingBuffer
from snapstore.plan.restore_plan import PlanItem, RestorePlan
from snapstore.restore.fail import Damage, corrupt, read_failed
from snapstore.restore.ramtier import RamTier
from snapstore.restore.read_ahead import ReadAhead

__all__ = ["DIRECT_MIN", "Targets", "direct_targets", "stream_direct"]

DIRECT_MIN = 256 << 10  # smaller chunks are one request either way: the probe would cost more than it saves

# Where a chunk's payload bytes [skip, raw_len) go: (payload offset of each view's first byte, views)
Targets = tuple[list[int], list[memoryview]]
DirectItem = tuple[PlanItem, int, ChunkHeader, Targets]


def direct_targets(item: PlanItem) -> Targets | None:
    """The host views that take ``item``'s bytes (less its ``skip``): one contiguous view, or the
    writer's segments (paged blocks); None when the destination has neither (read it buffered)."""
    start, end = item.offset + item.skip, item.offset + item.chunk.raw_len
    view = item.sink.view(start, end)
    views = [view] if view is not None else item.sink.segments(start, end)
    if views is None:
        return None
    pos, starts = item.skip, []
    for v in views:
        starts.append(pos)
        pos += len(v)
    return starts, views


def _scatter(targets: Targets, lo: int, data: memoryview) -> None:
    """Copy ``data`` (payload bytes from ``lo``) into the target views that cover them."""
    starts, views = targets
    hi = lo + len(data)
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(views) and starts[i] < hi:
        a, b = max(lo, starts[i]), min(hi, starts[i] + len(views[i]))
        if a < b:  # numpy copies without the GIL: the other reader threads keep going
            np.copyto(np.frombuffer(views[i][a - starts[i]:b - starts[i]], dtype=np.uint8),
                      np.frombuffer(data[a - lo:b - lo], dtype=np.uint8))
        i += 1


def stream_direct(plan: RestorePlan, run: list[DirectItem], staging: StagingBuffer, reads: DirectReads,
                  ram: RamTier | None, touched: bool, damage: Damage) -> bool | None:
    """Write the chunks of ``run`` (raw, not cached, host destinations) with O_DIRECT reads; returns
    touched, or None (nothing read) when the file system refuses O_DIRECT: read them buffered then."""
    own: dict[int, int] = {}  # each file's descriptor in the run -> one of its own, set to O_DIRECT
    for fd in dict.fromkeys(entry[1] for entry in run):
        mine = _reopen(fd)
        if mine is None or not reads.enable(mine):
            for done in [*own.values(), *([mine] if mine is not None else [])]:
                os.close(done)
            return None
        own[fd] = mine
    try:
        return _stream_direct(plan, run, staging, reads, ram, touched, damage, own)
    finally:
        for mine in own.values():
            os.close(mine)


def _reopen(fd: int) -> int | None:
    """A new open file description of the file open as ``fd`` (through /proc/self/fd), or None.

    O_DIRECT is a flag of the description, which ``os.dup`` shares: a descriptor of a file kept open
    (:mod:`snapstore.chunks.open_files`) may be read buffered by another restore at the same time, and
    a buffered read into an unaligned buffer fails with EINVAL while O_DIRECT is set. So the direct
    reads go through a description of their own, whatever the restore's descriptor is."""
    try:
        mine = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no /proc: read buffered
    try:
        a, b = os.fstat(fd), os.fstat(mine)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            return mine
    except OSError:
        pass
    os.close(mine)
    return None


def _stream_direct(plan: RestorePlan, run: list[DirectItem], staging: StagingBuffer, reads: DirectReads,
                   ram: RamTier | None, touched: bool, damage: Damage, own: dict[int, int]) -> bool:
    """stream_direct's body: ``own`` maps each descriptor of the run to its O_DIRECT description."""
    slot, _ = staging.acquire()
    reader: ReadAhead | None = None
    try:
        frame = staging.frame(slot, staging.slot_bytes)
        # pieces of up to reads.piece, at least reads.threads of them when the slot is small (small chunk_bytes)
        threads = max(1, reads.threads)
        piece = max(ALIGN, min(reads.piece, len(frame) // threads // ALIGN * ALIGN))
        bounce = [frame[i * piece:(i + 1) * piece] for i in range(len(frame) // piece)]
        jobs: list[tuple[int, int, int]] = []  # (run index, file offset, bytes)
        for k, (item, _, _, _) in enumerate(run):
            size = HEADER_SIZE + item.chunk.raw_len
            jobs += [(k, s, min(piece, size - s)) for s in range(0, size, piece)]

        def payload(j: int) -> tuple[int, memoryview]:
            """Job ``j``'s payload bytes in its bounce piece, and the payload offset of the first."""
            _, s, need = jobs[j]
            first = max(0, HEADER_SIZE - s)
            return s + first - HEADER_SIZE, bounce[j % len(bounce)][first:need]

        def work(j: int) -> None:
            k, s, need = jobs[j]
            item, fd, _, targets = run[k]
            if reads.read(own[fd], bounce[j % len(bounce)][:align_up(need)], s, need) < need:
                raise CorruptionError("chunk file is shorter than its header says (truncated)")
            lo, data = payload(j)
            if lo + len(data) > item.skip:
                cut = max(0, item.skip - lo)
                _scatter(targets, lo + cut, data[cut:])

        if len(jobs) > 1:
            reader = ReadAhead(len(jobs), work, depth=len(bounce), threads=min(threads, len(bounce)))
        j = 0
        for k, (item, fd, _, _) in enumerate(run):
            cid = item.chunk.id
            h = checksum_stream()
            touched = True
            try:
                while j < len(jobs) and jobs[j][0] == k:
                    try:
                        if reader is not None:
                            reader.wait(j)
                        else:
                            work(j)
                        h.update(payload(j)[1])  # before done(): the piece is reused after that
                    finally:
                        if reader is not None:
                            reader.done()
                    j += 1
            except CorruptionError as e:
                raise corrupt(plan, cid, fd, str(e), touched, damage, ram) from None
            except OSError as e:
                raise read_failed(plan, cid, e, touched) from None
            if h.digest() != item.chunk.checksum:
                raise corrupt(plan, cid, fd, "checksum mismatch", touched, damage, ram)
            if ram is not None:  # admitted off this thread, from the file (see restore.ramtier); at its first
                # restore: an O_DIRECT read leaves no page-cache copy for the next one (issue 48)
                ram.offer(item.chunk, first=True)
    finally:
        if reader is not None:
            reader.stop()  # before the slot is reused, and before an error reaches the caller
        staging.release(slot)
    return touched
