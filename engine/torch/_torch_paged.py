"""Paged K/V in torch: one sequence's rows in a block pool on any device, gathered and scattered there.

The torch twin of :class:`snapstore.PagedRows`. A restore's chunk goes to the pool's device in
one copy and lands in the sequence's blocks with one ``index_put_`` (a scatter on the device); a
save gathers the blocks with one indexing kernel and copies the result to the host range the
store asked for. Rows cut by a chunk edge (:func:`snapstore.row_span`) are patched through that row's own tensor
(``engine._copy.copy_range``).
Every copy is a same-width integer view, so bf16 / fp8 move bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from snapstore import InvalidInputError, LayoutError, PagedRows, RowSpan, row_span

from ._copy import copy_range, flat_bytes, host_u8, same_width, sync_copy
from ._dtypes import dtype_name


def _dtype_or_none(dtype: torch.dtype) -> str | None:
    """The core's name of a pool's dtype, or None for one it has no name for (then only sizes are checked)."""
    try:
        return dtype_name(dtype)
    except LayoutError:
        return None

__all__ = ["TorchPagedRows"]


class TorchPagedRows:
    """A ``PartReader`` / ``PartWriter`` over ``(pool, block_table, axes)`` of a torch pool.

    ``axes = (block_axis, token_axis)``; the other axes, in order, are the row shape (e.g. a
    vLLM-style ``(2, n_blocks, block_size, heads, dim)`` pool has ``axes=(1, 2)``).
    """

    _snapstore_fills_out = True  # read_into writes every byte of out or raises (snapstore.parts.buffers.FILLS_OUT)

    def __init__(self, pool: torch.Tensor, block_table: Sequence[int] | np.ndarray | torch.Tensor,
                 axes: Sequence[int] = (0, 1)):
        if not isinstance(pool, torch.Tensor):
            raise InvalidInputError(f"pool must be a torch tensor, got {type(pool).__name__} "
                                    "(numpy pools: snapstore.PagedRows)")
        b_ax, t_ax = PagedRows.pool_axes(pool.dim(), axes)  # the one reading of axes, numpy PagedRows' too
        # what the core checks against the layout's stream before a byte moves (as snapstore.PagedRows reports it)
        self.axes, self.pool_shape = (b_ax, t_ax), tuple(int(d) for d in pool.shape)
        self.dtype = _dtype_or_none(pool.dtype)
        self._pool = same_width(pool.detach().movedim((b_ax, t_ax), (0, 1)))  # a view: writes land in the pool
        self.device = pool.device
        table = torch.as_tensor(PagedRows.block_indices(block_table) if not isinstance(block_table, torch.Tensor)
                                else block_table)
        if table.dim() != 1 or table.dtype.is_floating_point or table.dtype == torch.bool:
            raise InvalidInputError("block_table must be a 1-D sequence of block indices")
        table = table.to(device=self.device, dtype=torch.long)
        n_blocks = self._pool.shape[0]
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= n_blocks):
            raise InvalidInputError(f"block_table names a block outside the pool's {n_blocks} blocks")
        self._table = table
        self.block_size = int(self._pool.shape[1])
        self.row_shape = tuple(int(d) for d in self._pool.shape[2:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * pool.element_size()
        self.nbytes = int(table.numel()) * self.block_size * self.row_bytes

    def __repr__(self) -> str:
        return (f"TorchPagedRows(blocks={self._table.numel()}, block_size={self.block_size}, "
                f"row_shape={self.row_shape}, device={self.device})")

    def _index(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) index tensors of rows [r0, r1), on the pool's device."""
        r = torch.arange(r0, r1, device=self.device)
        return self._table[r // self.block_size], r % self.block_size

    def _row(self, r: int) -> torch.Tensor:
        return self._pool[int(self._table[r // self.block_size]), r % self.block_size]

    def _span(self, offset: int, n: int) -> RowSpan:
        """The head / whole rows / tail split of a byte range (InvalidInputError outside the table)."""
        if offset < 0 or offset + n > self.nbytes:
            raise InvalidInputError(f"bytes [{offset}, {offset + n}) are outside this block table's {self.nbytes}")
        return row_span(offset, n, self.row_bytes)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Gather the sequence's canonical bytes [offset, offset + len(out)) into ``out`` (PartReader)."""
        sp = self._span(offset, len(out))
        host = host_u8(out)
        if sp.head_len:
            copy_range(self._row(sp.head_row), sp.head_start, sp.head_start + sp.head_len, host[:sp.head_len],
                       False, sync_copy)
        if sp.whole_rows:
            rows = self._pool[self._index(sp.first, sp.stop)]  # one gather kernel, a fresh contiguous tensor
            host[sp.head_len:sp.head_len + sp.whole_rows * self.row_bytes].copy_(flat_bytes(rows))
        if sp.tail_len:
            copy_range(self._row(sp.stop), 0, sp.tail_len, host[len(out) - sp.tail_len:], False, sync_copy)

    def write_from(self, offset: int, data: memoryview) -> None:
        """Scatter canonical bytes ``data`` into the sequence's blocks at byte ``offset`` (PartWriter)."""
        sp = self._span(offset, len(data))
        src = host_u8(data)
        if self.device.type != "cpu":
            src = src.to(self.device)  # one host-to-device copy per chunk; blocking: data is only ours now
        if sp.head_len:
            copy_range(self._row(sp.head_row), sp.head_start, sp.head_start + sp.head_len, src[:sp.head_len],
                       True, sync_copy)
        if sp.whole_rows:
            seg = src[sp.head_len:sp.head_len + sp.whole_rows * self.row_bytes]
            if seg.storage_offset() % self._pool.element_size():
                seg = seg.clone()  # a dtype view needs element alignment
            vals = seg.view(self._pool.dtype).view(sp.whole_rows, *self.row_shape)
            self._pool.index_put_(self._index(sp.first, sp.stop), vals)  # one scatter kernel
        if sp.tail_len:
            copy_range(self._row(sp.stop), 0, sp.tail_len, src[len(data) - sp.tail_len:], True, sync_copy)
