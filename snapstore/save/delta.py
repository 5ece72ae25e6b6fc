"""What a ``save(wait=False)`` copies before it returns: only what the snapshot will store.

A save over a parent stores the row streams' rows above the parent's boundary and the fixed
parts (:meth:`snapstore.save.stages.Saver.plan`). Sources the engine keeps (contiguous host
buffers) are read in place later; everything else — fixed parts (the next decode step overwrites
them) and row streams that are not host buffers (a paged pool's blocks, a device tensor, a
strided array) — is copied at the call. For such a row stream the call copies rows
``[floor, rows)`` only, where ``floor`` is the row count the parent holds, known at the call:

- ``parent=<SaveHandle>``: the rows that save was given;
- ``parent=<id>`` or ``"auto"``: one catalog read, the parent ``"auto"`` would choose now
  (:meth:`snapstore.save.run.SaveRun.parent_rows_now`); a save still queued is not seen by it,
  so chain on its handle to copy only the delta over it;
- ``parent=None``: 0 (the whole stream).

The copy is a :class:`RowsAbove`: a source that holds no rows below ``floor``. When the save
runs, its parent must hold at least ``floor`` rows of each such stream; when it does not (the
predicted parent was skipped, evicted or not chosen) the save is skipped with reason
``parent_gone`` rather than read rows it never copied (:meth:`SaveRun.once`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from snapstore._errors import StateError
from snapstore._layout import Fixed, Layout
from snapstore.parts.buffers import Source

__all__ = ["RowsAbove", "copy_spans", "take"]


class RowsAbove:
    """A row stream's bytes ``[base, nbytes)``, copied at the call; rows below are the parent's."""

    _snapstore_fills_out = True  # read_into writes every byte of out or raises (snapstore.parts.buffers.FILLS_OUT)

    def __init__(self, nbytes: int, base: int, base_rows: int, buf: np.ndarray):
        self.nbytes, self.base, self.base_rows = nbytes, base, base_rows
        self._mv = buf.data  # one-dimensional bytes

    def _at(self, offset: int, n: int) -> memoryview:
        if offset < self.base:
            raise StateError(f"rows below row {self.base_rows} were not copied by save(wait=False) (they are "
                             "the parent's); this save cannot be stored over another parent")
        return self._mv[offset - self.base:offset - self.base + n]

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self._at(offset, len(out))

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._at(offset, nbytes)  # the copy is ours: lent without another copy

    def release(self, offset: int, nbytes: int) -> None:
        pass


def copy_spans(layout: Layout, sources: Mapping[str, Source], floors: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """The byte range of each source the call copies (absent: read in place later)."""
    out: dict[str, tuple[int, int]] = {}
    for name, src in sources.items():
        spec = layout.parts[name]
        if isinstance(spec, Fixed):
            out[name] = (0, src.nbytes)
        elif not src.zero_copy:
            out[name] = (min(floors.get(name, 0) * spec.row_bytes, src.nbytes), src.nbytes)
    return out


def take(layout: Layout, name: str, src: Source, span: tuple[int, int]) -> Any:
    """Copy ``span`` of ``src`` now (a device source's device->host copy): a buffer, or a
    :class:`RowsAbove` when rows below the span belong to the parent."""
    start, end = span
    buf = np.empty(end - start, dtype=np.uint8)
    src.copy_into(start, buf.data)
    spec = layout.parts[name]
    if start == 0 or isinstance(spec, Fixed):
        return buf
    return RowsAbove(end, start, start // spec.row_bytes, buf)
