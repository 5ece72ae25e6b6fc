"""TorchAdapter: save and restore torch tensors of any layout and device through a Store."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np
import torch

from snapstore import (
    DestinationError,
    Fixed,
    Layout,
    LayoutError,
    RestoreResult,
    Rows,
    SaveHandle,
    SaveResult,
    Store,
)

from ._copy import flat_bytes, refuse_lazy, refuse_overlap
from ._device import CUDA, DeviceBackend, DeviceStream
from ._device_staging import Staging
from ._dtypes import canonical, dtype_name, fixed_spec, rows_spec
from ._tensor_io import TensorSink, TensorSource
from ._types import RowCounts, SnapshotRef, TensorDest, TensorPart, TokenIds

__all__ = ["CoreSink", "CoreSource", "TorchAdapter", "layout_of", "part_sink", "part_source"]

CoreSource = Union[np.ndarray, TensorSource]
"""What the core reads for a tensor: a zero-copy uint8 view, or a ``TensorSource``."""

CoreSink = Union[np.ndarray, TensorSink]
"""What the core writes into for a tensor: a zero-copy uint8 view, or a ``TensorSink``."""


def layout_of(fixed: Mapping[str, torch.Tensor] | None = None,
              rows: Mapping[str, torch.Tensor] | None = None, *,
              token_dims: Mapping[str, int] | None = None,
              components: Mapping[str, str] | None = None) -> Layout:
    """A Layout describing example tensors: ``fixed`` parts whole, ``rows`` streams by their token axis.

    token_dims: name -> token axis of a row stream (default 0); components: name -> component
    (e.g. ``"draft"``) for optional parts.
    """
    td = dict(token_dims or {})
    comp = dict(components or {})
    return Layout(
        fixed={n: fixed_spec(t, td.get(n), component=comp.get(n)) for n, t in (fixed or {}).items()},
        rows={n: rows_spec(t, td.get(n, 0), component=comp.get(n)) for n, t in (rows or {}).items()})


def _check(name: str, t: torch.Tensor, spec: Fixed | Rows, token_dim: int | None, err: type[LayoutError],
           rows: int | None = None, pad_rows: int | None = None) -> None:
    if dtype_name(t.dtype) != spec.dtype:
        raise err(f"part {name!r}: tensor dtype is {dtype_name(t.dtype)}, the layout says {spec.dtype}")
    refuse_lazy(t, err, f"part {name!r}")
    if err is DestinationError:
        refuse_overlap(t, f"part {name!r}: the destination")
    c = canonical(t, token_dim if isinstance(spec, Fixed) else (token_dim or 0))
    if isinstance(spec, Fixed):
        shape = tuple(c.shape)
        if pad_rows is not None and shape:
            shape = (pad_rows, *shape[1:])
        if shape != spec.shape:
            raise err(f"part {name!r}: canonical shape is {shape}, the layout says {spec.shape}")
    else:
        if tuple(c.shape[1:]) != spec.row_shape:
            raise err(f"part {name!r}: row shape (token axis {token_dim or 0} moved outermost) is "
                      f"{tuple(c.shape[1:])}, the layout says {spec.row_shape}")
        if rows is not None and c.shape[0] < rows:
            raise err(f"part {name!r}: tensor holds {c.shape[0]} rows, {rows} are needed")


def _is_device(t: torch.Tensor, staging: Staging | None, backend: DeviceBackend | None) -> bool:
    return bool((staging.backend if staging is not None else (backend or CUDA)).is_device(t))


def part_source(t: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None,
                pad_rows: int | None = None, *, limit: int | None = None, stream: DeviceStream | None = None,
                backend: DeviceBackend | None = None) -> CoreSource:
    """What the core should read for a tensor: a zero-copy numpy uint8 view when the tensor is on
    the CPU, canonical and contiguous; else a :class:`TensorSource` (strided / device copy).
    limit / stream / backend: see :class:`TensorSource`."""
    refuse_lazy(t, LayoutError, "the tensor")
    c = canonical(t, token_dim)
    if (not _is_device(t, staging, backend) and t.device.type == "cpu" and pad_rows is None
            and (c.dim() == 0 or c.is_contiguous())):
        return flat_bytes(c).numpy()
    return TensorSource(t, token_dim, staging, pad_rows=pad_rows, limit=limit, stream=stream, backend=backend)


def part_sink(t: torch.Tensor, token_dim: int | None = None, staging: Staging | None = None, *,
              stream: DeviceStream | None = None, backend: DeviceBackend | None = None) -> CoreSink:
    """What the core should write into for a destination tensor: a zero-copy numpy uint8 view
    when possible, else a :class:`TensorSink` (call ``finish()`` after the restore)."""
    refuse_lazy(t, DestinationError, "the destination tensor")
    c = canonical(t, token_dim)
    if not _is_device(t, staging, backend) and t.device.type == "cpu" and (c.dim() == 0 or c.is_contiguous()):
        return flat_bytes(c).numpy()
    return TensorSink(t, token_dim, staging, stream=stream, backend=backend)


class TorchAdapter:
    """Save / restore torch tensors through ``store`` with one bounded staging buffer.

    token_dims: part name -> token axis of that tensor (row streams; default 0). A fixed part
    listed here is stored with that axis outermost too. staging: a :class:`Staging` to share, or
    its size in bytes (default 64 MiB, ``SNAPSTORE_STAGING_MIB``); only device tensors use it.
    backend: the device seam (default ``torch.cuda``; tests pass a stream model), for a new Staging.
    """

    def __init__(self, store: Store, *, token_dims: Mapping[str, int] | None = None,
                 staging: Staging | int | None = None, backend: DeviceBackend | None = None):
        self.store = store
        self.layout = store.layout
        self.token_dims = dict(token_dims or {})
        self.staging = staging if isinstance(staging, Staging) else Staging(staging, backend=backend)

    def _td(self, name: str, token_dims: Mapping[str, int] | None) -> int | None:
        if token_dims and name in token_dims:
            return token_dims[name]
        if name in self.token_dims:
            return self.token_dims[name]
        return 0 if name in self.layout.rows else None

    def sources(self, tensors: Mapping[str, TensorPart], rows: RowCounts = None, n_tokens: int | None = None,
                token_dims: Mapping[str, int] | None = None,
                pad_rows: Mapping[str, int] | None = None, *,
                stream: DeviceStream | None = None) -> dict[str, TensorPart | CoreSource]:
        """Check tensors against the layout and wrap each for the core (zero-copy where possible).

        Each device source is told how many bytes the save reads (rows x row bytes; a fixed part
        whole), so its prefetch never runs past them. stream: see :meth:`save`.
        """
        specs = self.layout.parts
        out: dict[str, TensorPart | CoreSource] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                out[name] = t  # numpy / memoryview / PartReader: the core checks it
                continue
            spec = specs.get(name)
            if spec is None:
                raise LayoutError(f"part {name!r} is not in the layout; layout parts are {sorted(specs)}")
            td = self._td(name, token_dims)
            need: int | None = None
            if isinstance(spec, Rows):
                need = rows.get(name, n_tokens) if isinstance(rows, Mapping) else (rows if rows is not None
                                                                                    else n_tokens)
                limit = None if need is None else need * spec.row_bytes
            else:
                limit = spec.nbytes
            pr = (pad_rows or {}).get(name)
            _check(name, t, spec, td, LayoutError, need, pr)
            out[name] = part_source(t, td, self.staging, pad_rows=pr, limit=limit, stream=stream)
        return out

    def save(self, tokens: TokenIds, tensors: Mapping[str, TensorPart], rows: RowCounts = None, *,
             token_dims: Mapping[str, int] | None = None, pad_rows: Mapping[str, int] | None = None,
             stream: DeviceStream | None = None, **kwargs: Any) -> SaveResult:
        """``store.save`` for tensors: same arguments (session, parent, commit, namespace).
        For ``wait=False`` use :meth:`save_async`.

        stream: the stream the engine's kernels that wrote the state ran on, when it is not the
        current stream here (an engine whose forward runs on its own stream): every device copy
        waits for the work queued on it. Everything is copied out before this returns (the chunk
        files are durable), so the engine may overwrite its state right after — but not during the call.
        """
        n = len(tokens)
        parts = self.sources(tensors, rows, n, token_dims, pad_rows, stream=stream)
        with self.staging.lock:
            try:
                res: SaveResult = self.store.save(tokens, parts, rows, **kwargs)
            except BaseException:
                self.staging.drain()
                raise
            self.staging.synchronize()  # also ends any prefetch: nothing carries over to the next save
            return res

    def save_async(self, tokens: TokenIds, tensors: Mapping[str, TensorPart], rows: RowCounts = None, *,
                   token_dims: Mapping[str, int] | None = None, pad_rows: Mapping[str, int] | None = None,
                   stream: DeviceStream | None = None, **kwargs: Any) -> SaveHandle:
        """``store.save(..., wait=False)`` for tensors: returns a SaveHandle once every device tensor
        (and every fixed part) has been copied to host memory; the disk write happens after.

        Host CPU row streams are read in place later (rows below a boundary never change): do not
        overwrite rows ``[0, n)`` of a CPU arena until the handle is done. Device tensors may be
        overwritten as soon as this returns.
        """
        n = len(tokens)
        parts = self.sources(tensors, rows, n, token_dims, pad_rows, stream=stream)
        with self.staging.lock:
            try:
                handle: SaveHandle = self.store.save(tokens, parts, rows, wait=False, **kwargs)
            except BaseException:
                self.staging.drain()
                raise
            self.staging.synchronize()  # the device->host copies are complete before the engine moves on
            return handle

    def sinks(self, into: Mapping[str, TensorDest], token_dims: Mapping[str, int] | None = None, *,
              stream: DeviceStream | None = None) -> dict[str, TensorDest | CoreSink]:
        """Check destination tensors (dtype, canonical shape, no self-overlap) and wrap each for the core."""
        specs = self.layout.parts
        out: dict[str, TensorDest | CoreSink] = {}
        for name, t in into.items():
            if not isinstance(t, torch.Tensor):
                out[name] = t
                continue
            spec = specs.get(name)
            if spec is None:
                raise DestinationError(f"part {name!r} is not in the layout; layout parts are {sorted(specs)}")
            td = self._td(name, token_dims)
            _check(name, t, spec, td, DestinationError)
            out[name] = part_sink(t, td, self.staging, stream=stream)
        return out

    def restore(self, match: SnapshotRef, into: Mapping[str, TensorDest], components: Iterable[str] | None = None, *,
                token_dims: Mapping[str, int] | None = None, stream: DeviceStream | None = None,
                session: str | None = None) -> RestoreResult:
        """``store.restore`` into preallocated tensors (any device, any layout of the token axis).

        Destinations are checked before anything is written; on a RestoreError, ``.touched`` says
        whether any tensor was modified (re-read the prompt if so); a device error while streaming
        is one too. stream: the engine's stream, when it is not the current one: the copies wait for
        the work queued on it (e.g. a ``zero_()``), and its later work is ordered after them.
        session: the caller's session key, as for ``Store.restore``.
        """
        sinks = self.sinks(into, token_dims, stream=stream)
        with self.staging.lock:
            try:
                res = self.store.restore(match, into=sinks, components=components, session=session)
            except BaseException:
                with contextlib.suppress(Exception):  # the error being raised is the one that matters
                    self._finish(sinks)
                raise
            self._finish(sinks)
            return res

    def _finish(self, sinks: Mapping[str, TensorDest | CoreSink]) -> None:
        for s in sinks.values():
            if isinstance(s, TensorSink):
                s.finish()
        self.staging.synchronize()

    def close(self) -> None:
        """Release the staging buffer (the store stays open); waits for a save/restore in flight."""
        self.staging.release()
