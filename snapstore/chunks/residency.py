"""Is a chunk file in the page cache? The probe behind a restore's tiers (warm or cold) and the
choice between buffered and direct reads: it must read nothing, fault nothing, and cost little
next to a small restore (issue 31).

cachestat(2) (Linux 6.5+) answers in one system call: about 2 µs a file here. Where it is missing
or filtered (an older kernel, a seccomp filter) the probe falls back to mincore(2)
over a mapping of the file that is never touched: a mapping, the call and the unmapping, about
16 µs a file. A file at least half cached counts as cached; True where neither can tell (the
buffered path, as before).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import sys
from typing import Any

import numpy as np

__all__ = ["probe_kind", "resident"]

_CACHESTAT = 451  # the same number on every architecture (the unified syscall table)
_PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


class _Libc:
    """libc with what the probes call, typed for ctypes; ``cachestat`` turns off where the call is
    missing or filtered (:func:`_cachestat`)."""

    def __init__(self) -> None:
        self.c: Any = ctypes.CDLL(None, use_errno=True)
        self.c.mmap.restype = ctypes.c_void_p
        self.c.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_long]
        self.c.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.c.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.c.syscall.restype = ctypes.c_long
        self.cachestat = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64", "arm64")


_LIBC: _Libc | None | bool = None  # None until first used, False where ctypes cannot load libc


def _libc() -> _Libc | None:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = _Libc()
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC if isinstance(_LIBC, _Libc) else None


def _cachestat(libc: _Libc, fd: int, size: int) -> int | None:
    """Cached pages of the first ``size`` bytes of ``fd``, or None where the kernel will not say."""
    rng, out = _Range(0, size), _Stat()
    if libc.c.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) == 0:
        return int(out.nr_cache)
    err = ctypes.get_errno()
    # ENOSYS: no such call here (an older kernel, or a filter that says so): mincore from now on.
    # EPERM is either a seccomp filter (every call) or the kernel refusing this one file (one the
    # process neither owns nor may write): asked once of a file of its own, which tells them apart.
    if err == errno.ENOSYS or (err == errno.EPERM and not _allowed_on_own_file(libc)):
        libc.cachestat = False
    return None


def _allowed_on_own_file(libc: _Libc) -> bool:
    """Does cachestat answer for an anonymous file this process created (memfd)? False: it is
    filtered for the whole process."""
    try:
        fd = os.memfd_create("snapstore-cachestat", os.MFD_CLOEXEC)
    except (OSError, AttributeError):
        return False
    try:
        rng, out = _Range(0, 1), _Stat()
        return int(libc.c.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0)) == 0
    finally:
        os.close(fd)


def _mincore(libc: _Libc, fd: int, size: int) -> int | None:
    """Cached pages of the first ``size`` bytes of ``fd`` by mincore over an untouched mapping."""
    addr = libc.c.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = (ctypes.c_ubyte * (-(-size // _PAGE)))()
        if libc.c.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return None
        return int(np.count_nonzero(np.frombuffer(memoryview(vec).cast("B"), dtype=np.uint8) & 1))
    finally:
        libc.c.munmap(ctypes.c_void_p(addr), size)


def resident(fd: int, size: int) -> bool:
    """Are at least half the pages of the file open as ``fd`` (``size`` bytes) in the page cache?
    Reads nothing. (A RWF_NOWAIT read is no probe on this kernel: its EAGAIN still reads the page
    in, so the third restore of a cold chunk would see it "cached".) True where it cannot tell."""
    libc = _libc()
    if libc is None or size <= 0:
        return True
    cached = _cachestat(libc, fd, size) if libc.cachestat else None
    if cached is None:
        cached = _mincore(libc, fd, size)
    if cached is None:
        return True
    return 2 * cached >= -(-size // _PAGE)


def probe_kind() -> str:
    """Which probe this process uses: "cachestat", "mincore" or "none" (docs, tests)."""
    libc = _libc()
    return "none" if libc is None else "cachestat" if libc.cachestat else "mincore"
