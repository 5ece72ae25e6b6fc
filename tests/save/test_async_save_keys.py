"""Issue 51 item 4, the save side, for ``save(wait=False)``: the tokens are hashed once per save.

A ``save(wait=False)`` whose row streams the store cannot read in place later predicts its parent at
the call (one catalog read, ``SaveRun.parent_rows_now``) and for that computes the tokens' BLAKE3
chain and find keys; the save it queues is handed those (``save.token_keys.TokenKeys``) and computes
none again (before: both twice, once on the calling thread and once on the writer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import LAYOUT, make_state, open_store

from snapstore._tokens import BLOCK
from snapstore.catalog.find_keys import find_keys
from snapstore.save import run

N = 700
STATE = make_state(LAYOUT, N, seed=37)
TOKENS = np.arange(4000, 4000 + N, dtype="<u8")
FIXED = sum(s.nbytes for s in LAYOUT.fixed.values())
ROW = sum(s.row_bytes for s in LAYOUT.rows.values())


class DeviceRows:
    """A row stream the store cannot read in place (like a device tensor): read through ``read_into``."""

    def __init__(self, arr: np.ndarray):
        self._bytes = memoryview(np.ascontiguousarray(arr)).cast("B")
        self.nbytes = self._bytes.nbytes

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self._bytes[offset:offset + len(out)]


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``name`` wherever a save computes its token keys (the save's run, and the
    record of its keys where there is one); the real function still runs."""
    calls: list[int] = []
    for module in [run, *([m] if (m := _token_keys()) is not None else [])]:
        real = getattr(module, name, None)
        if real is not None:
            monkeypatch.setattr(module, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


def _token_keys() -> Any:
    try:
        from snapstore.save import token_keys
    except ImportError:  # the code before the record of a save's keys
        return None
    return token_keys


@pytest.mark.parametrize("parent", ["auto", "id"])
def test_an_async_save_hashes_its_tokens_once(store_dir: str, monkeypatch: pytest.MonkeyPatch, parent: str) -> None:
    with open_store(store_dir) as s:
        first = s.save(TOKENS[:300], {k: (v[:300] if k in LAYOUT.rows else v) for k, v in STATE.items()}, parent=None)
        assert first.ok
        keys = _counting(monkeypatch, "find_keys")
        chains = _counting(monkeypatch, "TokenIndex")
        parts = {k: (DeviceRows(v) if k in LAYOUT.rows else v) for k, v in STATE.items()}
        h = s.save(TOKENS, parts, parent="auto" if parent == "auto" else first.snapshot_id, wait=False)
        assert h.copied_bytes == FIXED + (N - 300) * ROW  # the parent was predicted at the call
        res = h.result(30)
        assert res.ok and res.parent_id == first.snapshot_id
        assert len(keys) == 1 and len(chains) == 1  # before: 2 and 2 (the prediction's, then the save's)
        monkeypatch.undo()
        stored = s._repo.db.read(lambda c: c.execute("SELECT find_key FROM snapshots WHERE id = ?",
                                                     (res.snapshot_id,)).fetchone()[0])
        assert stored == int(find_keys(TOKENS)[N // BLOCK])
        out = {k: np.zeros_like(v) for k, v in STATE.items()}
        assert s.restore(res, out).n_tokens == N and all(out[k].tobytes() == STATE[k].tobytes() for k in out)


def test_a_save_without_a_prediction_hashes_once_on_the_writer(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(store_dir) as s:
        keys = _counting(monkeypatch, "find_keys")
        chains = _counting(monkeypatch, "TokenIndex")
        h = s.save(TOKENS, STATE, parent="auto", wait=False)  # host buffers: read in place, nothing predicted
        assert h.result(30).ok and h.copied_bytes == FIXED
        r = s.save(TOKENS[:500], {k: (v[:500] if k in LAYOUT.rows else v) for k, v in STATE.items()})
        assert r.ok
        assert len(keys) == 2 and len(chains) == 2  # one per save
