"""Direct I/O for chunk files: aligned staging frames written with O_DIRECT, with a clean fallback.

A buffered write + fsync copies every byte into the page cache and then waits for writeback; on
the virtio disks these stores live on, O_DIRECT + fsync of the same bytes runs 2-4x faster
(docs/benchmarks.md). A chunk file is a 64-byte header then the payload, so the staging buffer
keeps each slot's data at offset HEADER_SIZE of a 4 KiB-aligned frame: the header goes in front
of the bytes already there, the frame is written whole (its length rounded up to the alignment)
and the file truncated to its real size before the fsync. No extra copy of the payload.

File systems that refuse O_DIRECT (tmpfs, some FUSE and network mounts: EINVAL at open or at the
first write) get the buffered path; the caller remembers the refusal for the store's lifetime.

Trade-off (measured, docs/benchmarks.md): a direct write leaves nothing in the page cache, so a
restore soon after a save reads from the disk (cold rate) instead of memory; the chunker writes
chunks under ``DIRECT_SAVE_MIN`` (1 MiB) buffered for that reason (small prefixes stay cached). Turn it off with
``direct_io=False`` / ``SNAPSTORE_DIRECT_IO=0`` where restores usually follow saves within seconds
and the disk is not the bottleneck.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from snapstore._config import env_flag
from snapstore._errors import ConfigError
from snapstore.chunks.publish import create_temp, finish_temp, write_all

__all__ = ["ALIGN", "DIRECT_PIECE", "DIRECT_THREADS", "O_DIRECT", "DirectReads", "align_up", "direct_default",
           "direct_reads_default", "direct_reads_setting", "write_direct"]

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks

# Test hook: "open" or "write" makes that step of a save fail with EINVAL as a file system that
# refuses O_DIRECT does (this kernel's tmpfs accepts it); "setfl" or "read" the same for a
# restore's fcntl(O_DIRECT) or its direct reads; None in production.
_TEST_REFUSE: str | None = None
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def direct_default(value: bool | None) -> bool:
    """The keyword, else ``$SNAPSTORE_DIRECT_IO`` (0/1), else on where the platform has O_DIRECT."""
    if value is not None:
        if not isinstance(value, bool):
            raise ConfigError(f"direct_io must be True, False or None, got {value!r}")
        return value and O_DIRECT != 0
    return env_flag("SNAPSTORE_DIRECT_IO", True) and O_DIRECT != 0


class _Refused(Exception):
    """The file system refused O_DIRECT for this file."""


def write_direct(tmp_dir: str, frame: memoryview, size: int, turn: AbstractContextManager[object] | None = None,
                 written: Callable[[], None] | None = None) -> str | None:
    """Write ``frame`` (aligned address, length a multiple of ALIGN) to a fresh temp file with
    O_DIRECT, truncate it to ``size`` bytes, fsync and close it; return its path, or None when
    the file system refuses direct I/O (nothing is left behind; write it buffered instead).
    ``turn``: held around the write itself (the caller's one-write-at-a-time lock); ``written``:
    called once the write returned, when ``frame`` may be reused (the fsync follows)."""
    try:
        if _TEST_REFUSE == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd, path = create_temp(tmp_dir, O_DIRECT)
    except OSError as e:  # StoreIOError is an OSError
        if e.errno == errno.EINVAL:
            return None
        raise

    def fill(fd: int) -> bool:
        try:
            if _TEST_REFUSE == "write":
                raise OSError(errno.EINVAL, "Invalid argument")
            with turn if turn is not None else nullcontext():
                write_all(fd, frame)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise _Refused() from None
            raise
        if written is not None:
            written()
        os.ftruncate(fd, size)
        return True

    try:
        return finish_temp(fd, path, fill)
    except _Refused:
        return None


# -- read side: cold chunks read with O_DIRECT, resident ones through the page cache -------------
# A buffered cold read goes through readahead one request window at a time; O_DIRECT reads of the
# same file with several in flight can reach more of the device's rate. But an O_DIRECT read neither
# uses nor fills the page cache: a chunk whose pages are cached is read buffered (:func:`resident`
# decides), and a chunk read direct is cold again at its next restore. Measured here (docs/
# benchmarks.md, "Issue 12, cold restores with reads in flight"): cold restores 1.0-1.4x faster,
# the next restore of the same chunks 1.9-2.5x slower; on another VM 2.7x slower cold (issue 48). So
# no fixed choice: unless asked for, the store measures its storage (snapstore.restore.read_path).

def direct_reads_setting(value: bool | None) -> bool | None:
    """The keyword, else ``$SNAPSTORE_DIRECT_READS`` (0/1), else None: measured per storage (issue 48,
    :mod:`snapstore.restore.read_path`); True is never granted without O_DIRECT."""
    if value is not None:
        if not isinstance(value, bool):
            raise ConfigError(f"direct_reads must be True, False or None, got {value!r}")
        return value and O_DIRECT != 0
    if not os.environ.get("SNAPSTORE_DIRECT_READS", "").strip():
        return None
    return env_flag("SNAPSTORE_DIRECT_READS", False) and O_DIRECT != 0


def direct_reads_default(value: bool | None) -> bool:
    """:func:`direct_reads_setting` with "measured" read as off (kept for callers of the old name)."""
    return bool(direct_reads_setting(value))


DIRECT_THREADS = 8  # reads in flight (docs/benchmarks.md, "Issue 12, cold restores with reads in flight")
DIRECT_PIECE = 1 << 20  # bytes per read: about one request of a virtio disk (max_sectors_kb 1280)


class DirectReads:
    """Whether a store reads cold raw chunks with O_DIRECT, with how many reads in flight (``threads``)
    of how many bytes (``piece``); off for good once its file system refuses (EINVAL at fcntl or at a
    read: tmpfs on some kernels, FUSE, network mounts), as saves do. With neither ``direct_reads=`` nor
    ``$SNAPSTORE_DIRECT_READS`` set, the store measures which is faster (:mod:`snapstore.restore.read_path`)."""

    def __init__(self, on: bool, threads: int = DIRECT_THREADS, piece: int = DIRECT_PIECE):
        self.on = on and O_DIRECT != 0
        self.threads, self.piece = threads, piece
        self.refused = False  # the file system refused O_DIRECT (EINVAL): off for good

    def enable(self, fd: int) -> bool:
        """Turn O_DIRECT on for the open file ``fd`` (the same inode the header check read); False when
        that fails, and off for this store when the file system refuses it (EINVAL)."""
        if not self.on:
            return False
        try:
            if _TEST_REFUSE == "setfl":
                raise OSError(errno.EINVAL, "Invalid argument")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:  # the file system's answer; anything else: this file, buffered
                self.on, self.refused = False, True
            return False
        return True

    @staticmethod
    def disable(fd: int) -> None:
        """Back to buffered reads on ``fd``."""
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)

    def read(self, fd: int, buf: memoryview, offset: int, need: int) -> int:
        """Read ``need`` bytes of ``fd`` from ``offset`` (a multiple of ALIGN) into ``buf`` (aligned,
        ``align_up(need)`` bytes); returns how many came (fewer only at the end of the file). A read
        the file system refuses (EINVAL) is redone buffered, and the store reads buffered from then on."""
        got = 0
        while got < need:
            try:
                if _TEST_REFUSE == "read" and fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
                    raise OSError(errno.EINVAL, "Invalid argument")
                k = os.preadv(fd, [buf[got:]], offset + got)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.on, self.refused = False, True
                self.disable(fd)
                k = os.preadv(fd, [buf[got:need]], offset + got)
            if k == 0:
                break
            got += k
        return got
