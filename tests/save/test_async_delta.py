"""Issue 30, item 1: a ``save(wait=False)`` copies at the call only what the snapshot stores — the
fixed parts and, of a row stream the store cannot read in place later (a device tensor, a paged
pool), the rows above its parent — not the whole sequence (``SaveHandle.copied_bytes``)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import LAYOUT, empty_like_state, make_state, open_store

import snapstore as ss
from snapstore.save import chunker as _chunker

N = 400
STATE = make_state(LAYOUT, N, seed=31)
TOKENS = np.arange(9000, 9000 + N, dtype="<u8")
FIXED = sum(s.nbytes for s in LAYOUT.fixed.values())
ROW = sum(s.row_bytes for s in LAYOUT.rows.values())


class DeviceRows:
    """A row stream held where the store cannot read it in place (like a device tensor): read
    through ``read_into`` only; counts the bytes read."""

    def __init__(self, arr: np.ndarray):
        self._bytes = memoryview(np.ascontiguousarray(arr)).cast("B")
        self.nbytes = self._bytes.nbytes
        self.read = 0

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self._bytes[offset:offset + len(out)]
        self.read += len(out)


class _PausedWriter:
    """Holds the writer thread inside its first chunk until opened (the chunker's test hook)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.entered, self.opened = threading.Event(), threading.Event()
        main = threading.get_ident()

        def hook(stage: str, chunker: Any, cid: bytes) -> None:
            if stage == "hashed" and threading.get_ident() != main:
                self.entered.set()
                self.opened.wait(30)

        monkeypatch.setattr(_chunker, "_TEST_HOOK", hook)


def on_device(n: int) -> dict[str, Any]:
    return {k: (DeviceRows(v[:n]) if k in LAYOUT.rows else v) for k, v in STATE.items()}


def host(n: int) -> dict[str, np.ndarray]:
    return {k: (v[:n] if k in LAYOUT.rows else v) for k, v in STATE.items()}


def restored(s: ss.Store, ref: Any, n: int) -> bool:
    out = empty_like_state(host(n))
    return s.restore(ref, out).n_tokens == n and all(out[k].tobytes() == host(n)[k].tobytes() for k in out)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n0=st.integers(1, N - 1), extra=st.integers(1, 120), mode=st.sampled_from(["auto", "id", "handle"]))
def test_async_save_copies_only_the_rows_above_its_parent(tmp_path_factory: Any, n0: int, extra: int,
                                                          mode: str) -> None:
    n1 = min(N, n0 + extra)
    with open_store(tmp_path_factory.mktemp("delta")) as s:
        if mode == "handle":
            first: Any = s.save(TOKENS[:n0], on_device(n0), parent=None, wait=False)
            assert first.copied_bytes == FIXED + n0 * ROW  # no parent: the whole stream
        else:
            first = s.save(TOKENS[:n0], host(n0), parent=None)
        parent = {"auto": "auto", "id": first, "handle": first}[mode]
        parts = on_device(n1)
        h = s.save(TOKENS[:n1], parts, parent=parent, wait=False)
        assert h.copied_bytes == FIXED + (n1 - n0) * ROW  # the delta, not the sequence
        assert sum(p.read for k, p in parts.items() if k in LAYOUT.rows) == (n1 - n0) * ROW
        res = h.result(30)
        over = first.result() if mode == "handle" else first
        assert res.ok and res.parent_id == over.snapshot_id
        assert restored(s, res, n1)


def test_delta_copy_over_a_skipped_parent_is_skipped_not_misread(store_dir: str) -> None:
    with open_store(store_dir, disk=24 * 1024) as s:
        root = s.save(TOKENS[:8], host(8), parent=None)
        big = s.save(TOKENS[:N], host(N), parent=root, wait=False)  # over the budget: skipped
        child = s.save(TOKENS[:N], on_device(N), parent=big, wait=False)  # copied rows [N, N): none
        assert big.result(30).skipped is not None
        res = child.result(30)
        assert res.skipped == "parent_gone" and res.snapshot_id is None
        assert s.stats().skipped.get("parent_gone") == 1


def test_delta_copy_whose_predicted_parent_went_is_skipped(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(store_dir) as s:
        root = s.save(TOKENS[:100], host(100), parent=None)
        gate = _PausedWriter(monkeypatch)
        other = s.save(TOKENS[200:210], host(10), parent=None, wait=False)  # holds the writer thread
        assert gate.entered.wait(10)
        h = s.save(TOKENS[:150], on_device(150), parent="auto", wait=False)  # predicted over root
        assert h.copied_bytes == FIXED + 50 * ROW
        s.delete(root)  # before the queued save runs
        gate.opened.set()
        assert other.result(30).ok
        res = h.result(30)
        assert res.skipped == "parent_gone" and res.snapshot_id is None  # rows [0, 100) were never copied
