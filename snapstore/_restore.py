"""Restore side: stream a validated plan's chunks into the destination buffers.

Phase 1 opens every chunk file and checks its header against the catalog (an open descriptor
keeps the bytes readable even if a concurrent eviction unlinks the file), so a snapshot that
vanished is reported before anything is written. Phase 2 reads each chunk straight into the
destination when it is raw and the destination is contiguous, else through the staging buffer,
and checks every chunk's XXH3-128 as it lands.
"""

from __future__ import annotations

import os
from typing import Callable

from ._chunker import StagingBuffer
from ._chunkfile import CODEC_RAW, HEADER_SIZE, ChunkHeader, checksum, decode_payload, parse_header, read_exact
from ._errors import CorruptChunkError, CorruptionError, RestoreError, SnapshotUnavailableError
from ._plan import PlanItem, RestorePlan
from ._ramtier import RamTier

__all__ = ["stream_plan"]

_PREFETCH = 4  # chunk files ahead of the one being read that the kernel is asked to read ahead


def _open_all(plan: RestorePlan, blob_path: Callable[[bytes], str],
              ram: RamTier | None) -> list[tuple[PlanItem, int, ChunkHeader | None, bytes | None]]:
    opened: list[tuple[PlanItem, int, ChunkHeader | None, bytes | None]] = []
    fds: dict[bytes, int] = {}
    try:
        for item in plan.items:
            cid = item.chunk.id
            data = ram.get(cid) if ram is not None else None
            if data is not None:  # held from here on: a RAM eviction cannot pull it away mid-restore
                opened.append((item, -1, None, data))
                continue
            if cid not in fds:
                path = blob_path(cid)
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


def _advise(fd: int) -> None:
    if fd >= 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def stream_plan(plan: RestorePlan, blob_path: Callable[[bytes], str], staging: StagingBuffer,
                ram: RamTier | None) -> None:
    """Write every chunk of ``plan``; RestoreError(touched=...) on any failure."""
    opened = _open_all(plan, blob_path, ram)
    touched = False
    try:
        for k in range(min(_PREFETCH, len(opened))):
            _advise(opened[k][1])
        for k, (item, fd, head, data) in enumerate(opened):
            if k + _PREFETCH < len(opened):
                _advise(opened[k + _PREFETCH][1])
            cid, n = item.chunk.id, item.chunk.raw_len
            if data is not None:
                touched = True
                item.sink.write(item.offset, memoryview(data))
                continue
            assert head is not None
            target = item.sink.view(item.offset, item.offset + n)
            try:
                if head.codec == CODEC_RAW and target is not None:
                    touched = True
                    read_exact(fd, target, HEADER_SIZE)
                    good = checksum(target) == item.chunk.checksum
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
                raise RestoreError(
                    f"snapshot {plan.snapshot_id}: reading chunk {cid.hex()} failed ({e.strerror}); "
                    + ("the destination was partly written: re-read the prompt" if touched
                       else "nothing was written"), touched=touched, snapshot_id=plan.snapshot_id) from None
            else:
                reason = "checksum mismatch"
            if not good:
                if ram is not None:
                    ram.discard(cid)
                raise CorruptChunkError(
                    f"snapshot {plan.snapshot_id}: chunk {cid.hex()} is corrupt ({reason}); "
                    + ("the destination was partly written: re-read the prompt" if touched
                       else "nothing was written"), touched=touched, snapshot_id=plan.snapshot_id)
            if ram is not None:
                ram.put(cid, out)
    finally:
        for fd in {entry[1] for entry in opened if entry[1] >= 0}:
            try:
                os.close(fd)
            except OSError:
                pass
