"""The pages of a multi-group vLLM cache as snapstore parts' bytes (no vLLM import).

vLLM's hybrid allocator backs every group with shared raw buffers: a layer's cache is a view
``[num_blocks, ...]`` whose blocks may sit further apart than their contents (a Mamba page padded
to the attention page, or the reverse), and a Mamba layer's cache is a list of views (conv state,
SSM state). :func:`page_views` turns each such view into a ``(num_blocks, page_bytes)`` uint8
numpy view of the same memory (writes land in vLLM's cache); a part (one KV cache group) is the
list of its layers' views in order, and one block of the part is their pages concatenated
(``(layers, unit_bytes)`` in the store). :func:`gather_pages` copies named blocks out (a save reads
the copy later, off the forward pass); :class:`PageWriter` scatters restored bytes back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import snapstore as ss

from ._groups import GroupPart

__all__ = ["PageWriter", "gather_pages", "group_views", "page_views"]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one contiguous byte range (its dims in some order, without gaps)."""
    expect = 1
    for size, stride in sorted(((int(s), int(st)) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda p: p[1]):
        if stride != expect:
            return False
        expect *= size
    return True


def page_views(t: torch.Tensor) -> np.ndarray:
    """``t`` (``[num_blocks, ...]`` on the CPU, each block one dense byte range) as a
    ``(num_blocks, page_bytes)`` uint8 numpy view of the same memory: the page of block ``i`` is
    the bytes of ``t[i]`` as they lie in memory (opaque: the identity names the layout)."""
    if t.device.type != "cpu":
        raise ss.LayoutError(f"a vLLM cache tensor is on {t.device}: the connector copies host memory only")
    if t.dim() < 2 or not _dense(t[0]) or any(int(s) < 0 for s in t.stride()):
        raise ss.LayoutError(f"a vLLM cache tensor {tuple(t.shape)} (strides {t.stride()}) does not keep each block "
                             "in one dense byte range")
    item = t.element_size()
    page = t[0].numel() * item
    # the storage as bytes; block i starts at its lowest element (every stride is positive)
    raw = torch.empty(0, dtype=torch.uint8).set_(t.detach().untyped_storage())
    view = torch.as_strided(raw, (int(t.shape[0]), page), (int(t.stride(0)) * item, 1), t.storage_offset() * item)
    return view.numpy()


def group_views(part: GroupPart, kv_caches: Mapping[str, Any]) -> list[np.ndarray]:
    """The page views of ``part``'s layers in order (a Mamba layer: each of its state tensors),
    checked against the part's unit bytes: ``ss.LayoutError`` when vLLM's tensors are not what
    the identity says."""
    out: list[np.ndarray] = []
    for name in part.layers:
        if name not in kv_caches:
            raise ss.LayoutError(f"vLLM registered no cache tensor for layer {name!r} of KV cache group {part.group}")
        cache = kv_caches[name]
        tensors = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        views = [page_views(t) for t in tensors]
        got = sum(v.shape[1] for v in views)
        if got != part.unit_bytes:
            raise ss.LayoutError(f"layer {name!r} of KV cache group {part.group} holds {got} bytes per block, the "
                                 f"group's spec says {part.unit_bytes}")
        out.extend(views)
    return out


def gather_pages(views: Sequence[np.ndarray], block_ids: Sequence[int], layers: int) -> np.ndarray:
    """A private copy ``(len(block_ids), layers, unit_bytes)`` of the named blocks of a part."""
    ids = np.asarray(block_ids, dtype=np.int64)
    total = sum(v.shape[1] for v in views)
    out = np.empty((len(ids), total), dtype=np.uint8)
    off = 0
    for v in views:
        w = v.shape[1]
        out[:, off:off + w] = v[ids]
        off += w
    return out.reshape(len(ids), layers, total // layers)


class PageWriter:
    """A snapstore ``PartWriter`` for one part: canonical bytes (block-major, then the part's
    views in order) scattered into blocks ``block_ids``. Ranges may start or end anywhere. A
    block id below 0 drops its bytes (a window block vLLM's own prefix cache already holds:
    shared with other requests, never written)."""

    def __init__(self, views: Sequence[np.ndarray], block_ids: Sequence[int]):
        self._views = list(views)
        self._ids = [int(b) for b in block_ids]
        self._starts = np.cumsum([0] + [v.shape[1] for v in self._views]).tolist()
        self._row = int(self._starts[-1])
        self.nbytes = len(self._ids) * self._row

    def write_from(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at byte ``offset`` of the part's canonical bytes."""
        src = np.frombuffer(data, dtype=np.uint8)
        if offset < 0 or offset + len(src) > self.nbytes:
            raise ss.InvalidInputError(f"bytes [{offset}, {offset + len(src)}) are outside {self.nbytes}")
        pos = 0
        while pos < len(src):
            row, within = divmod(offset + pos, self._row)
            seg = int(np.searchsorted(self._starts, within, side="right")) - 1
            at = within - self._starts[seg]
            take = min(self._starts[seg + 1] - within, len(src) - pos)
            if self._ids[row] >= 0:
                self._views[seg][self._ids[row], at:at + take] = src[pos:pos + take]
            pos += take
