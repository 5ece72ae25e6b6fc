"""A byte range of a row stream cut at row edges: the one rule every row-structured reader/writer uses.

The core hands a ``PartReader`` / ``PartWriter`` byte ranges of a part's canonical order (rows ×
row bytes), and a chunk edge may fall inside a row. Memory that is addressed by row — a paged
block pool, a strided tensor — moves the whole rows of a range in bulk and patches the partial row
at either end through that row alone. :func:`row_span` computes that split once, for
:class:`snapstore.PagedRows`, ``snapstore.engine.TorchPagedRows`` and the torch adapter's strided
copies alike.
"""

from __future__ import annotations

from typing import NamedTuple

from snapstore._errors import InvalidInputError
from snapstore._numbers import integer

__all__ = ["RowSpan", "row_span"]


class RowSpan(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of a row stream as head, whole rows and tail.

    In the range's own byte order: the head is bytes ``[0, head_len)`` (row ``head_row`` from
    byte ``head_start``), whole rows ``[first, stop)`` follow, and the tail is the last
    ``tail_len`` bytes (the start of row ``stop``). ``head_len == 0``: the range starts on a row
    edge; ``stop == first``: no whole row; ``tail_len == 0``: it ends on a row edge.
    """

    head_row: int
    head_start: int
    head_len: int
    first: int
    stop: int
    tail_len: int

    @property
    def whole_rows(self) -> int:
        """How many whole rows the range holds."""
        return self.stop - self.first


def row_span(offset: int, nbytes: int, row_bytes: int) -> RowSpan:
    """Split bytes ``[offset, offset + nbytes)`` of rows of ``row_bytes`` bytes at row edges."""
    if type(offset) is not int or type(nbytes) is not int or type(row_bytes) is not int:  # (ints: no cost)
        offset, nbytes = integer(offset, "offset"), integer(nbytes, "nbytes")
        row_bytes = integer(row_bytes, "row_bytes")
    if row_bytes <= 0 or offset < 0 or nbytes < 0:
        raise InvalidInputError(f"byte range [{offset}, {offset + nbytes}) of {row_bytes}-byte rows is not a range")
    end = offset + nbytes
    head_row, head_start = divmod(offset, row_bytes)
    head_len = min(row_bytes - head_start, nbytes) if head_start else 0
    first = head_row + 1 if head_start else head_row
    if head_len == nbytes:  # the range lies inside one row (or is empty)
        return RowSpan(head_row, head_start, head_len, first, first, 0)
    stop, tail_len = divmod(end, row_bytes)
    return RowSpan(head_row, head_start, head_len, first, stop, tail_len)
