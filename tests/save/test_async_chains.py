"""Issue 30, items 2 and 3: saves queued over saves still in flight (``parent=<SaveHandle>``),
asynchronous turns (``Turn.capture(wait=False)``, ``Turn.last``, commit/abandon waiting for
captures in flight) and ``SaveHandle.add_done_callback``. Real store, real writer thread."""

from __future__ import annotations

import logging
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
STATE = make_state(LAYOUT, N, seed=30)
TOKENS = np.arange(5000, 5000 + N, dtype="<u8")


def upto(n: int, *, draft: bool = True) -> dict[str, np.ndarray]:
    """The engine's state after ``n`` tokens: views of one sequence (rows below n never change)."""
    out = {k: (v[:n] if k in LAYOUT.rows else v) for k, v in STATE.items()}
    return out if draft else {k: v for k, v in out.items() if k != "mtp.kv"}


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


def restored_equal(s: ss.Store, ref: Any, n: int) -> bool:
    out = empty_like_state(upto(n))
    res = s.restore(ref, out)
    return res.n_tokens == n and all(out[k].tobytes() == upto(n)[k].tobytes() for k in out)  # bytes: NaNs


# -- item 3: done callbacks --------------------------------------------------------------------------
def test_done_callback_runs_once_when_the_save_completes(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _PausedWriter(monkeypatch)
    with open_store(store_dir) as s:
        h = s.save(TOKENS[:64], upto(64), wait=False)
        seen: list[tuple[Any, bool]] = []
        fired = threading.Event()
        h.add_done_callback(lambda hh: (seen.append((hh, hh.done())), fired.set()))
        assert gate.entered.wait(10) and not seen  # not before the save is done
        gate.opened.set()
        assert fired.wait(30)
        assert seen == [(h, True)] and h.result().ok
        later: list[Any] = []
        h.add_done_callback(later.append)  # already done: at once, on this thread
        assert later == [h]
        assert s.flush(30) and seen == [(h, True)]  # once


def test_done_callback_of_a_failed_save_and_a_raising_callback_is_logged(
        store_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with open_store(store_dir) as s:
        bad = s.save(TOKENS[:16], upto(16), parent=10**9, wait=False)
        got: list[BaseException | None] = []
        done = threading.Event()
        bad.add_done_callback(lambda hh: (got.append(hh.exception()), done.set()))

        def boom(_: Any) -> None:
            raise RuntimeError("engine bug in a callback")

        with caplog.at_level(logging.ERROR, logger="snapstore"):
            ok = s.save(TOKENS[:32], upto(32), parent=None, wait=False)
            ok.add_done_callback(boom)
            assert ok.result(30).ok and s.flush(30)  # the save and the writer thread carry on
            after = s.save(TOKENS[:48], upto(48), wait=False)
            assert after.result(30).ok
        assert done.wait(30) and isinstance(got[0], ss.NotFoundError)
        assert any("engine bug in a callback" in (r.exc_text or "") for r in caplog.records)


# -- item 2: a handle as a parent --------------------------------------------------------------------
def test_save_queued_over_a_handle_in_flight_is_a_delta_over_it(store_dir: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _PausedWriter(monkeypatch)
    with open_store(store_dir) as s:
        first = s.save(TOKENS[:200], upto(200), parent=None, wait=False)
        assert gate.entered.wait(10)
        child = s.save(TOKENS[:260], upto(260), parent=first, wait=False)  # the parent is still in flight
        sync_box: list[ss.SaveResult] = []
        t = threading.Thread(target=lambda: sync_box.append(s.save(TOKENS[:300], upto(300), parent=child)))
        t.start()  # wait=True over a handle waits for it
        gate.opened.set()
        t.join(30)
        p, c, g = first.result(30), child.result(30), sync_box[0]
        assert c.parent_id == p.snapshot_id and g.parent_id == c.snapshot_id
        assert 0 < c.stored_bytes < p.stored_bytes  # rows [200, 260) only
        assert restored_equal(s, c, 260) and restored_equal(s, g, 300)


def test_child_of_a_failed_save_fails_naming_the_parents_error(store_dir: str) -> None:
    with open_store(store_dir) as s:
        bad = s.save(TOKENS[:16], upto(16), parent=10**9, wait=False)
        child = s.save(TOKENS[:32], upto(32), parent=bad, wait=False)
        grandchild = s.save(TOKENS[:48], upto(48), parent=child, wait=False)
        err = child.exception(30)
        assert isinstance(err, ss.StateError) and isinstance(err.__cause__, ss.NotFoundError)
        assert "parent save" in str(err) and "NotFoundError" in str(err)
        assert isinstance(grandchild.exception(30), ss.StateError)
        with pytest.raises(ss.StateError, match="parent save"):
            s.save(TOKENS[:64], upto(64), parent=bad)  # the synchronous path applies the same rule


def test_child_of_a_skipped_save_is_a_delta_over_the_skipped_saves_parent(store_dir: str) -> None:
    with open_store(store_dir, disk=24 * 1024) as s:
        root = s.save(TOKENS[:8], upto(8), parent=None)
        assert root.ok
        big = s.save(TOKENS[:N], upto(N), parent=root, wait=False)  # ~64 KB: over the budget
        small = s.save(TOKENS[:N], upto(N, draft=False), {"attn.kv": 40}, parent=big, wait=False)
        assert big.result(30).skipped is not None and big.result().parent_id == root.snapshot_id
        res = small.result(30)
        assert res.ok and res.parent_id == root.snapshot_id


def test_a_handle_of_another_store_is_refused(tmp_path: Any) -> None:
    with open_store(tmp_path / "a") as a, open_store(tmp_path / "b") as b:
        h = a.save(TOKENS[:16], upto(16), wait=False)
        with pytest.raises(ss.InvalidInputError, match="this store"):
            b.save(TOKENS[:32], upto(32), parent=h, wait=False)


# -- item 2: asynchronous turns ----------------------------------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(1, 60), st.booleans()), min_size=1, max_size=6))
def test_async_turn_commits_its_chain_like_a_synchronous_one(tmp_path_factory: Any,
                                                             steps: list[tuple[int, bool]]) -> None:
    path = tmp_path_factory.mktemp("turn")
    with open_store(path) as s:
        n = 0
        with s.turn(session="u") as t:
            for k, wait in steps:
                n = min(N, n + k)
                t.capture(TOKENS[:n], upto(n), wait=wait)  # queued over the previous one, in flight or not
        assert t.result is not None and t.result.ok and not t.result.pending
        assert t.last is not None and t.last.n_tokens == n and t.last.snapshot_id == t.result.snapshot_id
        assert [c.n_tokens for c in t.captures] == sorted({c.n_tokens for c in t.captures})
        m = s.match(TOKENS[:N])
        assert m is not None and m.n_tokens == n and restored_equal(s, m, n)


def test_turn_last_passes_over_skipped_captures_and_commit_waits(store_dir: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(store_dir, disk=24 * 1024) as s:
        gate = _PausedWriter(monkeypatch)
        with s.turn(session="v", parent=None) as t:
            a = t.capture(TOKENS[:8], upto(8), wait=False)
            assert gate.entered.wait(10) and t.last is None  # in flight: not waited for
            gate.opened.set()
            t.capture(TOKENS[:N], upto(N), wait=False)  # too big: skipped
            c = t.capture(TOKENS[:N], upto(N, draft=False), {"attn.kv": 30}, wait=False)
        assert a.result().ok and c.result().ok and c.result().parent_id == a.result().snapshot_id
        assert t.last == c.result() and [x.snapshot_id for x in t.captures] == [a.result().snapshot_id,
                                                                             c.result().snapshot_id]
        assert t.result is not None and t.result.snapshot_id == c.result().snapshot_id


def test_abandoned_async_turn_leaves_no_capture_pending(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _PausedWriter(monkeypatch)
    with open_store(store_dir) as s:
        with pytest.raises(KeyError), s.turn(session="w", parent=None) as t:
            hs = [t.capture(TOKENS[:n], upto(n), wait=False) for n in (40, 80, 120)]
            assert gate.entered.wait(10)
            gate.opened.set()
            raise KeyError("the request was cancelled")  # abandon waits for the captures in flight
        assert all(h.done() and h.result().ok for h in hs)
        for h in hs:  # each was dropped: nothing left pending to commit
            with pytest.raises(ss.SnapstoreError):
                s.commit(h.result())
        assert s.match(TOKENS[:N]) is None
