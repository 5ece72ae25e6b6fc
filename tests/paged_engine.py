"""A serving-engine stand-in shaped like vLLM / SGLang, and the snapstore glue docs/engine.md shows.

One global paged K/V pool ``(n_blocks, BS, 2, 2, 8)`` and a vLLM-style draft pool
``(2, n_blocks, BS, 8)`` shared by 4 batch slots, blocks handed out from a *shuffled* free list
(a sequence's blocks are never adjacent), a recurrent state per slot updated in place, a draft
head. ``backend="numpy"`` or ``"torch"`` (any device). Row ``i`` of every stream depends only on
``tokens[:i + 1]`` and the recurrent state on all tokens, so any prefix is checkable from its
tokens alone. Run as a script (``python tests/paged_engine.py save DIR``) it saves a few prompts
in a fresh process, for the restart test.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

import snapstore

BS = 16  # rows per block
SLOTS = 4
IDENT = snapstore.Identity(build="paged-test-1", pack="sha256:feed", kv="f16", mtp=True)


class PagedEngine:
    """Four slots over one block pool; ``tables[slot]`` lists that sequence's blocks in token order."""

    def __init__(self, backend: str = "numpy", device: str = "cpu", n_blocks: int = 128, seed: int = 0):
        self.backend, self.device = backend, device
        rng = np.random.default_rng(seed)
        kv = np.zeros((n_blocks, BS, 2, 2, 8), np.float16)
        draft = np.zeros((2, n_blocks, BS, 8), np.float16)
        state = np.zeros((SLOTS, 4, 16), np.float32)
        if backend == "torch":
            import torch
            self.kv, self.draft, self.state = (torch.from_numpy(a).to(device) for a in (kv, draft, state))
        else:
            self.kv, self.draft, self.state = kv, draft, state
        self.free: list[int] = [int(b) for b in rng.permutation(n_blocks)]
        self.tables: list[list[int]] = [[] for _ in range(SLOTS)]
        self.pos = [0] * SLOTS

    # -- what the engine does anyway ---------------------------------------------------------
    def alloc(self, slot: int, n_rows: int) -> None:
        """Give ``slot`` enough blocks for ``n_rows`` rows (from the shuffled free list)."""
        while len(self.tables[slot]) * BS < n_rows:
            self.tables[slot].append(self.free.pop())

    def free_slot(self, slot: int) -> None:
        """Return the slot's blocks to the pool."""
        self.free.extend(reversed(self.tables[slot]))
        self.tables[slot], self.pos[slot] = [], 0

    def prefill(self, slot: int, tokens: list[int], start: int = 0) -> None:
        """Compute rows [start, len(tokens)) and the recurrent state after ``tokens``."""
        kv, draft, state = expected(tokens)
        self.alloc(slot, len(tokens))
        for r in range(start, len(tokens)):
            b, s = self.tables[slot][r // BS], r % BS
            self._put(self.kv, (b, s), kv[r])
            self._put(self.draft, (slice(None), b, s), draft[r])
        self._put(self.state, (slot,), state)
        self.pos[slot] = len(tokens)

    def _put(self, arr: Any, idx: Any, val: np.ndarray) -> None:
        if self.backend == "torch":
            import torch
            arr[idx] = torch.from_numpy(np.ascontiguousarray(val)).to(arr.device)
        else:
            arr[idx] = val

    def contiguous(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slot's K/V rows, draft rows and state as host arrays (to check a restore)."""
        n = self.pos[slot]
        t = self.tables[slot]
        kv, draft, state = (self._host(a) for a in (self.kv, self.draft, self.state))
        rows = [(t[r // BS], r % BS) for r in range(n)]
        return (np.stack([kv[b, s] for b, s in rows]) if rows else kv[:0, 0],
                np.stack([draft[:, b, s] for b, s in rows]) if rows else draft[:, :0, 0].transpose(1, 0, 2),
                state[slot].copy())

    def _host(self, a: Any) -> np.ndarray:
        return a.cpu().numpy() if self.backend == "torch" else a

    # -- the part adapters the glue uses ----------------------------------------------------
    def paged(self, pool: Any, table: list[int], axes: tuple[int, int]) -> Any:
        """A paged source / destination over one of the pools."""
        if self.backend == "torch":
            from snapstore.engine import TorchPagedRows
            return TorchPagedRows(pool, table, axes)
        return snapstore.PagedRows(pool, table, axes)

    def state_out(self, slot: int) -> np.ndarray:
        """The slot's recurrent state as a host array (a view for numpy)."""
        return self._host(self.state[slot]) if self.backend == "torch" else self.state[slot]

    def state_in(self, slot: int, buf: np.ndarray) -> None:
        """Install a restored recurrent state (numpy restores in place: ``buf`` is the slot's view)."""
        if self.backend == "torch":
            self._put(self.state, (slot,), buf)


def expected(tokens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cold-prefill values: K/V rows (n, 2, 2, 8), draft rows (n, 2, 8), state (4, 16)."""
    t = np.asarray(tokens, dtype=np.int64)
    h = np.cumsum(t * 2654435761 % 1009) % 4093
    base = (h[:, None] + np.arange(32)) % 509 / 7
    kv = base.reshape(-1, 2, 2, 8).astype(np.float16)
    draft = (base[:, :16] * 3 % 11).reshape(-1, 2, 8).astype(np.float16)
    state = np.full((4, 16), h[-1] / 3, np.float32) + np.arange(16, dtype=np.float32)
    return kv, draft, state


# --- glue: begin (docs/engine.md shows these lines) ---
META = snapstore.EngineMeta(["position"])
LAYOUT = snapstore.Layout(
    fixed={"ssm.state": snapstore.Fixed("float32", (4, 16)), **META.layout()},
    rows={"attn.kv": snapstore.Rows("float16", (2, 2, 8)),
          "draft.kv": snapstore.Rows("float16", (2, 8), component="draft")})


def parts(eng: Any, slot: int, meta: Any) -> dict[str, Any]:
    """The slot's state as parts: its blocks are read / written in place, never gathered."""
    t = eng.tables[slot]
    return {"ssm.state": eng.state_out(slot), META.name: meta,
            "attn.kv": eng.paged(eng.kv, t, (0, 1)), "draft.kv": eng.paged(eng.draft, t, (1, 2))}


def save(store: Any, eng: Any, slot: int, tokens: list[int]) -> Any:
    return store.save(tokens, parts(eng, slot, META.pack(position=eng.pos[slot])))


def restore(store: Any, eng: Any, slot: int, tokens: list[int]) -> int:
    """Restore the longest saved prefix of ``tokens`` into ``slot``; returns the tokens left to read."""
    meta = META.empty()

    def allocate(plan: Any) -> dict[str, Any]:  # plan, then write: exactly the blocks it needs
        eng.alloc(slot, plan.rows["attn.kv"])
        return parts(eng, slot, meta)
    try:  # a miss: None; a failed restore gives the blocks back (release) and raises
        got = store.load(tokens, allocate=allocate, release=lambda _dest: eng.free_slot(slot))
    except snapstore.RestoreError:
        got = None  # read the prompt from token 0
    if got is None:
        return len(tokens)
    eng.state_in(slot, got.into["ssm.state"])
    eng.pos[slot] = META.unpack(meta)["position"]
    return len(tokens) - got.n_tokens
# --- glue: end ---


def prompts() -> list[list[int]]:
    """A shared system prompt and three conversations over it (lengths not multiples of BS)."""
    system = list(range(1000, 1000 + 83))
    return [system + [7, 8, 9] * 20, system + list(range(50, 91)), system + [3] * 101]


if __name__ == "__main__" and sys.argv[1] == "save":
    eng = PagedEngine(seed=1)
    with snapstore.Store.open(sys.argv[2], identity=IDENT, layout=LAYOUT, chunk_bytes=4096,
                              staging_bytes=16384) as st:
        ids = []
        for slot, p in enumerate(prompts()):
            eng.prefill(slot, p)
            ids.append(save(st, eng, slot, p).snapshot_id)
    print(json.dumps(ids))
