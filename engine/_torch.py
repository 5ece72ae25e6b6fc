"""torch tensors as snapstore parts: dtype names, canonical byte order, and the staging buffer.

A part is stored canonically: C-order bytes with the token axis outermost. A torch tensor whose
token axis is elsewhere (``[batch, heads, tokens, head_dim]``), or that is a non-contiguous view,
or that lives on a GPU, is read and written through :class:`TensorSource` / :class:`TensorSink`,
which implement the core's ``PartReader`` / ``PartWriter`` protocols by copying byte ranges of the
canonical order. A CPU tensor that is already canonical and contiguous is handed to the core as a
zero-copy numpy ``uint8`` view instead (no copy at all on save or restore).

Device tensors go through :class:`Staging`: one reusable host buffer (page-locked when CUDA is
available), split in two halves. On restore, chunk *k* is copied into one half and its
host-to-device copy is queued on a side CUDA stream; the core then reads/decompresses chunk *k+1*
into its own slot while that copy runs, and only waits when it comes back to the same half. On
save, the device-to-host copy of the next range is queued into the other half while the core
hashes and writes the current one.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from snapstore import Fixed, LayoutError, Rows
from snapstore._layout import DTYPE_SIZES

from ._device import CUDA

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Staging",
    "TensorSink",
    "TensorSource",
    "canonical",
    "dtype_name",
    "fixed_spec",
    "rows_spec",
    "torch_dtype",
]

MIB = 1 << 20
DEFAULT_STAGING_BYTES = 64 * MIB

_BY_NAME: dict[str, torch.dtype] = {}
for _name in DTYPE_SIZES:
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


Copy = Callable[[torch.Tensor, torch.Tensor], None]


def _sync_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _xfer(c: torch.Tensor, a: int, b: int, buf: torch.Tensor, into_tensor: bool, copy: Copy) -> None:
    """Copy bytes [a, b) of ``c``'s C-order serialisation to (or, into_tensor, from) ``buf``.

    ``buf`` is a 1-D uint8 tensor of ``b - a`` bytes (host or device). Whole leading-axis rows go
    in one strided copy; a partial row at either end recurses into that row. No temporaries.
    """
    if a >= b:
        return
    if c.dim() == 0 or c.is_contiguous():
        flat = c.reshape(-1).view(torch.uint8)[a:b]
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


class Staging:
    """One reusable host buffer in two halves (page-locked when CUDA is available).

    nbytes: total size (``SNAPSTORE_STAGING_MIB``, default 64 MiB); allocated on first use, only
    for device tensors (CPU tensors never need it). One Staging serves any number of parts; save
    and restore use it from the calling thread, one chunk at a time.
    """

    def __init__(self, nbytes: int | None = None, *, pin: bool | None = None, backend: Any = None):
        if nbytes is None:
            env = os.environ.get("SNAPSTORE_STAGING_MIB")
            nbytes = int(env) * MIB if env else DEFAULT_STAGING_BYTES
        if nbytes < 2 * 4096:
            raise ValueError(f"staging buffer must be at least 8 KiB, got {nbytes}")
        self.nbytes = nbytes - nbytes % 2
        self.half = self.nbytes // 2
        self.backend = backend if backend is not None else CUDA
        self.pin = self.backend.available() if pin is None else pin
        self._buf: torch.Tensor | None = None
        self._events: list[Any] = [None, None]
        self._stream: Any = None
        self._next = 0
        self._prefetch: tuple[int, int, int, int] | None = None  # (source id, offset, length, half)
        self.lock = threading.RLock()

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
        """The side CUDA stream transfers run on (one per Staging)."""
        if self._stream is None or self._stream.device != device:
            self._stream = self.backend.new_stream(device)
        return self._stream

    def wait_half(self, h: int) -> None:
        """Block until the transfer last queued on half ``h`` is done."""
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

    def synchronize(self) -> None:
        """Wait for every queued transfer."""
        for h in (0, 1):
            self.wait_half(h)
        self._prefetch = None

    def release(self) -> None:
        """Drop the host buffer (it is allocated again on next use)."""
        self.synchronize()
        self._buf = None


class TensorSource:
    """A save source (core ``PartReader``) over a tensor on any device, in canonical byte order.

    token_dim: the tensor's token axis (stored outermost). pad_rows: serialise this many leading
    rows, the ones past the tensor's end reading as zero bytes (a fixed-capacity window that is not
    full yet). CUDA tensors are copied through ``staging`` with the next range prefetched.
    """

    def __init__(self, tensor: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None,
                 pad_rows: int | None = None):
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
        backend = staging.backend if staging is not None else CUDA
        self.cuda = backend.is_device(tensor)
        self.staging = staging if staging is not None else (Staging(backend=backend) if self.cuda else None)
        self._synced = False

    def _d2h(self, a: int, b: int, h: int) -> None:
        st = self.staging
        assert st is not None
        be = st.backend
        stream = st.stream(self.c.device)
        if not self._synced:  # the tensor may still be being written on the compute stream
            stream.wait_stream(be.current_stream(self.c.device))
            self._synced = True
        with be.use(stream):
            _xfer(self.c, a, b, st.half_view(h, b - a), False, be.copy)
            ev = be.event()
            ev.record(stream)
        st._events[h] = ev

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
            pos = offset
            while pos < data_end:
                n = min(st.half, data_end - pos)
                pf = st._prefetch
                if pf is not None and pf[0] == id(self) and pf[1] == pos and pf[2] >= n:
                    h = pf[3]
                else:
                    st.synchronize()
                    h = st.flip()
                    self._d2h(pos, pos + n, h)
                st._prefetch = None
                st.wait_half(h)
                st.backend.host_copy(dst[pos - offset:pos - offset + n], st.half_view(h, n))
                pos += n
                # queue the next range into the other half while the core hashes and writes this one
                nxt = min(self.data_bytes - pos, st.half, n)
                if nxt > 0:
                    h2 = h ^ 1
                    st.wait_half(h2)
                    self._d2h(pos, pos + nxt, h2)
                    st._prefetch = (id(self), pos, nxt, h2)
                    st._next = h2 ^ 1


class TensorSink:
    """A restore destination (core ``PartWriter``) over a preallocated tensor on any device.

    Bytes arrive in canonical order and land in the tensor's own layout. For CUDA tensors each
    chunk is copied into a half of ``staging`` and its host-to-device copy is queued on a side
    stream; call :meth:`finish` (the adapter does) before using the tensor.
    """

    def __init__(self, tensor: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None):
        self.tensor = tensor
        self.c = _bits(canonical(tensor, token_dim))
        self.nbytes = self.c.numel() * self.c.element_size()
        backend = staging.backend if staging is not None else CUDA
        self.cuda = backend.is_device(tensor)
        self.staging = staging if staging is not None else (Staging(backend=backend) if self.cuda else None)
        self._synced = False

    def write_from(self, offset: int, data: memoryview) -> None:
        """Write canonical bytes [offset, offset + len(data))."""
        end = offset + len(data)
        if end > self.nbytes or offset < 0:
            raise ValueError(f"range [{offset}, {end}) outside the destination's {self.nbytes} bytes")
        src = _host_u8(data)
        if not self.cuda:
            _xfer(self.c, offset, end, src, True, _sync_copy)
            return
        st = self.staging
        assert st is not None
        be = st.backend
        stream = st.stream(self.c.device)
        with st.lock:
            if not self._synced:  # the destination was allocated/zeroed on the compute stream
                stream.wait_stream(be.current_stream(self.c.device))
                self._synced = True
            pos = offset
            while pos < end:
                n = min(st.half, end - pos)
                h = st.flip()  # waits only if this half's previous copy is still in flight
                half = st.half_view(h, n)
                be.host_copy(half, src[pos - offset:pos - offset + n])  # host memcpy into page-locked memory
                with be.use(stream):
                    _xfer(self.c, pos, pos + n, half, True, be.copy)
                    ev = be.event()
                    ev.record(stream)
                st._events[h] = ev
                pos += n

    def finish(self) -> None:
        """Wait until every queued copy into the tensor is done."""
        if self.staging is not None and self.cuda:
            with self.staging.lock:
                self.staging.synchronize()
                self.staging.backend.current_stream(self.c.device).wait_stream(self.staging.stream(self.c.device))
