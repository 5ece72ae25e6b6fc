"""Pages of an SGLang host pool as snapstore part sources and destinations (one row = one page).

Bytes move through the pool's own page calls (``get_data_page(i, flat=True)``,
``set_from_flat_data_page``), the ones SGLang's file backend uses, so every host pool class and
layout works; a page's bytes reach the pool only after snapstore checked the chunk they came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

HostIndex = Callable[[int], int]  # row of the stored chain -> the page's first slot in the host pool


def page_nbytes(pool: Any) -> int:
    """Bytes of one flat page of ``pool`` (what SGLang's file backend writes per page)."""
    page = pool.get_dummy_flat_data_page()
    return int(page.numel()) * int(page.element_size())


def page_bytes_of(pool: Any, index: int) -> np.ndarray:
    """The flat bytes (uint8, contiguous) of the page at host slot ``index``."""
    import torch

    page = pool.get_data_page(index, flat=True)
    return np.asarray(page.contiguous().view(torch.uint8).numpy())


class PageReader:
    """A row-stream source over host pages: row ``r`` is the page at ``host_index(r)``."""

    _snapstore_fills_out = True  # read_into writes every byte of out or raises (snapstore.parts.buffers.FILLS_OUT)

    def __init__(self, pool: Any, host_index: HostIndex, n_rows: int, row_bytes: int) -> None:
        self._pool = pool
        self._host_index = host_index
        self._row_bytes = row_bytes
        self.nbytes = n_rows * row_bytes
        self._row = -1
        self._bytes: np.ndarray | None = None

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the chain's bytes from ``offset`` (only the new rows are asked for)."""
        dst = np.frombuffer(out, dtype=np.uint8)
        done = 0
        while done < len(dst):
            row, within = divmod(offset + done, self._row_bytes)
            if row != self._row:
                self._bytes, self._row = page_bytes_of(self._pool, self._host_index(row)), row
            assert self._bytes is not None
            n = min(len(dst) - done, self._row_bytes - within)
            dst[done:done + n] = self._bytes[within:within + n]
            done += n


class PageWriter:
    """A row-stream destination that fills host pages: row ``r`` goes to ``host_index(r)``.

    A page is handed to the pool whole, once all its (checked) bytes arrived; ``rows_done``
    counts the pages written, so a restore that fails part-way still reports the good pages.
    """

    def __init__(self, pool: Any, host_index: HostIndex, n_rows: int, row_bytes: int) -> None:
        self._pool = pool
        self._host_index = host_index
        self._row_bytes = row_bytes
        self.nbytes = n_rows * row_bytes
        self._scratch = pool.get_dummy_flat_data_page()
        self._flat = self._scratch_bytes()
        self.rows_done: list[int] = []

    def _scratch_bytes(self) -> np.ndarray:
        import torch

        return np.asarray(self._scratch.view(torch.uint8).numpy())

    def write_from(self, offset: int, data: memoryview) -> None:
        """Copy checked bytes into the page being assembled; hand each complete page to the pool."""
        src = np.frombuffer(data, dtype=np.uint8)
        done = 0
        while done < len(src):
            row, within = divmod(offset + done, self._row_bytes)
            n = min(len(src) - done, self._row_bytes - within)
            self._flat[within:within + n] = src[done:done + n]
            done += n
            if within + n == self._row_bytes:
                self._pool.set_from_flat_data_page(self._host_index(row), self._scratch)
                self.rows_done.append(row)
