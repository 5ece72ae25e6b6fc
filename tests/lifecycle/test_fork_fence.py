"""Issue 23 item 5, the child's own store: a fork waits (bounded) for the threads inside SQLite, so
a child that opens a Store of its own never meets a SQLite mutex a parent thread held at the fork.
Real threads, fork() and SQLite; the order of events is read from CLOCK_MONOTONIC, which parent and
child share."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from support import LAYOUT, make_state, open_store
from test_async_fork import _fork

from snapstore.catalog import fence


def _child_opens_its_own_store(path: str, started: int) -> None:
    """The child: report when it runs, then open a Store of its own and use it."""
    os.write(started, repr(time.monotonic()).encode())
    os.close(started)
    s = open_store(path)
    toks = np.arange(40, dtype=np.uint64) + 7
    s.save(toks, make_state(LAYOUT, 40, seed=3), parent=None)
    assert s.match(toks) is not None
    s.close()


def test_fork_waits_for_a_parent_thread_inside_a_catalog_call(store_dir: str) -> None:
    s = open_store(store_dir)
    s.save(np.arange(20, dtype=np.uint64), make_state(LAYOUT, 20, seed=1), parent=None)
    inside, ended = threading.Event(), []

    def slow_read() -> None:
        def fn(t: object) -> None:
            inside.set()
            time.sleep(0.5)  # inside SQLite's read transaction, as a long match or verify would be

        s._repo.db.read(fn)
        ended.append(time.monotonic())

    t = threading.Thread(target=slow_read)
    t.start()
    assert inside.wait(10)
    r, w = os.pipe()
    code = _fork(lambda: _child_opens_its_own_store(os.path.join(store_dir, "child"), w))
    os.close(w)
    child_started = float(os.read(r, 64).decode())
    os.close(r)
    t.join(10)
    assert code == 0
    assert ended and child_started >= ended[0], "the fork did not wait for the thread inside SQLite"
    s.close()


def test_fork_goes_ahead_when_a_thread_stays_inside_longer_than_the_bound(
        store_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A statement that outlasts SNAPSTORE_FORK_WAIT_MS (here one that waits for the fork itself)
    delays the fork by the bound only, with a warning; without the bound this would never return."""
    monkeypatch.setenv("SNAPSTORE_FORK_WAIT_MS", "200")
    assert fence.wait_ms() == 200
    s = open_store(store_dir)
    inside, forked = threading.Event(), threading.Event()

    def stuck_read() -> None:
        def fn(t: object) -> None:
            inside.set()
            forked.wait(30)

        s._repo.db.read(fn)

    t = threading.Thread(target=stuck_read)
    t.start()
    try:
        assert inside.wait(10)
        with caplog.at_level("WARNING", logger="snapstore"):
            assert _fork(lambda: None) == 0
        assert any("still inside SQLite" in rec.getMessage() for rec in caplog.records)
    finally:
        forked.set()
        t.join(10)
    s.close()


def test_a_thread_forking_from_inside_a_catalog_call_does_not_wait_for_itself(store_dir: str) -> None:
    s = open_store(store_dir)
    codes: list[int] = []
    s._repo.db.read(lambda t: codes.append(_fork(lambda: None)))
    assert codes == [0]
    s.close()
