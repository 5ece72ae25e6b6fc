"""Paged K/V as a part source and destination: rows of one sequence scattered over a block pool.

Serving engines (vLLM / SGLang style) hold K/V in one global pool of fixed-size blocks and give
each sequence a block table: token ``t`` lives in block ``block_table[t // block_size]`` at slot
``t % block_size``. :class:`PagedRows` maps the store's canonical byte stream of a row stream
(rows × row bytes, token axis outermost) onto such a pool, so a save reads the blocks and a
restore writes straight into another sequence's blocks — no contiguous copy of the sequence.

It implements both protocols of :mod:`snapstore.parts.buffers` (``read_into`` for save, ``write_from``
for restore). Byte ranges may start and end inside a row (chunk edges; the split is
:func:`snapstore.parts.rowspan.row_span`): partial rows are patched through a one-row temporary,
whole rows are moved block by block with slice copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from snapstore._errors import InvalidInputError
from snapstore._numbers import integer
from snapstore.parts.rowspan import RowSpan, row_span

__all__ = ["PagedRows", "block_indices", "fitting_axes", "pool_axes"]


def pool_axes(ndim: int, axes: object) -> tuple[int, int]:
    """Normalise ``(block_axis, token_axis)`` for a pool of ``ndim`` dimensions: the one reading of a
    paged pool's ``axes`` (numpy :class:`PagedRows` and the torch adapter's), InvalidInputError
    for anything but two different integer axes of the pool."""
    try:
        pair = tuple(axes) if isinstance(axes, Iterable) else ()
    except TypeError:  # iterable in name only (a 0-d array)
        pair = ()
    if len(pair) != 2:
        raise InvalidInputError(f"axes must be (block_axis, token_axis), got {axes!r}")
    out = []
    for a in pair:
        k = integer(a, f"axes {pair!r}: each axis")
        if not -ndim <= k < ndim:
            raise InvalidInputError(f"axes {pair!r} do not fit a pool of {ndim} dimensions")
        out.append(k % ndim)
    if out[0] == out[1]:
        raise InvalidInputError(f"axes {pair!r}: the block axis and the token axis must differ")
    return out[0], out[1]


def block_indices(block_table: object) -> np.ndarray:
    """A block table (not a torch tensor) as a 1-D int64 array: the one reading of it for numpy
    :class:`PagedRows` and the torch adapter; InvalidInputError for anything else."""
    try:
        table = np.asarray(block_table)
    except (TypeError, ValueError):  # a ragged or odd sequence
        table = np.asarray(None)
    if table.ndim != 1 or (table.size and table.dtype.kind not in "iu"):
        raise InvalidInputError(f"block_table must be a 1-D sequence of block indices, got {block_table!r:.80}")
    return table.astype(np.int64, copy=False)


def fitting_axes(pool_shape: Sequence[int], row_shape: Sequence[int]) -> list[tuple[int, int]]:
    """Every ``(block_axis, token_axis)`` of a pool of ``pool_shape`` whose other axes, in order, are
    ``row_shape`` — what to pass as ``axes`` when the ones given do not fit the layout."""
    n, want = len(pool_shape), tuple(int(d) for d in row_shape)
    return [(b, t) for b in range(n) for t in range(n)
            if b != t and tuple(int(d) for k, d in enumerate(pool_shape) if k not in (b, t)) == want]


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
    of this sequence in token order. ``nbytes`` is what the table can hold; ``row_shape``,
    ``dtype``, ``axes`` and ``pool_shape`` describe it, and a save or restore checks ``row_shape``
    and ``dtype`` against the layout's stream before a byte moves (a pool read with the wrong
    axes is refused, naming the axes that fit).
    """

    _snapstore_fills_out = True  # read_into writes every byte of out or raises (snapstore.parts.buffers.FILLS_OUT)

    # the one reading of a pool's ``axes`` and of a block table, for a twin over another array type
    # (snapstore.engine.TorchPagedRows): ``PagedRows.pool_axes(ndim, axes)``, ``PagedRows.block_indices(table)``
    pool_axes = staticmethod(pool_axes)
    block_indices = staticmethod(block_indices)

    def __init__(self, pool: np.ndarray, block_table: Sequence[int] | np.ndarray, axes: Sequence[int] = (0, 1)):
        if not isinstance(pool, np.ndarray):
            raise InvalidInputError(f"pool must be a numpy array, got {type(pool).__name__} "
                                    "(torch tensors: snapstore.engine.TorchPagedRows)")
        if pool.dtype.hasobject or pool.dtype.itemsize == 0:
            raise InvalidInputError(f"pool must hold numbers (a K/V cache), got dtype {pool.dtype}")
        b_ax, t_ax = pool_axes(pool.ndim, axes)
        self.axes = (b_ax, t_ax)
        self.pool_shape = tuple(int(d) for d in pool.shape)
        # (block, slot, *row): a view, never a copy, so writes land in the engine's pool
        self._pool = np.moveaxis(pool, (b_ax, t_ax), (0, 1))
        table = block_indices(block_table)
        n_blocks = self._pool.shape[0]
        if n_blocks == 0 or self._pool.shape[1] == 0:
            raise InvalidInputError(f"the pool holds no blocks or no slots (shape {pool.shape}, axes {axes!r})")
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
                f"dtype={self.dtype.name}, axes={self.axes})")

    def _span(self, offset: int, n: int) -> RowSpan:
        """The head / whole rows / tail split of a byte range (InvalidInputError outside the table)."""
        if offset < 0 or offset + n > self.nbytes:
            raise InvalidInputError(f"bytes [{offset}, {offset + n}) are outside this block table's {self.nbytes}")
        return row_span(offset, n, self.row_bytes)

    def _row_bytes_view(self, r: int) -> np.ndarray:
        """Row ``r`` as a contiguous byte copy (for patching a partial row)."""
        i, s = divmod(r, self.block_size)
        return np.ascontiguousarray(self._pool[int(self._table[i]), s]).reshape(-1).view(np.uint8)

    def _rows_of(self, data: memoryview, k: int) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).view(self.dtype).reshape((k, *self.row_shape))

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the sequence's canonical bytes from byte ``offset`` (PartReader)."""
        sp = self._span(offset, len(out))
        if sp.head_len:  # the range starts inside row head_row
            out[:sp.head_len] = self._row_bytes_view(sp.head_row)[sp.head_start:sp.head_start + sp.head_len].data
        pos = sp.head_len
        if sp.whole_rows:
            n = sp.whole_rows * self.row_bytes
            dst = self._rows_of(out[pos:pos + n], sp.whole_rows)
            for blk, s, k, r in block_runs(self._table, self.block_size, sp.first, sp.stop):
                dst[r - sp.first:r - sp.first + k] = self._pool[blk, s:s + k]
        if sp.tail_len:  # ends inside row stop
            out[len(out) - sp.tail_len:] = self._row_bytes_view(sp.stop)[:sp.tail_len].data

    def write_from(self, offset: int, data: memoryview) -> None:
        """Store ``data`` (canonical bytes) at byte ``offset`` of the sequence (PartWriter)."""
        if not self._writeable:
            raise InvalidInputError("the pool is read-only")
        sp = self._span(offset, len(data))
        if sp.head_len:
            self._patch(sp.head_row, sp.head_start, data[:sp.head_len])
        pos = sp.head_len
        if sp.whole_rows:
            n = sp.whole_rows * self.row_bytes
            src = self._rows_of(data[pos:pos + n], sp.whole_rows)
            for blk, s, k, r in block_runs(self._table, self.block_size, sp.first, sp.stop):
                self._pool[blk, s:s + k] = src[r - sp.first:r - sp.first + k]
        if sp.tail_len:
            self._patch(sp.stop, 0, data[len(data) - sp.tail_len:])

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
