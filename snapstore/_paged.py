"""Paged K/V as a part source and destination: rows of one sequence scattered over a block pool.

Serving engines (vLLM / SGLang style) hold K/V in one global pool of fixed-size blocks and give
each sequence a block table: token ``t`` lives in block ``block_table[t // block_size]`` at slot
``t % block_size``. :class:`PagedRows` maps the store's canonical byte stream of a row stream
(rows × row bytes, token axis outermost) onto such a pool, so a save reads the blocks and a
restore writes straight into another sequence's blocks — no contiguous copy of the sequence.

It implements both protocols of :mod:`snapstore._buffers` (``read_into`` for save, ``write_from``
for restore). Byte ranges may start and end inside a row (chunk edges): partial rows are patched
through a one-row temporary, whole rows are moved block by block with slice copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._errors import InvalidInputError

__all__ = ["PagedRows"]


def _axes(ndim: int, axes: Sequence[int]) -> tuple[int, int]:
    """Normalise ``(block_axis, token_axis)`` for a pool of ``ndim`` dimensions."""
    if len(axes) != 2:
        raise InvalidInputError(f"axes must be (block_axis, token_axis), got {axes!r}")
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or isinstance(a, bool) or not -ndim <= int(a) < ndim:
            raise InvalidInputError(f"axes {tuple(axes)!r} do not fit a pool of {ndim} dimensions")
        out.append(int(a) % ndim)
    if out[0] == out[1]:
        raise InvalidInputError(f"axes {tuple(axes)!r}: the block axis and the token axis must differ")
    return out[0], out[1]


def block_runs(table: np.ndarray, block_size: int, r0: int, r1: int) -> list[tuple[int, int, int, int]]:
    """Rows [r0, r1) as runs inside one block each: (block, first slot, row count, first row)."""
    out: list[tuple[int, int, int, int]] = []
    r = r0
    while r < r1:
        i, s = divmod(r, block_size)
        k = min(block_size - s, r1 - r)
        out.append((int(table[i]), s, k, r))
        r += k
    return out


class PagedRows:
    """One sequence's rows in a paged pool: a ``PartReader`` (save) and ``PartWriter`` (restore).

    ``pool``: a numpy array holding every block; ``axes = (block_axis, token_axis)`` name its
    block and in-block token axes, every other axis (in order) is the row shape — e.g. a pool of
    shape ``(n_blocks, block_size, 2, heads, dim)`` has ``axes=(0, 1)`` and a vLLM-style
    ``(2, n_blocks, block_size, heads, dim)`` has ``axes=(1, 2)``. ``block_table``: the blocks
    of this sequence in token order. ``nbytes`` is what the table can hold.
    """

    def __init__(self, pool: np.ndarray, block_table: Sequence[int] | np.ndarray, axes: Sequence[int] = (0, 1)):
        if not isinstance(pool, np.ndarray):
            raise InvalidInputError(f"pool must be a numpy array, got {type(pool).__name__} "
                                    "(torch tensors: snapstore.engine.TorchPagedRows)")
        b_ax, t_ax = _axes(pool.ndim, axes)
        # (block, slot, *row): a view, never a copy, so writes land in the engine's pool
        self._pool = np.moveaxis(pool, (b_ax, t_ax), (0, 1))
        table = np.asarray(block_table)
        if table.ndim != 1 or (table.size and table.dtype.kind not in "iu"):
            raise InvalidInputError("block_table must be a 1-D sequence of block indices")
        table = table.astype(np.int64, copy=False)
        n_blocks = self._pool.shape[0]
        if table.size and (int(table.min()) < 0 or int(table.max()) >= n_blocks):
            raise InvalidInputError(f"block_table names a block outside the pool's {n_blocks} blocks")
        self._table = table
        self.block_size = int(self._pool.shape[1])
        self.row_shape = tuple(int(d) for d in self._pool.shape[2:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * pool.dtype.itemsize
        self.dtype = pool.dtype
        self.nbytes = len(table) * self.block_size * self.row_bytes
        self._writeable = bool(pool.flags.writeable)
        # each block's (slot, *row) bytes one C-contiguous run: restores may read into them in place
        self._blocks_contiguous = self._writeable and bool(self._pool[0].flags.c_contiguous) \
            and self._pool.dtype.byteorder in ("=", "<", "|")
        self._flat = pool.reshape(-1).view(np.uint8).data if self._blocks_contiguous and \
            pool.flags.c_contiguous and self._pool.strides[0] > 0 else None

    def __repr__(self) -> str:
        return (f"PagedRows(blocks={len(self._table)}, block_size={self.block_size}, row_shape={self.row_shape}, "
                f"dtype={self.dtype.name})")

    def _span(self, offset: int, n: int) -> tuple[int, int, int, int]:
        """(first row, head bytes into it, first whole row after the head, end byte) of a byte range."""
        if offset < 0 or offset + n > self.nbytes:
            raise InvalidInputError(f"bytes [{offset}, {offset + n}) are outside this block table's {self.nbytes}")
        return offset // self.row_bytes, offset % self.row_bytes, -(-offset // self.row_bytes), offset + n

    def _row_bytes_view(self, r: int) -> np.ndarray:
        """Row ``r`` as a contiguous byte copy (for patching a partial row)."""
        i, s = divmod(r, self.block_size)
        return np.ascontiguousarray(self._pool[int(self._table[i]), s]).reshape(-1).view(np.uint8)

    def _rows_of(self, data: memoryview, k: int) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).view(self.dtype).reshape((k, *self.row_shape))

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the sequence's canonical bytes from byte ``offset`` (PartReader)."""
        rb = self.row_bytes
        r_first, head, r_whole, end = self._span(offset, len(out))
        pos = 0
        if head:  # the range starts inside row r_first
            take = min(rb - head, len(out))
            out[:take] = self._row_bytes_view(r_first)[head:head + take].data
            pos = take
        r_end = end // rb
        if r_whole < r_end:
            dst = self._rows_of(out[pos:pos + (r_end - r_whole) * rb], r_end - r_whole)
            for blk, s, k, r in block_runs(self._table, self.block_size, r_whole, r_end):
                dst[r - r_whole:r - r_whole + k] = self._pool[blk, s:s + k]
            pos += (r_end - r_whole) * rb
        if pos < len(out):  # ends inside row r_end
            tail = len(out) - pos
            out[pos:] = self._row_bytes_view(r_end)[:tail].data

    def write_from(self, offset: int, data: memoryview) -> None:
        """Store ``data`` (canonical bytes) at byte ``offset`` of the sequence (PartWriter)."""
        if not self._writeable:
            raise InvalidInputError("the pool is read-only")
        rb = self.row_bytes
        r_first, head, r_whole, end = self._span(offset, len(data))
        pos = 0
        if head:
            take = min(rb - head, len(data))
            self._patch(r_first, head, data[:take])
            pos = take
        r_end = end // rb
        if r_whole < r_end:
            src = self._rows_of(data[pos:pos + (r_end - r_whole) * rb], r_end - r_whole)
            for blk, s, k, r in block_runs(self._table, self.block_size, r_whole, r_end):
                self._pool[blk, s:s + k] = src[r - r_whole:r - r_whole + k]
            pos += (r_end - r_whole) * rb
        if pos < len(data):
            self._patch(r_end, 0, data[pos:])

    def views(self, offset: int, n: int) -> list[memoryview] | None:
        """Writable byte views of [offset, offset + n) in order — one per block touched — when each
        block is contiguous in memory, so a restore reads chunks straight into the blocks; else None."""
        if not self._blocks_contiguous:
            return None
        self._span(offset, n)
        out: list[memoryview] = []
        per = self.block_size * self.row_bytes
        base, stride = self._flat, self._pool.strides[0]
        pos, end = offset, offset + n
        while pos < end:
            i, within = divmod(pos, per)
            take = min(per - within, end - pos)
            b = int(self._table[i])
            if base is not None:  # plain memoryview slices of the whole pool: no numpy call per block
                o = b * stride + within
                out.append(base[o:o + take])
            else:
                out.append(self._pool[b].reshape(-1).view(np.uint8).data[within:within + take])
            pos += take
        return out

    def _patch(self, r: int, at: int, data: memoryview) -> None:
        """Overwrite bytes [at, at + len(data)) of row ``r``, keeping the rest of the row."""
        row = self._row_bytes_view(r)
        row[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        i, s = divmod(r, self.block_size)
        self._pool[int(self._table[i]), s] = row.view(self.dtype).reshape(self.row_shape)
