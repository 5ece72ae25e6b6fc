"""The read-path probe's reads (:func:`snapstore.restore.read_path.measure`): its temp file read the
way each method would read a chunk file, buffered in lanes or with O_DIRECT reads in flight."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np

from snapstore.chunks.direct_io import ALIGN, O_DIRECT
from snapstore.restore.read_choice import BUFFERED, Candidate

__all__ = ["aligned", "read_buffered", "read_direct"]


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
