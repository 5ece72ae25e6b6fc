"""torch tensors as snapstore parts: dtype names, canonical byte order, and the staging buffer.

A part is stored canonically: C-order bytes with the token axis outermost. A torch tensor whose
token axis is elsewhere (``[batch, heads, tokens, head_dim]``), or that is a non-contiguous view,
or that lives on a GPU, is read and written through :class:`TensorSource` / :class:`TensorSink`,
which implement the core's ``PartReader`` / ``PartWriter`` protocols by copying byte ranges of the
canonical order. A CPU tensor that is already canonical and contiguous is handed to the core as a
zero-copy numpy ``uint8`` view instead (no copy at all on save or restore).

Device tensors go through :class:`Staging`: one reusable host buffer (page-locked when CUDA is
available), split in two halves. On restore, the core reads/decompresses chunk *k* straight into
one half (``buffer_for``), and once its checksum matched its host-to-device copy is queued on a
side CUDA stream (``commit``); chunk *k+1* goes into the other half while that copy runs, and the
core only waits when it comes back to the same half. On save, the core hashes and writes chunk *k*
straight from the half its device-to-host copy landed in (``view``) while the copy of the next
range is queued into the other half (never past the bytes the save reads); a half the core still
holds is not reused before it hands it back (``release``). A chunk larger than a half goes through
``read_into`` / ``write_from`` and the core's own slot instead (one host memcpy more). Streams, events, pinned
memory and queued copies go through the device seam (``engine._device``), so tests run this very
code against a late-execution stream model; the ordering rules live in :meth:`Staging.transfer`
(docs/engine.md, "Ordering").
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from snapstore import (
    DTYPE_NAMES,
    ConfigError,
    DestinationError,
    Fixed,
    LayoutError,
    RestoreError,
    Rows,
    SnapstoreError,
    SourceError,
)

from ._device import CUDA

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Staging",
    "TensorSink",
    "TensorSource",
    "canonical",
    "dtype_name",
    "fixed_spec",
    "flat_bytes",
    "rows_spec",
    "shared_staging",
    "torch_dtype",
]

MIB = 1 << 20
DEFAULT_STAGING_BYTES = 64 * MIB

_BY_NAME: dict[str, torch.dtype] = {}
for _name in DTYPE_NAMES:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _BY_NAME[_name] = _dt
_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}
# bit-exact copies: move every element as an integer of the same width (no float canonicalisation,
# works for dtypes whose copy kernels a device may lack, e.g. float8 on CPU)
_SAME_WIDTH: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """The core's dtype name of a torch dtype ('bfloat16', 'float8_e4m3fn', 'float16', ...)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise LayoutError(f"torch dtype {dtype} has no snapstore dtype name") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a core dtype name; LayoutError if this torch build lacks it."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise LayoutError(f"dtype {name!r} is not available in torch {torch.__version__}") from None


def canonical(t: torch.Tensor, token_dim: int | None = None) -> torch.Tensor:
    """A view of ``t`` with the token axis outermost (no copy); ``t`` itself when token_dim is None/0."""
    t = t.detach()
    if token_dim is None:
        return t
    if t.dim() == 0:
        raise LayoutError("a 0-dim tensor has no token axis")
    d = token_dim % t.dim()
    return t if d == 0 else t.movedim(d, 0)


def rows_spec(t: torch.Tensor, token_dim: int = 0, component: str | None = None) -> Rows:
    """The row-stream spec of a tensor whose axis ``token_dim`` counts tokens."""
    c = canonical(t, token_dim)
    return Rows(dtype_name(t.dtype), tuple(c.shape[1:]), component=component)


def fixed_spec(t: torch.Tensor, token_dim: int | None = None, component: str | None = None) -> Fixed:
    """The fixed-part spec of a tensor (stored in canonical order when token_dim is given)."""
    c = canonical(t, token_dim)
    return Fixed(dtype_name(t.dtype), tuple(c.shape), component=component)


def _bits(c: torch.Tensor) -> torch.Tensor:
    """Same-width integer view (always allowed, whatever the strides)."""
    alt = _SAME_WIDTH.get(c.element_size())
    return c if alt is None or c.dtype == alt else c.view(alt)


