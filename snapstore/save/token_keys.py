"""A save's tokens and the keys computed from them, each once per save: the BLAKE3 chain (prefix keys,
the anchor: :class:`snapstore._tokens.TokenIndex`) and the find keys (:mod:`snapstore.catalog.find_keys`).

Each is computed where it is first needed and kept: a ``save(wait=False)`` that predicts its parent
at the call (:meth:`snapstore.save.run.SaveRun.parent_rows_now`) hands the same record to the save it
queues, so the writer thread hashes nothing again; a save without a prediction hashes on the writer.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from snapstore._tokens import TokenIndex
from snapstore.catalog.find_keys import find_keys, stored_key

__all__ = ["TokenKeys"]


class TokenKeys:
    """One save's token array, its :class:`TokenIndex` and its find keys, each computed at first use."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    @cached_property
    def index(self) -> TokenIndex:
        """The BLAKE3 chain: prefix keys, the anchor, parent='auto''s exact checks."""
        return TokenIndex(self.arr)

    @cached_property
    def keys(self) -> np.ndarray:
        """The find keys of every block boundary: parent='auto''s candidates."""
        return find_keys(self.arr)

    def find_key(self, n: int) -> int:
        """The find key a snapshot of the first ``n`` tokens stores."""
        return stored_key(self.keys, n)
