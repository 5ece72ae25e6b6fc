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
restore soon after a save reads from the disk (cold rate) instead of memory. Turn it off with
``direct_io=False`` / ``SNAPSTORE_DIRECT_IO=0`` where restores usually follow saves within seconds
and the disk is not the bottleneck.
"""

from __future__ import annotations

import errno
import os

from ._errors import ConfigError
from ._publish import create_temp, finish_temp, write_all

__all__ = ["ALIGN", "O_DIRECT", "align_up", "direct_default", "write_direct"]

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks

# Test hook: "open" or "write" makes that step fail with EINVAL as a file system that refuses
# O_DIRECT does (this kernel's tmpfs accepts it); None in production.
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
    flag = os.environ.get("SNAPSTORE_DIRECT_IO", "").strip().lower()
    if flag in ("", "1", "true", "yes", "on"):
        return O_DIRECT != 0
    if flag in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"$SNAPSTORE_DIRECT_IO must be 0/1 (or true/false), got {flag!r}")


class _Refused(Exception):
    """The file system refused O_DIRECT for this file."""


def write_direct(tmp_dir: str, frame: memoryview, size: int) -> str | None:
    """Write ``frame`` (aligned address, length a multiple of ALIGN) to a fresh temp file with
    O_DIRECT, truncate it to ``size`` bytes, fsync and close it; return its path, or None when
    the file system refuses direct I/O (nothing is left behind; write it buffered instead)."""
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
            write_all(fd, frame)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise _Refused() from None
            raise
        os.ftruncate(fd, size)
        return True

    try:
        return finish_temp(fd, path, fill)
    except _Refused:
        return None
