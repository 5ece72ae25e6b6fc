"""The machine's workload (deterministic conversations) and its reference engine, NumpyEngine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from snapstore._config import Budget
from snapstore._identity import Identity
from snapstore._layout import Fixed, Layout
from snapstore._results import RestoreResult, SaveResult
from snapstore.store.store import Store


class Workload:
    """Deterministic conversations over a layout; rows depend only on (conversation, row), so a delta
    over any saved prefix is valid, and conversations 0 and 1 share a prefix (branches)."""

    def __init__(self, layout: Layout, *, conversations: int = 4, max_tokens: int = 400, shared: int = 100,
                 seed: int = 1234):
        rng = np.random.default_rng(seed)
        self.layout, self.conversations, self.max_tokens = layout, conversations, max_tokens
        self.tokens = [rng.integers(0, 1000, max_tokens) + 10_000 * i for i in range(conversations)]
        self.rows = [{name: rng.integers(0, 256, max_tokens * spec.row_bytes, dtype=np.uint8)
                      for name, spec in layout.rows.items()} for _ in range(conversations)]
        if conversations > 1:
            self.tokens[1][:shared] = self.tokens[0][:shared]
            for name, spec in layout.rows.items():
                self.rows[1][name][:shared * spec.row_bytes] = self.rows[0][name][:shared * spec.row_bytes]

    def state(self, conv: int, fixed_seed: int) -> dict[str, np.ndarray]:
        """Every part of conversation ``conv`` as raw bytes (streams hold max_tokens rows)."""
        rng = np.random.default_rng(fixed_seed)
        out = {name: rng.integers(0, 256, spec.nbytes, dtype=np.uint8) for name, spec in self.layout.fixed.items()}
        out.update(self.rows[conv])
        return out

    def expected(self, conv: int, n: int, fixed_seed: int, components: set[str | None]) -> dict[str, bytes]:
        """What a restore of (conv, n) must produce: fixed parts whole, the first n rows of streams."""
        full = self.state(conv, fixed_seed)
        out: dict[str, bytes] = {}
        for name, spec in self.layout.parts.items():
            if spec.component not in components:
                continue
            out[name] = full[name].tobytes() if isinstance(spec, Fixed) else \
                full[name][:n * spec.row_bytes].tobytes()
        return out


class NumpyEngine:
    """The reference engine: raw numpy buffers straight through ``Store.save`` / ``Store.restore``.

    Subclass it and override ``save``/``restore`` (and ``open`` for store options) to drive an
    engine's own integration; the state machine only ever calls these three.
    """

    def __init__(self, layout: Layout, identity: Identity | None = None, *, chunk_bytes: int = 4096,
                 staging_bytes: int = 32768, max_rows: int = 4096):
        self.layout, self.max_rows = layout, max_rows
        self.identity = identity or Identity(build="snapstore-testing", pack="sha256:0")
        self.chunk_bytes, self.staging_bytes = chunk_bytes, staging_bytes
        self._arena: dict[str, np.ndarray] | None = None  # its restore buffers, kept as an engine keeps its own

    def open(self, path: str, *, budget: Budget, codec: str, **options: Any) -> Store:
        """Open the store the machine drives (row checks on: the vouching is verified); ``options``:
        more ``Store.open`` options the machine draws (``admit=``)."""
        return Store.open(path, identity=self.identity, layout=self.layout, budget=budget, codec=codec,
                          chunk_bytes=self.chunk_bytes, staging_bytes=self.staging_bytes, check_rows=True, **options)

    def save(self, store: Store, tokens: np.ndarray, state: Mapping[str, np.ndarray], **kw: Any) -> SaveResult:
        """Save ``state`` (part name -> raw bytes; streams hold at least len(tokens) rows)."""
        res: SaveResult = store.save(tokens, dict(state), **kw)
        return res

    def restore(self, store: Store, ref: Any, session: str | None = None) -> tuple[RestoreResult, dict[str, bytes]]:
        """Restore ``ref`` as ``session``; return the result and each restored part's valid bytes.

        Every restore writes into the same buffers, zeroed first, as a server restores into its one
        arena: repeated restores of a snapshot are replayed from the plan the store keeps for them
        (restore/hot.py), and the machine checks those too against the model."""
        if self._arena is None:
            self._arena = {name: np.zeros(spec.nbytes if isinstance(spec, Fixed) else spec.row_bytes * self.max_rows,
                                          np.uint8) for name, spec in self.layout.parts.items()}
        dest = self._arena
        for buf in dest.values():
            buf.fill(0)
        res = store.restore(ref, dest, session=session)
        out: dict[str, bytes] = {}
        for name, spec in self.layout.parts.items():
            if spec.component in res.missing_components:
                continue
            out[name] = dest[name].tobytes() if isinstance(spec, Fixed) else \
                dest[name][:res.rows[name] * spec.row_bytes].tobytes()
        return res, out
