"""The read-path probe (:func:`measure`, for :mod:`snapstore.restore.read_path`): a temp file in the
store's ``tmp/``, written, fsynced, and read back cold once per method and round, the way each
method reads a chunk file (buffered in lanes, or O_DIRECT reads in flight)."""

from __future__ import annotations

import contextlib
import errno
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from snapstore._errors import SnapstoreError, StoreIOError
from snapstore.chunks.direct_io import ALIGN, O_DIRECT
from snapstore.chunks.publish import create_temp, write_all
from snapstore.chunks.residency import resident
from snapstore.restore.read_choice import BUFFERED, CACHED, CANDIDATES, Candidate, Measured, choose

__all__ = ["FREE_MARGIN", "PROBE_BYTES", "PROBE_ROUNDS", "Stopped", "aligned", "drop_pages", "measure", "read_buffered",
           "read_direct"]

PROBE_BYTES = 64 << 20  # the probe file: several chunks' worth, a fraction of a second to read
PROBE_ROUNDS = 3  # medians of this many reads per method
FREE_MARGIN = 1 << 30  # free space the probe leaves untouched beyond twice its file (a save's room)
_BUF = 16 << 20  # the probe's read buffer (reused: memory stays bounded), one staging slot's worth


def aligned(n: int) -> memoryview:
    """``n`` bytes of fresh memory at a 4 KiB-aligned address (O_DIRECT reads need it)."""
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + n].data.cast("B")


def read_buffered(path: str, size: int, buf: memoryview) -> None:
    """Read the file as the buffered restore path reads chunk files: a lane per file, each sequential
    in ``BUFFERED.piece`` requests (the probe's halves stand for two files, each its own description)."""
    lane = -(-size // BUFFERED.threads // ALIGN) * ALIGN
    share = len(buf) // BUFFERED.threads

    def run(k: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            out = buf[k * share:(k + 1) * share]
            pos, end = k * lane, min(size, (k + 1) * lane)
            while pos < end:
                n = os.preadv(fd, [out[:min(len(out), BUFFERED.piece, end - pos)]], pos)
                if n <= 0:
                    raise OSError(5, "the probe file is shorter than written")
                pos += n
        finally:
            os.close(fd)

    _threads(BUFFERED.threads, run)


def read_direct(path: str, size: int, buf: memoryview, cand: Candidate) -> None:
    """Read the file with O_DIRECT, ``cand.threads`` reads of ``cand.piece`` bytes in flight (lane
    ``k`` reads pieces k, k + threads, ...), each into its own piece of ``buf``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | O_DIRECT)
    try:
        piece = min(cand.piece, len(buf) // cand.threads // ALIGN * ALIGN)
        pieces = -(-size // piece)

        def run(k: int) -> None:
            out = buf[k * piece:(k + 1) * piece]
            for j in range(k, pieces, cand.threads):
                if os.preadv(fd, [out], j * piece) <= 0:
                    raise OSError(5, "the probe file is shorter than written")

        _threads(cand.threads, run)
    finally:
        os.close(fd)


def _threads(n: int, run: Callable[[int], None]) -> None:
    """``run(k)`` for k < n on n threads; the first error is raised once all are done."""
    errors: list[BaseException] = []

    def body(k: int) -> None:
        try:
            run(k)
        except BaseException as e:  # raised below, on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(k,), name="snapstore-probe", daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def drop_pages(fd: int, size: int) -> bool:
    """Drop the (clean) pages of the probe file; True when they left."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    return not resident(fd, size)


def measure(tmp_dir: str, size: int = PROBE_BYTES, rounds: int = PROBE_ROUNDS,
            candidates: Sequence[Candidate] = CANDIDATES, stop: Callable[[], bool] | None = None,
            reserve: int = FREE_MARGIN) -> Measured:
    """Measure each candidate's cold read rate of a ``size``-byte temp file in ``tmp_dir`` (removed
    afterwards), medians of ``rounds``; ``stop()`` true between reads abandons it (SnapstoreError).
    OSError (a full disk, a read-only file system) reaches the caller; a method the file system
    refuses (EINVAL) counts 0. ``reserve``: free space left untouched beyond twice the file (the
    store's ``Budget.reserve_bytes``)."""
    size = max(ALIGN, size // ALIGN * ALIGN)
    try:
        vfs = os.statvfs(tmp_dir)
        free = vfs.f_bavail * vfs.f_frsize
    except OSError:
        free = -1
    if 0 <= free < 2 * size + reserve:  # the probe never takes the room a save needs
        raise StoreIOError(errno.ENOSPC, f"{free >> 20} MiB free under {tmp_dir}: the read-path probe needs "
                           f"{(2 * size + reserve) >> 20} MiB free; measured another time")
    fd, path = create_temp(tmp_dir)
    rfd = -1
    try:
        block = np.random.default_rng().integers(0, 256, size=min(size, 4 << 20), dtype=np.uint8)
        done = 0
        while done < size:
            n = min(len(block), size - done)
            write_all(fd, block.data[:n])
            done += n
        os.fsync(fd)  # clean pages: DONTNEED drops them
        buf = aligned(_BUF)
        times: dict[str, list[float]] = {c.name: [] for c in candidates}
        refused: set[str] = {c.name for c in candidates if c.method == "direct"} if O_DIRECT == 0 else set()
        rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # the residency probe maps the file: a readable descriptor
        dropped = True
        for r in range(rounds):
            order = list(candidates[r % len(candidates):]) + list(candidates[:r % len(candidates)])
            for cand in order:
                if cand.name in refused:
                    continue
                if stop is not None and stop():
                    raise Stopped("the read-path probe was stopped (the store is closing)")
                dropped &= drop_pages(rfd, size)
                t0 = time.perf_counter()
                try:
                    if cand.method == "buffered":
                        read_buffered(path, size, buf)
                    else:
                        read_direct(path, size, buf, cand)
                except OSError as e:
                    if cand.method != "direct" or e.errno != 22 or O_DIRECT == 0:  # EINVAL: O_DIRECT refused
                        raise
                    refused.add(cand.name)
                    continue
                times[cand.name].append(time.perf_counter() - t0)
                if cand.method == "buffered":  # again, from the pages that read left cached
                    t0 = time.perf_counter()
                    read_buffered(path, size, buf)
                    times.setdefault(CACHED, []).append(time.perf_counter() - t0)
        rates = {name: (size / statistics.median(ts) if ts and name not in refused else 0.0)
                 for name, ts in times.items()}
        chosen, reason = choose(rates, candidates)
        if not dropped:
            reason += "; the page cache could not be dropped here (these are cached reads)"
        return Measured(rates, chosen, reason, dropped)
    finally:
        os.close(fd)
        if rfd >= 0:
            os.close(rfd)
        with contextlib.suppress(OSError):
            os.unlink(path)


class Stopped(SnapstoreError):
    """The probe was abandoned (the store is closing)."""
