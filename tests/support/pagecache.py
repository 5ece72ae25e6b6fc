"""What the page cache holds of a file, asked of the kernel directly (mincore(2) over a mapping),
so tests can tell a read that went through the page cache from one that bypassed it."""

from __future__ import annotations

import ctypes
import mmap
import os

__all__ = ["cached_pages", "drop_cache"]


def cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = ctypes.create_string_buffer(pages)
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
        return sum(b & 1 for b in vec.raw)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Write back and drop the clean pages of ``path`` (posix_fadvise DONTNEED): a cold file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
