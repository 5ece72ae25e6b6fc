"""The staging buffer: one reusable, 4 KiB-aligned host buffer whose slots carry chunks between an
engine's buffers and the chunk files, in both directions (save stages into it, restore reads through it)."""

from __future__ import annotations

import errno
import threading

import numpy as np

from snapstore._errors import StoreIOError
from snapstore.chunks.chunkfile import HEADER_SIZE
from snapstore.chunks.direct_io import ALIGN, align_up

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """One reusable host buffer split into equal slots; at most len(slots) chunks in flight.

    Each slot is a 4 KiB-aligned frame: HEADER_SIZE bytes of room for a chunk header, then the
    slot's ``slot_bytes`` of data (what :meth:`acquire` hands out), then padding to the alignment,
    so a raw chunk can be written straight from its slot with O_DIRECT (see ``chunks.direct_io``).
    """

    def __init__(self, nbytes: int, slot_bytes: int):
        count = max(1, nbytes // slot_bytes)
        self.slot_bytes = slot_bytes
        self._stride = align_up(slot_bytes + HEADER_SIZE)
        self._buf: np.ndarray | None = None
        self._base = 0
        self._count = count
        self._free: list[int] = list(range(count))
        self._cv = threading.Condition()

    @property
    def slots(self) -> int:
        """How many chunks may be in flight at once."""
        return self._count

    @property
    def writers(self) -> int:
        """Threads a save's pool needs: two per slot (at least 2, at most 8), so the hash and write of
        every chunk in flight run at once, the copy of the next overlaps them, and a chunk whose slot
        is already free (written, now being made durable) holds no thread a staged one needs. With
        fewer threads than slots, staged chunks wait for a thread while the disk idles between
        writes (measured: docs/benchmarks.md, "Issue 12, save pipeline")."""
        return max(2, min(2 * self._count, 8))

    def acquire(self) -> tuple[int, memoryview]:
        """Wait for a free slot; return its index and a view of it."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            if self._buf is None:  # allocated on first use, before a slot is taken: a failure loses none
                try:
                    buf = np.empty(self._count * self._stride + ALIGN, dtype=np.uint8)
                except MemoryError:
                    raise StoreIOError(errno.ENOMEM, f"cannot allocate the {self._count * self.slot_bytes >> 20} MiB "
                                       "staging buffer: free memory, or lower staging_bytes "
                                       "($SNAPSTORE_STAGING_MIB)") from None
                self._buf, self._base = buf, -buf.ctypes.data % ALIGN
            i = self._free.pop()
            start = self._base + i * self._stride + HEADER_SIZE
            return i, self._buf.data[start:start + self.slot_bytes]

    def frame(self, i: int, n: int) -> memoryview:
        """Slot ``i``'s aligned frame for a chunk of ``n`` data bytes: the header room, the data
        (as :meth:`acquire` handed it out) and padding up to the alignment."""
        assert self._buf is not None and 0 <= n <= self.slot_bytes
        start = self._base + i * self._stride
        return self._buf.data[start:start + align_up(HEADER_SIZE + n)]

    def release(self, i: int) -> None:
        """Give a slot back."""
        with self._cv:
            self._free.append(i)
            self._cv.notify()