def flat_bytes(c: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous (or 0-dim) tensor as a 1-D uint8 view.

    ``as_strided`` rather than ``reshape(-1)``: torch calls a one-element tensor contiguous whatever
    its strides (``t.t()[3:4, 1:2]`` has last stride 5), and ``reshape`` keeps that stride, which
    ``view(torch.uint8)`` then refuses.
    """
    return c.as_strided((c.numel(),), (1,)).view(torch.uint8)


def refuse_lazy(t: torch.Tensor, err: type[LayoutError], what: str) -> None:
    """Refuse lazy conjugate / negative views: their memory is not the values they show."""
    if t.is_conj() or t.is_neg():
        kind = "conjugate" if t.is_conj() else "negative"
        raise err(f"{what} is a lazy {kind} view (its memory holds the un-{kind}d values); pass "
                  f"t.resolve_conj() / t.resolve_neg() (a copy), or the tensor it is a view of")


_EXACT_OVERLAP_MAX = 1 << 22  # elements: beyond this, a layout the fast rule cannot prove is refused


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share memory (``expand``, stride 0), or that cannot be ruled out."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    extent = 1  # elements spanned by the dims seen so far
    for st, sz in dims:
        if st < extent:
            break
        extent += (sz - 1) * st
    else:
        return False  # each stride clears everything the smaller ones reach: no overlap
    if t.numel() > _EXACT_OVERLAP_MAX:
        return True
    offs = torch.zeros(1, dtype=torch.int64)
    for st, sz in dims:
        offs = (offs[:, None] + torch.arange(sz, dtype=torch.int64) * st).reshape(-1)
    return int(torch.unique(offs).numel()) != t.numel()


def refuse_overlap(t: torch.Tensor, what: str) -> None:
    """DestinationError for a destination whose elements share memory (nothing is written)."""
    if overlaps_itself(t):
        raise DestinationError(f"{what} overlaps itself (shape {tuple(t.shape)}, strides {tuple(t.stride())}: "
                               "an expand()ed or stride-0 view); restore into a tensor with distinct elements, "
                               "e.g. torch.empty(shape) or .clone()")


Copy = Callable[[torch.Tensor, torch.Tensor], None]


def _sync_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _xfer(c: torch.Tensor, a: int, b: int, buf: torch.Tensor, into_tensor: bool, copy: Copy) -> None:
    """Copy bytes [a, b) of ``c``'s C-order serialisation to (or, into_tensor, from) ``buf``.

    ``buf`` is a 1-D uint8 tensor of ``b - a`` bytes (host or device). Whole leading-axis rows go
    in one strided copy; a partial row at either end recurses into that row. No host temporaries;
    a strided copy between host and a CUDA tensor makes torch allocate a device temporary of up to
    the copied size (``buf``'s, i.e. at most one staging half).
    """
    if a >= b:
        return
    if c.dim() == 0 or c.is_contiguous():
        flat = flat_bytes(c)[a:b]
        if into_tensor:
            copy(flat, buf)
        else:
            copy(buf, flat)
        return
    rb = (c.numel() // c.shape[0]) * c.element_size()
    r0 = a // rb
    pos = a
    if a % rb:
        end = min(b, (r0 + 1) * rb)
        _xfer(c[r0], a - r0 * rb, end - r0 * rb, buf[pos - a:end - a], into_tensor, copy)
        pos, r0 = end, r0 + 1
    r1 = b // rb
    if r1 > r0:
        seg = buf[pos - a:r1 * rb - a].view(c.dtype).view(r1 - r0, *c.shape[1:])
        if into_tensor:
            copy(c[r0:r1], seg)
        else:
            copy(seg, c[r0:r1])
        pos = r1 * rb
    if pos < b:
        _xfer(c[r1], 0, b - pos, buf[pos - a:], into_tensor, copy)


def _host_u8(mv: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor aliasing a (possibly read-only) memoryview; nothing is written through it
    when it is read-only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer" for read-only sources
        return torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)


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

    def __init__(self, nbytes: int | None = None, *, pin: bool | None = None, backend: Any = None):
        if nbytes is None:
            env = os.environ.get("SNAPSTORE_STAGING_MIB")
            nbytes = int(env) * MIB if env else DEFAULT_STAGING_BYTES
        if nbytes < 2 * ALIGN:
            raise ConfigError(f"staging buffer must be at least 8 KiB, got {nbytes}")
        self.half = nbytes // 2 // ALIGN * ALIGN
        self.nbytes = 2 * self.half
        self.backend = backend if backend is not None else CUDA
        self.pin = self.backend.available() if pin is None else pin
        self._buf: torch.Tensor | None = None
        self._events: list[Any] = [None, None]
        self._streams: dict[Any, Any] = {}  # device -> side stream
        self._next = 0
        # (source object, offset, length, half): a device->host copy queued ahead of the read that
        # wants it. Keyed on the object itself (held), never on id(), and dropped by synchronize().
        self._prefetch: tuple[Any, int, int, int] | None = None
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

    def stream(self, device: torch.device) -> Any:
        """The side stream transfers to/from ``device`` run on (one per device)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = self.backend.new_stream(device)
        return s

    def transfer(self, h: int, device: torch.device, wait_for: Any, queue: Callable[[], None]) -> None:
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

    def take_prefetch(self, owner: Any, offset: int, n: int) -> int | None:
        """The half holding ``owner``'s bytes [offset, offset + n) if they were prefetched; the
        prefetch is consumed (or discarded) either way."""
        pf, self._prefetch = self._prefetch, None
        if pf is not None and pf[0] is owner and pf[1] == offset and pf[2] >= n:
            return pf[3]
        return None

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


_SHARED: weakref.WeakKeyDictionary[Any, Staging] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_staging(backend: Any = None) -> Staging:
    """The process-wide Staging that device sources/sinks made with ``staging=None`` share (one
    pinned buffer per backend, instead of one per part)."""
    be = backend if backend is not None else CUDA
    with _SHARED_LOCK:
        st = _SHARED.get(be)
        if st is None:
            st = _SHARED[be] = Staging(backend=be)
        return st


def _backend_of(staging: Staging | None, backend: Any) -> Any:
    return staging.backend if staging is not None else (backend if backend is not None else CUDA)


def _source_error(e: Exception) -> SourceError:
    return SourceError(f"reading the tensor failed on the device ({type(e).__name__}: {e}); the engine's state "
                       "could not be read and nothing was saved")


def _device_error(e: Exception, what: str) -> RestoreError:
    return RestoreError(f"{what} failed on the device ({type(e).__name__}: {e}); the destination was partly "
                        "written: re-read the prompt", touched=True)


class TensorSource:
    """A save source (core ``PartReader``) over a tensor on any device, in canonical byte order.

    token_dim: the tensor's token axis (stored outermost). pad_rows: serialise this many leading
    rows, the ones past the tensor's end reading as zero bytes (a fixed-capacity window that is not
    full yet). Device tensors are copied through ``staging`` (default: the shared one). limit: how
    many canonical bytes this save reads (the adapter passes rows x row bytes): the next range is
    prefetched while the core hashes the current one, never past ``limit``; without it nothing is
    prefetched beyond the current read, so a source reused for another save never serves bytes
    copied before the engine wrote them. stream: the engine's stream to wait for (default: the
    current stream, at every read).
    """

    def __init__(self, tensor: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None,
                 pad_rows: int | None = None, *, limit: int | None = None, stream: Any = None,
                 backend: Any = None):
        refuse_lazy(tensor, LayoutError, "the tensor")
        self.tensor = tensor
        self.c = _bits(canonical(tensor, token_dim))
        self.data_bytes = self.c.numel() * self.c.element_size()
        if pad_rows is not None:
            if self.c.dim() == 0 or pad_rows < self.c.shape[0]:
                raise LayoutError(f"pad_rows={pad_rows} is less than the tensor's {self.c.shape[0]} rows")
            rb = (math.prod(self.c.shape[1:])) * self.c.element_size()
            self.nbytes = pad_rows * rb
        else:
            self.nbytes = self.data_bytes
        be = _backend_of(staging, backend)
        self.cuda = be.is_device(tensor)
        self.staging = staging if staging is not None else (shared_staging(be) if self.cuda else None)
        self.limit = None if limit is None else min(limit, self.data_bytes)
        self.stream = stream
        self._lent: dict[int, int] = {}  # offset of a view lent to the core -> its staging half

    def _d2h(self, a: int, b: int, h: int) -> None:
        st = self.staging
        assert st is not None
        st.transfer(h, self.c.device, self.stream,
                    functools.partial(_xfer, self.c, a, b, st.half_view(h, b - a), False, st.backend.copy))

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with canonical bytes [offset, offset + len(out))."""
        end = offset + len(out)
        if end > self.nbytes or offset < 0:
            raise ValueError(f"range [{offset}, {end}) outside the source's {self.nbytes} bytes")
        data_end = min(end, self.data_bytes)
        if data_end < end:  # the zero padding past the tensor's rows
            zstart = max(offset, self.data_bytes) - offset
            np.frombuffer(out, dtype=np.uint8)[zstart:] = 0
        if offset >= data_end:
            return
        dst = _host_u8(out)[:data_end - offset]
        if not self.cuda:
            _xfer(self.c, offset, data_end, dst, False, _sync_copy)
            return
        st = self.staging
        assert st is not None
        with st.lock:
            try:
                pos = offset
                while pos < data_end:
                    n = min(st.half, data_end - pos)
                    h = self._fetch(pos, n, data_end, st)
                    st.backend.host_copy(dst[pos - offset:pos - offset + n], st.half_view(h, n))
                    pos += n
            except BaseException as e:
                st.drain()  # nothing queued before the error may land later
                if isinstance(e, Exception) and not isinstance(e, SnapstoreError):
                    raise _source_error(e) from e
                raise

    def _fetch(self, pos: int, n: int, data_end: int, st: Staging) -> int:
        """The half holding bytes [pos, pos + n) once they are copied; the next range is queued
        into the other half meanwhile (never past ``limit``)."""
        pf_end = self.limit if self.limit is not None else data_end
        h = st.take_prefetch(self, pos, n)
        if h is None:
            h = st.flip()
            self._d2h(pos, pos + n, h)
        # queue the next range into the other half: it copies while the core hashes this one
        nxt = min(pf_end - (pos + n), st.half, n)
        if nxt > 0:
            h2 = h ^ 1
            st.wait_half(h2)
            self._d2h(pos + n, pos + n + nxt, h2)
            st._prefetch = (self, pos + n, nxt, h2)
            st._next = h
        st.wait_half(h)
        return h

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        """Core reader hook: canonical bytes [offset, offset + nbytes) as a view of the staging half
        their device-to-host copy landed in, lent until :meth:`release` (no host memcpy); None when
        the range does not fit a half or is not all on the device (then ``read_into`` copies it)."""
        st = self.staging
        if (not self.cuda or st is None or nbytes <= 0 or nbytes > st.half or offset < 0
                or offset + nbytes > self.data_bytes):
            return None
        with st.lock:
            try:
                h = self._fetch(offset, nbytes, offset + nbytes, st)
                half = st.half_view(h, nbytes)
                st.backend.lend(half, False)
                st.lend(h)
            except BaseException as e:
                st.drain()
                if isinstance(e, Exception) and not isinstance(e, SnapstoreError):
                    raise _source_error(e) from e
                raise
        self._lent[offset] = h
        return half.numpy().data.toreadonly()

    def release(self, offset: int, nbytes: int) -> None:
        """Core reader hook: the view of [offset, offset + nbytes) is no longer used (any thread)."""
        h = self._lent.pop(offset, None)
        if h is not None and self.staging is not None:
            self.staging.give_back(h)


class TensorSink:
    """A restore destination (core ``PartWriter``) over a preallocated tensor on any device.

    Bytes arrive in canonical order and land in the tensor's own layout. For device tensors each
    chunk is copied into a half of ``staging`` (default: the shared one) and its host-to-device
    copy is queued on a side stream, after the engine's ``stream`` (default: the current stream, at
    every write); call :meth:`finish` (the adapter does) before using the tensor. A destination
    that overlaps itself or is a lazy conjugate view is refused here, before a byte is written; a
    device error while writing is a ``RestoreError(touched=True)``.
    """

    def __init__(self, tensor: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None, *,
                 stream: Any = None, backend: Any = None):
        refuse_lazy(tensor, DestinationError, "the destination tensor")
        refuse_overlap(tensor, "the destination tensor")
        self.tensor = tensor
        self.c = _bits(canonical(tensor, token_dim))
        self.nbytes = self.c.numel() * self.c.element_size()
        be = _backend_of(staging, backend)
        self.cuda = be.is_device(tensor)
        self.staging = staging if staging is not None else (shared_staging(be) if self.cuda else None)
        self.stream = stream
        self.touched = False  # some bytes were (or may have been) written into the tensor
        self._lent: dict[int, int] = {}  # offset of a buffer lent to the core -> its staging half

    def write_from(self, offset: int, data: memoryview) -> None:
        """Write canonical bytes [offset, offset + len(data))."""
        end = offset + len(data)
        if end > self.nbytes or offset < 0:
            raise ValueError(f"range [{offset}, {end}) outside the destination's {self.nbytes} bytes")
        src = _host_u8(data)
        try:
            if not self.cuda:
                self.touched = True
                _xfer(self.c, offset, end, src, True, _sync_copy)
                return
            st = self.staging
            assert st is not None
            with st.lock:
                try:
                    self._write_device(offset, end, src, st)
                except BaseException:
                    st.drain()  # copies queued before the error land now, not on a later restore
                    raise
        except SnapstoreError:
            raise
        except Exception as e:
            raise _device_error(e, "writing the destination tensor") from e

    def _write_device(self, offset: int, end: int, src: torch.Tensor, st: Staging) -> None:
        be = st.backend
        pos = offset
        while pos < end:
            n = min(st.half, end - pos)
            h = st.flip()  # waits only if this half's previous copy is still in flight
            half = st.half_view(h, n)
            be.host_copy(half, src[pos - offset:pos - offset + n])  # host memcpy into page-locked memory
            self.touched = True
            st.transfer(h, self.c.device, self.stream,
                        functools.partial(_xfer, self.c, pos, pos + n, half, True, be.copy))
            pos += n

    def buffer_for(self, offset: int, nbytes: int) -> memoryview | None:
        """Core writer hook: a staging half for canonical bytes [offset, offset + nbytes), filled by
        the core in place (no host memcpy), then :meth:`commit` or :meth:`discard`; None when the
        range does not fit a half (then ``write_from`` copies it)."""
        st = self.staging
        if (not self.cuda or st is None or nbytes <= 0 or nbytes > st.half or offset < 0
                or offset + nbytes > self.nbytes):
            return None
        try:
            with st.lock:
                h = st.flip()  # waits until this half's previous copy is done
                half = st.half_view(h, nbytes)
                st.backend.lend(half, True)
                st.lend(h)
        except SnapstoreError:
            raise
        except Exception as e:
            raise _device_error(e, "waiting for an earlier copy into the destination tensor") from e
        self._lent[offset] = h
        return half.numpy().data

    def commit(self, offset: int, nbytes: int) -> None:
        """Core writer hook: queue the copy of the lent half's bytes into the tensor."""
        st = self.staging
        h = self._lent.pop(offset)
        assert st is not None
        try:
            with st.lock:
                try:
                    st.give_back(h)  # queued below: its event now guards the half
                    self.touched = True
                    st.transfer(h, self.c.device, self.stream,
                                functools.partial(_xfer, self.c, offset, offset + nbytes, st.half_view(h, nbytes),
                                                  True, st.backend.copy))
                except BaseException:
                    st.drain()  # copies queued before the error land now, not on a later restore
                    raise
        except SnapstoreError:
            raise
        except Exception as e:
            raise _device_error(e, "writing the destination tensor") from e

    def discard(self, offset: int, nbytes: int) -> None:
        """Core writer hook: the lent half's bytes are not to be written (nothing was queued)."""
        h = self._lent.pop(offset, None)
        if h is not None and self.staging is not None:
            self.staging.give_back(h)

    def finish(self) -> None:
        """Wait until every queued copy into the tensor is done; later work on the engine's stream
        is ordered after them."""
        st = self.staging
        if st is None or not self.cuda:
            return
        with st.lock:
            try:
                st.synchronize()
                dev = self.c.device
                (self.stream if self.stream is not None else st.backend.current_stream(dev)).wait_stream(
                    st.stream(dev))
            except SnapstoreError:
                raise
            except Exception as e:
                raise _device_error(e, "finishing the copies into the destination tensor") from e
