"""torch tensors as the core's part readers and writers: :class:`TensorSource` (save), :class:`TensorSink` (restore).

A tensor whose token axis is not outermost, that is a non-contiguous view, or that lives on a GPU
is read and written through these classes, which implement the core's ``PartReader`` /
``PartWriter`` protocols by copying byte ranges of the canonical order (``engine._copy``). Device
tensors move through a :class:`~snapstore.engine.Staging` (``engine._staging``): a source lends
the core the half its device-to-host copy landed in (``view`` / ``release``), a sink lends the half
the core fills in place (``buffer_for`` / ``commit`` / ``discard``). A chunk larger than a half
goes through ``read_into`` / ``write_from`` and the core's own slot instead (one host memcpy more).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from snapstore import DestinationError, LayoutError, RestoreError, SnapstoreError, SourceError

from ._copy import copy_range, host_u8, refuse_lazy, refuse_overlap, same_width, sync_copy
from ._device import DeviceBackend, DeviceStream
from ._device_staging import Staging, backend_of, shared_staging
from ._dtypes import canonical

__all__ = ["TensorSink", "TensorSource"]


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

    _snapstore_fills_out = True  # read_into writes every byte of out or raises (snapstore.parts.buffers.FILLS_OUT)

    def __init__(self, tensor: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None,
                 pad_rows: int | None = None, *, limit: int | None = None, stream: DeviceStream | None = None,
                 backend: DeviceBackend | None = None):
        refuse_lazy(tensor, LayoutError, "the tensor")
        self.tensor = tensor
        self.c = same_width(canonical(tensor, token_dim))
        self.data_bytes = self.c.numel() * self.c.element_size()
        if pad_rows is not None:
            if self.c.dim() == 0 or pad_rows < self.c.shape[0]:
                raise LayoutError(f"pad_rows={pad_rows} is less than the tensor's {self.c.shape[0]} rows")
            rb = (math.prod(self.c.shape[1:])) * self.c.element_size()
            self.nbytes = pad_rows * rb
        else:
            self.nbytes = self.data_bytes
        be = backend_of(staging, backend)
        self.cuda = be.is_device(tensor)
        self.staging = staging if staging is not None else (shared_staging(be) if self.cuda else None)
        self.limit = None if limit is None else min(limit, self.data_bytes)
        self.stream = stream
        self._lent: dict[int, int] = {}  # offset of a view lent to the core -> its staging half

    def _d2h(self, a: int, b: int, h: int) -> None:
        st = self.staging
        assert st is not None
        st.transfer(h, self.c.device, self.stream,
                    functools.partial(copy_range, self.c, a, b, st.half_view(h, b - a), False, st.backend.copy))

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
        dst = host_u8(out)[:data_end - offset]
        if not self.cuda:
            copy_range(self.c, offset, data_end, dst, False, sync_copy)
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
            st.put_prefetch(self, pos + n, nxt, h2)
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
                 stream: DeviceStream | None = None, backend: DeviceBackend | None = None):
        refuse_lazy(tensor, DestinationError, "the destination tensor")
        refuse_overlap(tensor, "the destination tensor")
        self.tensor = tensor
        self.c = same_width(canonical(tensor, token_dim))
        self.nbytes = self.c.numel() * self.c.element_size()
        be = backend_of(staging, backend)
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
        src = host_u8(data)
        try:
            if not self.cuda:
                self.touched = True
                copy_range(self.c, offset, end, src, True, sync_copy)
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
                        functools.partial(copy_range, self.c, pos, pos + n, half, True, be.copy))
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
                                functools.partial(copy_range, self.c, offset, offset + nbytes, st.half_view(h, nbytes),
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
