"""The staging buffer: one reusable host buffer in two halves, and the ordering rules of device copies.

Device tensors go through :class:`Staging`. On restore, the core reads/decompresses chunk *k*
straight into one half (``TensorSink.buffer_for``), and once its checksum matched its
host-to-device copy is queued on a side stream (``commit``); chunk *k+1* goes into the other half
while that copy runs, and the core only waits when it comes back to the same half. On save, the
core hashes and writes chunk *k* straight from the half its device-to-host copy landed in
(``TensorSource.view``) while the copy of the next range is queued into the other half; a half the
core still holds is not reused before it hands it back. Streams, events, pinned memory and queued
copies go through the device seam (``engine._device``), so tests run this very code against a
late-execution stream model; the ordering rules live in :meth:`Staging.transfer` and
:meth:`Staging.wait_half` (docs/engine.md, "Ordering").
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable

import torch

from snapstore import ConfigError

from ._device import CUDA, DeviceBackend, DeviceEvent, DeviceStream

__all__ = ["ALIGN", "DEFAULT_STAGING_BYTES", "MIB", "Staging", "backend_of", "shared_staging"]

MIB = 1 << 20
DEFAULT_STAGING_BYTES = 64 * MIB

ALIGN = 4096  # staging halves are multiples of this: every dtype view of either half stays aligned


class Staging:
    """One reusable host buffer in two halves (page-locked when CUDA is available).

    nbytes: total size (``SNAPSTORE_STAGING_MIB``, default 64 MiB), rounded down so that each half
    is a multiple of 4096 bytes; allocated on first use, only for device tensors (CPU tensors never
    need it). One Staging serves any number of parts and threads (``lock``), one chunk at a time.
    backend: the device seam (``engine._device``; default ``torch.cuda``).

    Ordering rules, kept in one place (:meth:`transfer`, :meth:`wait_half`): every transfer waits
    for the engine's stream first; each half's event is recorded after its copies even when
    queuing them raised; a half is reused only after its event, and only once the core handed it
    back if it was lent (:meth:`lend`); :meth:`synchronize` waits for both halves and the side
    streams and drops any prefetch.
    """

    def __init__(self, nbytes: int | None = None, *, pin: bool | None = None,
                 backend: DeviceBackend | None = None):
        if nbytes is None:
            env = os.environ.get("SNAPSTORE_STAGING_MIB")
            nbytes = int(env) * MIB if env else DEFAULT_STAGING_BYTES
        if nbytes < 2 * ALIGN:
            raise ConfigError(f"staging buffer must be at least 8 KiB, got {nbytes}")
        self.half = nbytes // 2 // ALIGN * ALIGN
        self.nbytes = 2 * self.half
        self.backend: DeviceBackend = backend if backend is not None else CUDA
        self.pin = self.backend.available() if pin is None else pin
        self._buf: torch.Tensor | None = None
        self._events: list[DeviceEvent | None] = [None, None]
        self._streams: dict[torch.device, DeviceStream] = {}  # device -> side stream
        self._next = 0
        # (source object, offset, length, half): a device->host copy queued ahead of the read that
        # wants it. Keyed on the object itself (held), never on id(), and dropped by synchronize().
        self._prefetch: tuple[object, int, int, int] | None = None
        self.lock = threading.RLock()
        # halves lent to the core (read or filled in place); handed back from any thread, without
        # ``lock`` (a chunker pool thread gives a save's half back while the saver holds the lock)
        self._lent = [False, False]
        self._lent_cv = threading.Condition()

    @property
    def allocated(self) -> bool:
        """True once the host buffer exists."""
        return self._buf is not None

    def buffer(self) -> torch.Tensor:
        """The host buffer (allocated on first call)."""
        if self._buf is None:
            self._buf = self.backend.empty_host(self.nbytes, self.pin)
        return self._buf

    def half_view(self, h: int, n: int) -> torch.Tensor:
        """The first ``n`` bytes of half ``h``."""
        return self.buffer()[h * self.half:h * self.half + n]

    def stream(self, device: torch.device) -> DeviceStream:
        """The side stream transfers to/from ``device`` run on (one per device)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = self.backend.new_stream(device)
        return s

    def transfer(self, h: int, device: torch.device, wait_for: DeviceStream | None,
                 queue: Callable[[], None]) -> None:
        """Queue ``queue()``'s copies on the side stream, after the work already queued on
        ``wait_for`` (default: the current stream), then record half ``h``'s event — also when
        queuing raised part-way, so the copies already queued are waited for before ``h`` is reused.
        """
        be = self.backend
        stream = self.stream(device)
        stream.wait_stream(wait_for if wait_for is not None else be.current_stream(device))
        try:
            with be.use(stream):
                queue()
        finally:
            ev = be.event()
            ev.record(stream)
            self._events[h] = ev

    def lend(self, h: int) -> None:
        """Half ``h`` is lent to the core: not reused until :meth:`give_back`."""
        with self._lent_cv:
            self._lent[h] = True

    def give_back(self, h: int) -> None:
        """The core is through with half ``h``."""
        with self._lent_cv:
            self._lent[h] = False
            self._lent_cv.notify_all()

    def wait_half(self, h: int) -> None:
        """Block until half ``h`` is handed back (if lent) and the transfer last queued on it is done."""
        with self._lent_cv:
            while self._lent[h]:
                self._lent_cv.wait()
        ev = self._events[h]
        if ev is not None:
            ev.synchronize()
            self._events[h] = None

    def flip(self) -> int:
        """The half to use next (waits for its previous transfer)."""
        h = self._next
        self._next ^= 1
        self.wait_half(h)
        return h

    def take_prefetch(self, owner: object, offset: int, n: int) -> int | None:
        """The half holding ``owner``'s bytes [offset, offset + n) if they were prefetched; the
        prefetch is consumed (or discarded) either way."""
        pf, self._prefetch = self._prefetch, None
        if pf is not None and pf[0] is owner and pf[1] == offset and pf[2] >= n:
            return pf[3]
        return None

    def put_prefetch(self, owner: object, offset: int, n: int, h: int) -> None:
        """Half ``h`` now holds (or is copying) ``owner``'s bytes [offset, offset + n), queued ahead of
        the read that wants them; the next :meth:`flip` takes the other half."""
        self._prefetch = (owner, offset, n, h)
        self._next = h ^ 1

    def synchronize(self) -> None:
        """Wait for every queued transfer (both halves and every side stream); drop any prefetch."""
        try:
            for h in (0, 1):
                self.wait_half(h)
            for s in list(self._streams.values()):
                s.synchronize()
        finally:
            self._prefetch = None

    def drain(self) -> None:
        """:meth:`synchronize` on an error path: the error being raised is the one that matters."""
        with contextlib.suppress(Exception):
            self.synchronize()

    def release(self) -> None:
        """Drop the host buffer once no save/restore is using it (allocated again on next use)."""
        with self.lock:
            self.synchronize()
            self._buf = None


_SHARED: weakref.WeakKeyDictionary[DeviceBackend, Staging] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_staging(backend: DeviceBackend | None = None) -> Staging:
    """The process-wide Staging that device sources/sinks made with ``staging=None`` share (one
    pinned buffer per backend, instead of one per part)."""
    be = backend if backend is not None else CUDA
    with _SHARED_LOCK:
        st = _SHARED.get(be)
        if st is None:
            st = _SHARED[be] = Staging(backend=be)
        return st


def backend_of(staging: Staging | None, backend: DeviceBackend | None) -> DeviceBackend:
    """The device seam a source/sink uses: its staging's, else the one given, else ``torch.cuda``."""
    return staging.backend if staging is not None else (backend if backend is not None else CUDA)
