"""Restore side: stream a validated plan's chunks into the destination buffers.

Phase 1 opens the chunk files and checks each header against the catalog (an open descriptor
keeps the bytes readable even if a concurrent eviction unlinks the file), so a snapshot that
vanished is reported before anything is written; for a plan made from memory, a small file kept
open under the plan's catalog stamp is taken with its checked header instead
(:mod:`snapstore.chunks.open_files`). Phase 2 reads each chunk straight into the
destination when it is raw and the destination is contiguous (two reader threads, each reading
whole files in order, run ahead while this thread checks chunk k), else through the staging
buffer (zstd payloads decode piece by piece from the file: no chunk-sized temporaries), and checks
every chunk's XXH3-128 as it lands.
With direct reads on (``DirectReads``), runs of raw chunks whose pages are not cached go to
:mod:`snapstore.restore.direct` instead (O_DIRECT, several pieces in flight); the others stay on this path.

At most ``_MAX_OPEN`` chunk files are open at once, whatever the plan's size, and the process's
open-file limit is never touched: a larger plan has every header checked first (open, check,
close), then streams in windows of that many files, each window opened and re-checked before
its first byte is written. Damage found on the way (a missing file, something other than a
regular file at the path — opened without blocking, :func:`snapstore.chunks.chunkfile.open_chunk` — a bad header,
a checksum that does not match) is reported in ``damage`` for :func:`snapstore.restore.fail.quarantine`, which condemns
only what is still damaged when it re-checks under the write lock.

A window's files are probed (cached or not) before any is read, and nothing is asked for ahead
with posix_fadvise(WILLNEED): the reads' own readahead brings the pages in. On the benchmark
machine WILLNEED on a cold chain's files did not make its cold restores faster, and the warm
restores that followed were 7-33% slower (:func:`snapstore.restore.tier_probe.probe_window`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from snapstore._errors import CorruptChunkError, CorruptionError, RestoreError, SnapshotUnavailableError
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    ChunkHeader,
    checksum,
    checksum_stream,
    decode_fd,
    header_matches,
    open_chunk,
    parse_header,
    read_exact,
)
from snapstore.chunks.direct_io import DirectReads
from snapstore.chunks.open_files import OpenFiles
from snapstore.chunks.residency import resident
from snapstore.chunks.staging import StagingBuffer
from snapstore.plan.restore_plan import PlanItem, RestorePlan
from snapstore.restore.direct import DIRECT_MIN, DirectItem, Targets, direct_targets, stream_direct
from snapstore.restore.fail import Damage, corrupt, outcome, read_failed
from snapstore.restore.ramtier import RamTier
from snapstore.restore.read_ahead import ReadAhead
from snapstore.restore.tier_probe import TierBytes, probe_window, tally_opened

__all__ = ["Damage", "stream_plan"]

_MAX_OPEN = 64  # chunk files one restore holds open at once

_Opened = tuple[PlanItem, int, "ChunkHeader | None", "memoryview | None"]


def _open_all(plan: RestorePlan, items: list[PlanItem], blob_path: Callable[[bytes], str], ram: RamTier | None,
              touched: bool, damage: Damage, keep: bool = True,
              before_reads: Callable[[list[_Opened]], dict[int, bool]] | None = None,
              files: OpenFiles | None = None) -> tuple[list[_Opened], dict[int, bool] | None]:
    """Open every chunk file of ``items`` and check its header against the catalog; with ``keep``
    False close each again (a check only). Damage found is added to ``damage`` before raising.
    ``before_reads`` (with ``keep``) sees the opened files after the last open and before the
    first header read (the tier probes, restore.tier_probe: a header read would make a cold file look cached);
    its answer (residency per descriptor) is returned beside them. ``files`` (with ``keep``, for a
    plan made from memory): the small files kept open under the plan's stamp, taken instead of
    opened, and those opened here offered to it once their header is checked."""
    kept = files if keep else None
    opened: list[_Opened] = []
    fds: dict[bytes, tuple[int, ChunkHeader | None]] = {}
    unread: list[tuple[int, os.stat_result]] = []  # (index in opened, fstat) of files whose header is unchecked
    checked: set[bytes] = set()
    sid = plan.snapshot_id
    try:
        for item in items:
            cid = item.chunk.id
            data = ram.get(cid) if ram is not None and keep else None
            if data is not None:  # held from here on: a RAM eviction cannot pull it away mid-restore
                opened.append((item, -1, None, data))
                continue
            if cid in fds:
                opened.append((item, fds[cid][0], None, None))
                continue
            if cid in checked:
                continue
            taken = kept.take(plan.stamp, cid, item.chunk.raw_len, item.chunk.checksum) if kept is not None else None
            if taken is not None:  # opened and its header checked against this row, under this stamp
                fds[cid] = taken
                opened.append((item, taken[0], None, None))
                continue
            try:
                path = blob_path(cid)
            except CorruptionError as e:
                raise SnapshotUnavailableError(f"snapshot {sid}: {e}; {outcome(touched)}",
                                               touched=touched, snapshot_id=sid) from None
            try:
                fd, st = open_chunk(path)
            except FileNotFoundError:
                damage.append(cid)  # quarantined if its row is still there (not an eviction)
                raise SnapshotUnavailableError(
                    f"snapshot {sid}: chunk {cid.hex()} is gone (evicted or deleted); {outcome(touched)}",
                    touched=touched, snapshot_id=sid) from None
            except CorruptionError as e:  # a FIFO, socket, device or link at the chunk path: damage, no hang
                damage.append(cid)
                raise CorruptChunkError(f"snapshot {sid}: chunk {cid.hex()} is damaged ({e}); {outcome(touched)}",
                                        touched=touched, snapshot_id=sid) from None
            except OSError as e:
                raise SnapshotUnavailableError(
                    f"snapshot {sid}: cannot open chunk {cid.hex()}: {e.strerror}; {outcome(touched)}",
                    touched=touched, snapshot_id=sid) from None
            if keep:  # its header is read once every file is open (before_reads first)
                fds[cid] = (fd, None)
                unread.append((len(opened), st))
                opened.append((item, fd, None, None))
                continue
            try:
                _check_header(plan, item, fd, st, touched, damage)
            finally:
                os.close(fd)
            checked.add(cid)
        warm = before_reads(opened) if before_reads is not None else None
        for k, st in unread:
            item, fd, _, _ = opened[k]
            head = _check_header(plan, item, fd, st, touched, damage)
            fds[item.chunk.id] = (fd, head)
            if kept is not None:
                kept.keep(plan.stamp, item.chunk.id, fd, head, st.st_size)
        # every use of a chunk in the window gets the header its file was checked with
        opened = [(item, fd, fds[item.chunk.id][1], None) if data is None else (item, fd, head, data)
                  for item, fd, head, data in opened]
    except BaseException:
        for fd, _ in fds.values():
            os.close(fd)
        raise
    return opened, warm


def _check_header(plan: RestorePlan, item: PlanItem, fd: int, st: os.stat_result, touched: bool,
                  damage: Damage) -> ChunkHeader:
    """The header of an open chunk file (``st``: its fstat), checked against its catalog row."""
    cid, sid = item.chunk.id, plan.snapshot_id
    try:
        head = parse_header(os.pread(fd, HEADER_SIZE, 0))
    except (CorruptionError, OSError) as e:
        if isinstance(e, CorruptionError):
            damage.append(cid)
        raise CorruptChunkError(f"snapshot {sid}: chunk {cid.hex()} is damaged ({e}); {outcome(touched)}",
                                touched=touched, snapshot_id=sid) from None
    if not header_matches(head, item.chunk.raw_len, item.chunk.checksum, st.st_size):
        damage.append(cid)
        raise CorruptChunkError(
            f"snapshot {sid}: chunk {cid.hex()} does not match the catalog "
            f"(size {st.st_size}, header says {HEADER_SIZE + head.payload_len}); {outcome(touched)}",
            touched=touched, snapshot_id=sid)
    return head


def _windows(items: list[PlanItem]) -> list[list[PlanItem]]:
    """Consecutive runs of plan items that use at most _MAX_OPEN distinct chunks each."""
    if len(items) <= _MAX_OPEN:  # no more chunks than items: one window (a small restore)
        return [items] if items else []
    out: list[list[PlanItem]] = []
    cur: list[PlanItem] = []
    ids: set[bytes] = set()
    for item in items:
        if item.chunk.id not in ids and len(ids) >= _MAX_OPEN:
            out.append(cur)
            cur, ids = [], set()
        cur.append(item)
        ids.add(item.chunk.id)
    if cur:
        out.append(cur)
    return out


# Raw chunks are read and checked in pieces: the checksum reads each piece right after the reader
# wrote it, while it is still in the CPU cache, instead of streaming the whole chunk from memory a
# second time (warm restores are memory-bandwidth bound).
_PIECE = 4 << 20
_DEPTH = 6  # pieces read ahead of the one being checked
# Read on this thread (no readers), a piece is read and hashed in steps of this much: a 3 MiB chunk
# hashed after its whole read came from L3 or memory, twice as slow as from L2 (issue 31).
_IN_THREAD = 512 << 10
# Reader threads, each reading whole files (a file's pieces in order): a cold restore keeps two
# files' readahead in flight (~10% faster cold and warm, 2 vCPUs; docs/benchmarks.md). Threads that
# shared one file's pieces broke its sequential readahead and were slower than one thread.
_THREADS = 2
_PIPELINE_MIN = 2 * (1 << 20)  # below this much raw data a reader thread costs more than it saves
# Up to this much raw data, reader threads run only when the first or last file's pages are not
# cached: a small warm restore (a system prompt, issue 31) took 1.5-2 ms on this thread and 3-4 ms
# with two reader threads started for it (2 vCPUs, loaded); cold, the threads halve it (overlapped reads).
_SMALL_WARM = 8 * (1 << 20)


def stream_plan(plan: RestorePlan, blob_path: Callable[[bytes], str], staging: StagingBuffer,
                ram: RamTier | None, damage: Damage | None = None, reads: DirectReads | None = None,
                tiers: TierBytes | None = None, files: OpenFiles | None = None) -> int:
    """Write every chunk of ``plan``; RestoreError(touched=...) on any failure. Returns the chunk bytes
    read with O_DIRECT (what a cold restore's rate times: :meth:`snapstore.restore.read_path.ReadPaths.restored`).

    Chunks found damaged or missing are added to ``damage`` (for :func:`snapstore.restore.fail.quarantine`). With
    ``reads`` on, raw chunks whose pages are not cached are read with O_DIRECT (restore.direct).
    ``tiers``: gets the chunk bytes read per tier (:mod:`snapstore.restore.tier_probe`), for the restore rates.
    ``files``: small chunk files kept open for plans made from memory (:mod:`snapstore.chunks.open_files`).
    """
    found: Damage = damage if damage is not None else []
    with ram.restoring() if ram is not None else contextlib.nullcontext():  # admission waits meanwhile
        return _stream_windows(plan, blob_path, staging, ram, found, reads, tiers, files)


def _stream_windows(plan: RestorePlan, blob_path: Callable[[bytes], str], staging: StagingBuffer,
                    ram: RamTier | None, found: Damage, reads: DirectReads | None, tiers: TierBytes | None,
                    files: OpenFiles | None = None) -> int:
    """stream_plan's body: the plan in windows of at most _MAX_OPEN open chunk files; the bytes read direct."""
    windows = _windows(plan.items)
    if len(windows) > 1:  # check every header before a byte is written, holding few files at once
        for items in windows:
            _open_all(plan, items, blob_path, ram, False, found, keep=False)
    touched, direct = False, 0
    for items in windows:
        # before a byte of the window is read: cached or not, as found (the stream reuses the probes)
        opened, warm = _open_all(plan, items, blob_path, ram, touched, found, before_reads=probe_window,
                                 files=files)
        if tiers is not None and warm is not None:
            tally_opened(opened, warm, tiers)
        try:
            touched, n = _stream_window(plan, opened, staging, ram, touched, found, reads, warm)
            direct += n
        except BaseException:
            if files is not None:  # a file that failed a read or a check is opened afresh next time
                files.forget(item.chunk.id for item in items)
            raise
        finally:
            for fd in {entry[1] for entry in opened if entry[1] >= 0}:
                try:
                    os.close(fd)
                except OSError:
                    pass
    return direct


def _cold_targets(entry: _Opened, reads: DirectReads | None, cold: dict[int, bool]) -> Targets | None:
    """Where a raw chunk goes when it is read with O_DIRECT: its pages are not cached and its
    destination is host memory; else None (the buffered path). ``cold`` caches the probe per file."""
    item, fd, head, data = entry
    if (reads is None or not reads.on or data is not None or head is None or head.codec != CODEC_RAW
            or item.chunk.raw_len < DIRECT_MIN):
        return None
    targets = direct_targets(item)
    if targets is None:
        return None
    if fd not in cold:
        cold[fd] = not resident(fd, HEADER_SIZE + item.chunk.raw_len)
    return targets if cold[fd] else None


def _stream_window(plan: RestorePlan, opened: list[_Opened], staging: StagingBuffer, ram: RamTier | None,
                   touched: bool, damage: Damage, reads: DirectReads | None,
                   warm: dict[int, bool] | None = None) -> tuple[bool, int]:
    """Write one window's chunks in order, as runs of cold chunks (read with O_DIRECT) and runs of
    the others (buffered: cached, compressed, RAM-tier or writer destinations); returns touched and
    the chunk bytes read with O_DIRECT.
    ``warm``: the window's files found cached, per descriptor, where the tier tally probed them."""
    cold: dict[int, bool] = {}
    runs: list[tuple[bool, list[_Opened], list[DirectItem]]] = []
    for entry in opened:
        try:
            targets = _cold_targets(entry, reads, cold)
        except RestoreError as e:  # the writer's views() refused: written only if earlier runs wrote
            e.touched = e.touched or touched
            raise
        if not runs or runs[-1][0] != (targets is not None):
            runs.append((targets is not None, [], []))
        runs[-1][1].append(entry)
        if targets is not None:
            item, fd, head, _ = entry
            assert head is not None
            runs[-1][2].append((item, fd, head, targets))
    read_direct = 0
    for direct, entries, items in runs:
        done = None
        if direct and reads is not None:
            done = stream_direct(plan, items, staging, reads, ram, touched, damage)
            if done is not None:
                read_direct += sum(item.chunk.raw_len for item, _, _, _ in items)
        touched = done if done is not None else _stream(plan, entries, staging, ram, touched, damage, warm)
    return touched, read_direct


def _stopped(reader: ReadAhead | None, touched: bool) -> bool:
    """Stop the reader threads (none writes into the destination any more), then say whether the
    destination may have been written: read after the stop, so no read can begin in between."""
    if reader is None:
        return touched
    reader.stop()
    return touched or reader.started


def _file_lanes(fds: list[int]) -> list[int]:
    """A reader lane per job: consecutive jobs of one file share one, the next file takes the next."""
    lanes, lane = [], -1
    for j, fd in enumerate(fds):
        if j == 0 or fd != fds[j - 1]:
            lane += 1
        lanes.append(lane)
    return lanes


def _stream(plan: RestorePlan, opened: list[_Opened], staging: StagingBuffer, ram: RamTier | None,
            touched: bool, damage: Damage, warm: dict[int, bool] | None = None) -> bool:
    """Write ``opened`` chunks through the page cache, in order (the caller closes their files); returns
    touched. ``warm``: files known cached or not (the tier tally's probes), else probed here."""
    # Raw chunks with a contiguous destination are read in place by reader threads (a lane per file)
    # while this thread checks the previous one (preadv releases the GIL); the rest goes in order here.
    targets: list[memoryview | list[memoryview] | None] = []
    pieces: list[range] = []  # per item: its jobs
    jobs: list[tuple[int, memoryview | list[memoryview], int]] = []
    try:
        _in_place(opened, targets, pieces, jobs)
    except RestoreError as e:  # the writer's views() refused: nothing of this run was read yet
        e.touched = e.touched or touched
        raise
    total = sum(len(t) if isinstance(t, memoryview) else sum(map(len, t)) for _, t, _ in jobs)
    big = len(jobs) > 1 and total >= _PIPELINE_MIN and (total > _SMALL_WARM or not _cached(opened, warm))
    reader = ReadAhead(len(jobs), lambda j: read_exact(*jobs[j]), depth=_DEPTH, threads=_THREADS,
                       lanes=_file_lanes([fd for fd, _, _ in jobs])) if big else None
    try:
        for k, (item, fd, head, data) in enumerate(opened):
            cid, n = item.chunk.id, item.chunk.raw_len
            if data is not None:
                touched = True
                item.sink.write(item.offset + item.skip, memoryview(data)[item.skip:])
                continue
            assert head is not None
            target = targets[k]
            in_place = True  # checked in the destination's memory (in place, or a buffer it lent)
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
                        elif isinstance(piece, memoryview):  # on this thread: hashed while still in L2
                            for at in range(0, len(piece), _IN_THREAD):
                                step = piece[at:at + _IN_THREAD]
                                read_exact(fd, step, offset + at)
                                h.update(step)
                            continue
                        else:
                            read_exact(fd, piece, offset)
                        for p in ([piece] if isinstance(piece, memoryview) else piece):
                            h.update(p)
                    good = h.digest() == item.chunk.checksum
                # a lent buffer is committed whole: not for the chunk that straddles rows_from (staged below)
                elif not item.skip and (lent := item.sink.buffer(item.offset, n)) is not None:
                    committed = False
                    try:
                        decode_fd(head, fd, lent)
                        good = checksum(lent) == item.chunk.checksum
                        if good:
                            touched = True
                            item.sink.commit(item.offset, n)
                            committed = True
                    finally:
                        if not committed:
                            item.sink.discard(item.offset, n)
                else:
                    in_place = False
                    slot, buf = staging.acquire()
                    try:
                        out = buf[:n] if n <= len(buf) else memoryview(bytearray(n))
                        decode_fd(head, fd, out)  # raw: read; zstd: decompressed piece by piece
                        good = checksum(out) == item.chunk.checksum
                        if good:
                            touched = True
                            item.sink.write(item.offset + item.skip, out[item.skip:])  # rows_from
                            if ram is not None:
                                ram.offer(item.chunk)
                    finally:
                        staging.release(slot)
                    if good:
                        continue
            except CorruptionError as e:  # the file itself (short, does not decode): no re-check
                good, in_place = False, False
                reason = str(e)
            except OSError as e:
                raise read_failed(plan, cid, e, _stopped(reader, touched)) from None
            except RestoreError as e:  # the writer refused or failed: touched if anything was written
                e.touched = e.touched or _stopped(reader, touched)
                raise
            else:
                reason = "checksum mismatch"
            if not good:
                raise corrupt(plan, cid, fd, reason, _stopped(reader, touched), damage, ram,
                              head if in_place else None)
            if ram is not None:  # admitted off this thread, from the file tier (see restore.ramtier)
                ram.offer(item.chunk)
    finally:
        if reader is not None:
            reader.stop()  # before the descriptors close, and before an error reaches the caller
    return touched


def _cached(opened: list[_Opened], warm: dict[int, bool] | None) -> bool:
    """Are the first and the last chunk file of ``opened`` in the page cache (``warm``'s answers, else
    two mincore probes)?"""
    files = [(fd, HEADER_SIZE + item.chunk.raw_len) for item, fd, _, data in opened if data is None and fd >= 0]
    known = warm or {}
    return not files or all(known[fd] if fd in known else resident(fd, size) for fd, size in {files[0], files[-1]})


def _in_place(opened: list[_Opened], targets: list[memoryview | list[memoryview] | None], pieces: list[range],
              jobs: list[tuple[int, memoryview | list[memoryview], int]]) -> None:
    """Per item of ``opened``: where it is read in place (``targets``: its destination view or the
    writer's segments, None: not in place) and its read jobs (``pieces``: indices into ``jobs``)."""
    for item, fd, head, data in opened:
        target: memoryview | list[memoryview] | None = None
        first = len(jobs)
        if data is None and head is not None and head.codec == CODEC_RAW and not item.skip:
            target = item.sink.view(item.offset, item.offset + item.chunk.raw_len)
            if target is not None:
                for off in range(0, item.chunk.raw_len, _PIECE):
                    jobs.append((fd, target[off:off + _PIECE], HEADER_SIZE + off))
            else:  # a scattered destination (paged blocks) read in place, segment by segment
                segs = item.sink.segments(item.offset, item.offset + item.chunk.raw_len)
                if segs is not None:  # grouped into jobs of about _PIECE bytes, each one preadv
                    pos, group, size = 0, [], 0
                    for seg in segs:
                        group.append(seg)
                        size += len(seg)
                        if size >= _PIECE or seg is segs[-1]:
                            jobs.append((fd, group, HEADER_SIZE + pos))
                            pos, group, size = pos + size, [], 0
                    target = segs
        targets.append(target)
        pieces.append(range(first, len(jobs)))
