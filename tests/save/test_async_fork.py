"""Issue 23, items 1, 4, 5: what a save made with ``wait=False`` borrows from its caller, a Store
dropped unclosed after one, and a forked child's copy of a Store in use. Real files, threads, fork()."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import apsw
import numpy as np
import pytest
from support import LAYOUT, empty_like_state, make_state, open_store, part_hashes
from support.fds import open_targets

import snapstore as ss
from snapstore import _tokens
from snapstore.plan import fit as _layout_fit
from snapstore.save import chunker as _chunker


def toks(n: int, base: int = 1000) -> np.ndarray:
    return np.arange(base, base + n, dtype="<u8")


class _PausedWriter:
    """Holds a background save inside its first chunk (the chunker's test hook) until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.entered, self.opened = threading.Event(), threading.Event()
        main = threading.get_ident()

        def hook(stage: str, chunker: Any, cid: bytes) -> None:
            if stage == "hashed" and threading.get_ident() != main:
                self.entered.set()
                self.opened.wait(30)

        monkeypatch.setattr(_chunker, "_TEST_HOOK", hook)


# -- item 1: tokens are the call's, not the caller's buffer -------------------------------------------
def test_async_save_copies_a_uint64_token_array_the_caller_reuses(store_dir: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's scenario: an engine reuses its uint64 token array for the next request right after
    ``save(wait=False)`` returned. The save was indexed under the new prompt, whose match() then
    restored the first request's state with no error."""
    paused = _PausedWriter(monkeypatch)
    state_a, state_0 = make_state(LAYOUT, 40, seed=1), make_state(LAYOUT, 30, seed=7)
    with open_store(store_dir) as s:
        first = s.save(toks(30, base=5000), state_0, wait=False)  # holds the writer thread
        assert paused.entered.wait(10)
        buf = toks(40)  # request A's prompt, in the engine's reused array
        h = s.save(buf, state_a, parent=None, wait=False)
        buf[:] = toks(40, base=9000)  # the engine moves on to request B in the same array
        paused.opened.set()
        assert first.result(30).ok and h.result(30).ok
        assert s.match(toks(40, base=9000)) is None  # B never sees A's state
        m = s.match(toks(40))
        assert m is not None and (m.snapshot_id, m.n_tokens) == (h.result().snapshot_id, 40)
        dest = empty_like_state(state_a)
        out = s.restore(m, dest)
        assert part_hashes(LAYOUT, dest, out.rows) == part_hashes(LAYOUT, state_a, out.rows)


# -- item 4: a Store dropped unclosed after an async save -----------------------------------------------
def _lock_is_free(path: str) -> bool:
    """Whether nobody holds the flock of the owner lock file at ``path`` (a new open file description
    conflicts with the store's own, in this process too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _gone(ref: weakref.ref[Any], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return ref() is None


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


@pytest.mark.parametrize("fails", [False, True], ids=["saved", "failed"])
def test_store_dropped_unclosed_after_an_async_save_is_collected(store_dir: str, fails: bool) -> None:
    """The writer thread's frame kept its last job and the job the Store: the owner lock stayed held,
    the lease renewed and the pending capture pinned for the life of the process. A failed save's
    handle (kept by the caller) held the Store too, through its error's traceback."""
    open_store(store_dir).close()
    writers = len(_threads("snapstore-save"))
    s = open_store(store_dir, drop_stale=False)
    pending = s.save(toks(20, base=3000), make_state(LAYOUT, 20, seed=3), commit=False)
    lock = os.path.join(store_dir, "owners", s._lease_owner.id + ".lock")
    h = s.save(toks(24), make_state(LAYOUT, 24, seed=4), parent=10**9 if fails else "auto", wait=False)
    if fails:
        assert isinstance(h.exception(30), ss.NotFoundError)
    else:
        assert h.result(30).ok
    ref = weakref.ref(s)
    del s
    assert _gone(ref), "the Store stayed alive after it was dropped"
    assert _lock_is_free(lock)
    deadline = time.monotonic() + 10
    while len(_threads("snapstore-save")) > writers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_threads("snapstore-save")) == writers  # its writer thread ended
    with open_store(store_dir, drop_stale=False) as again:  # another opener sees the owner dead
        assert again.stats().pending == 0
        assert all(i.snapshot_id != pending.snapshot_id for i in again.snapshots())
    assert h.done() and (h.exception() is not None) == fails  # the caller's handle still answers


def test_queued_async_saves_complete_after_their_store_is_dropped(store_dir: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A save queued before the Store was dropped still lands: the queue keeps the Store alive
    only until it is empty, then lets it go."""
    paused = _PausedWriter(monkeypatch)
    s = open_store(store_dir)
    handles = [s.save(toks(16 + k, base=100 * k), make_state(LAYOUT, 16 + k, seed=k), parent=None, wait=False)
               for k in range(3)]
    assert paused.entered.wait(10)
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is not None  # its saves are still queued
    paused.opened.set()
    assert all(h.result(30).ok for h in handles)
    assert _gone(ref)
    with open_store(store_dir) as again:
        assert all(again.match(toks(16 + k, base=100 * k)) is not None for k in range(3))


# -- item 5: a forked child's copy --------------------------------------------------------------------
def _fork(child: Callable[[], None], timeout: float = 30.0) -> int:
    """Run ``child`` in a forked process; its exit code (0: returned, 1: raised). Kills it (by its
    pid) and fails when it hangs."""
    pid = os.fork()
    if pid == 0:  # never returns into pytest
        code = 1
        try:
            child()
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported by the exit code and on stderr
            os.write(2, f"child: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} hung for {timeout} s")


def _store_fds(path: str) -> list[str]:
    """What this process holds open of the store's own files: the catalog and the owner locks (a
    temp file a parent thread was writing at the fork is that thread's, not the Store's)."""
    root = os.path.realpath(path)
    return [t for t in open_targets() if os.path.relpath(t, root).startswith(("snapstore.db", "owners"))]


def _closes_promptly(s: ss.Store, path: str) -> Callable[[], None]:
    """The child's part: close() returns at once and leaves none of the store's files open here."""
    def child() -> None:
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 5
        assert _store_fds(path) == []
        s.close()  # idempotent here too
    return child


class _GatedReader:
    """A save source that blocks in read_into until released: a call held in flight."""

    def __init__(self, data: bytes):
        self.data, self.nbytes = data, len(data)
        self.entered, self.go = threading.Event(), threading.Event()

    def read_into(self, offset: int, out: memoryview) -> None:
        self.entered.set()
        assert self.go.wait(30)
        out[:] = self.data[offset:offset + len(out)]


def test_forked_child_closes_while_a_parent_thread_is_inside_a_call(store_dir: str) -> None:
    """The issue's scenario: the child inherited the count of calls in flight, and its close()
    waited forever for a call that does not exist in it. Under load it still hung in about 1 run of
    20 after that was fixed: SQLite's allocator mutex, copied locked from a parent thread inside
    SQLite, entered by the child freeing an inherited connection (inside os.fork(), see the next test)."""
    s = open_store(store_dir)
    st = make_state(LAYOUT, 20, seed=9)
    src = _GatedReader(st["attn.kv"].tobytes())
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(s.save(toks(20), dict(st, **{"attn.kv": src}))))
    t.start()
    try:
        assert src.entered.wait(10)
        assert _fork(_closes_promptly(s, store_dir)) == 0
    finally:
        src.go.set()
        t.join(30)
    assert box and box[0].ok  # the parent's call finished; its store is whole
    dest = empty_like_state(st)
    out = s.restore(s.match(toks(20)), dest)
    assert part_hashes(LAYOUT, dest, out.rows) == part_hashes(LAYOUT, st, out.rows)
    s.close()


def test_forked_child_never_enters_sqlite_for_a_connection_it_inherited(store_dir: str) -> None:
    """The root cause of the hang above (a stack of the hung child: os.fork() -> CPython freeing a
    parent thread's locals -> _Held.__del__ -> sqlite3_close -> sqlite3_free -> a process-wide SQLite
    mutex a parent thread held at the fork). No SQLite call on an inherited connection can be safe in
    the child, so none may happen: not when CPython drops the parent threads' locals inside os.fork(),
    not in close(), not at exit. Watched with SQLite's own close trace, which fires in whichever
    process closes the connection."""
    s = open_store(store_dir)
    s.save(toks(20), make_state(LAYOUT, 20, seed=12))  # this (the forking) thread's connection
    ready, go = threading.Event(), threading.Event()

    def idle() -> None:  # a parent thread with a connection of its own, alive at the fork, in no call
        s._repo.db.conn()
        ready.set()
        go.wait(30)

    t = threading.Thread(target=idle)
    t.start()
    closed: list[int] = []  # the pid of each process that closed one of the watched connections
    try:
        assert ready.wait(10)
        conns = [h.conn for h in list(s._repo.db._all)]
        assert len(conns) >= 2
        for c in conns:
            c.trace_v2(apsw.SQLITE_TRACE_CLOSE, lambda _: closed.append(os.getpid()))

        def child() -> None:
            _closes_promptly(s, store_dir)()
            assert closed == [], f"the child closed {len(closed)} inherited SQLite connection(s)"
            with pytest.raises(ss.StateError, match="fork"):
                s._repo.db.conn()  # no new connection on the inherited copy either

        assert _fork(child) == 0
    finally:
        go.set()
        t.join(30)
    m = s.match(toks(20))  # the parent's connections are untouched
    assert m is not None
    s.close()
    assert closed and set(closed) == {os.getpid()}


def test_forked_child_never_closes_an_inherited_in_memory_catalog_copy(store_dir: str) -> None:
    """The CLI's private in-memory copy of a catalog (a dry run, inspect) is an SQLite connection
    too: a forked child's close of it abandons it instead of entering SQLite."""
    from snapstore.chunks.repo import SnapshotRepo

    open_store(store_dir).close()
    repo = SnapshotRepo.open(store_dir)
    mem = repo.db.conn()
    closed: list[int] = []
    mem.trace_v2(apsw.SQLITE_TRACE_CLOSE, lambda _: closed.append(os.getpid()))

    def child() -> None:
        repo.close()
        assert closed == []
        with pytest.raises(ss.StateError):
            repo.db.conn()

    assert _fork(child) == 0
    assert repo.db.read(lambda t: t.owners()) is not None  # the parent's copy still answers
    repo.close()
    assert closed == [os.getpid()]


def test_forked_child_with_an_async_save_in_flight(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save(wait=False) running on the parent's writer thread at the fork: the child's close returns,
    and the child's copy of its handle says it cannot be waited on there instead of hanging."""
    paused = _PausedWriter(monkeypatch)
    s = open_store(store_dir)
    h = s.save(toks(20), make_state(LAYOUT, 20, seed=2), wait=False)
    queued = s.save(toks(21, base=7000), make_state(LAYOUT, 21, seed=3), parent=None, wait=False)
    assert paused.entered.wait(10)

    def child() -> None:
        _closes_promptly(s, store_dir)()
        for handle in (h, queued):
            with pytest.raises(ss.StateError, match="fork"):
                handle.result(1)

    try:
        assert _fork(child) == 0
    finally:
        paused.opened.set()
    assert h.result(30).ok and queued.result(30).ok
    s.close()


_HELD: dict[str, Callable[[ss.Store], Any]] = {
    "calls in flight": lambda s: s._gate._cond,
    "async saver": lambda s: s._saver._cv,
    "RAM tier": lambda s: s._ram._lock,
    "catalog connections": lambda s: s._repo.db._lock,
    "save pool": lambda s: s._pool._shutdown_lock,
    "lease": lambda s: s._lease_owner._stop._cond,
}


@contextlib.contextmanager
def _held_by_another_thread(lock: Any) -> Iterator[None]:
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            go.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10)
        yield
    finally:
        go.set()
        t.join(30)


@pytest.mark.parametrize("what", sorted(_HELD))
def test_forked_child_closes_whatever_lock_a_parent_thread_held(store_dir: str, what: str) -> None:
    """Every lock or condition of a Store that a parent thread held at the fork stays held forever in
    the child (the thread is not there to release it): the child's close() must not wait for one."""
    s = open_store(store_dir, budget=ss.Budget(reserve_bytes=0, ram_bytes=1 << 20))
    r = s.save(toks(20), make_state(LAYOUT, 20, seed=5))
    with _held_by_another_thread(_HELD[what](s)):
        assert _fork(_closes_promptly(s, store_dir)) == 0
    assert s.match(toks(20)).snapshot_id == r.snapshot_id  # the parent's copy is untouched
    s.close()


def test_forked_child_refuses_a_save_when_the_parent_held_every_staging_slot(store_dir: str) -> None:
    """A child's save through its inherited copy waited forever for staging slots that parent
    threads held (and for save-pool threads that do not exist in it): it is refused at once."""
    s = open_store(store_dir)
    slots = [s._staging.acquire()[0] for _ in range(s._staging.slots)]

    def child() -> None:
        with pytest.raises(ss.StateError, match="fork"):
            s.match(toks(20))
        with pytest.raises(ss.StateError, match="fork"):
            s.save(toks(20), make_state(LAYOUT, 20, seed=6))
        with pytest.raises(ss.StateError, match="fork"):
            s.flush()
        s.close()

    try:
        assert _fork(child) == 0
    finally:
        for i in slots:
            s._staging.release(i)
    assert s.save(toks(20), make_state(LAYOUT, 20, seed=6)).ok
    s.close()


def test_forked_child_closes_while_a_parent_thread_is_inside_a_catalog_statement(store_dir: str) -> None:
    """A parent thread inside SQLite at the fork (its connection busy): the child's close() does not
    wait for the statement, and releases the child's copies of the catalog's descriptors all the
    same (they stayed open: apsw refused to close a connection another thread was inside)."""
    s = open_store(store_dir)
    held, go = threading.Event(), threading.Event()

    def query() -> None:
        c = s._repo.db.conn()  # this thread's catalog connection
        c.create_scalar_function("hold", lambda: int(held.set() is None and go.wait(30)))
        c.execute("SELECT hold() FROM snapshots UNION ALL SELECT hold()").fetchall()

    t = threading.Thread(target=query)
    t.start()
    try:
        assert held.wait(10)
        assert _fork(_closes_promptly(s, store_dir)) == 0
    finally:
        go.set()
        t.join(30)
    s.close()


_MODULE_LOCKS: dict[str, Callable[[], Any]] = {
    "layout fit answers": lambda: _layout_fit._lock,
    "token chain cache": lambda: _tokens._cache_lock,
}


@pytest.mark.parametrize("what", sorted(_MODULE_LOCKS))
def test_forked_child_opens_its_own_store_whatever_module_lock_a_parent_thread_held(store_dir: str,
                                                                                      what: str) -> None:
    """The child's way forward (a Store of its own) must not hang on a process-wide lock a parent
    thread held at the fork: the layout-fit answers and the token chain cache are shared by every
    Store of the process, and their locks stayed held forever in the child."""
    st = make_state(LAYOUT, 300, seed=11)

    def child() -> None:
        _layout_fit._known.clear()  # the child's first match decides the layout fit again (under its lock)
        with open_store(os.path.join(store_dir, "child")) as s:
            r = s.save(toks(300), st)
            m = s.match(toks(300))
            assert m is not None and m.snapshot_id == r.snapshot_id

    with _held_by_another_thread(_MODULE_LOCKS[what]()):
        assert _fork(child, timeout=20) == 0


def test_forked_child_hashes_a_model_whatever_a_parent_thread_held(tmp_path: Any) -> None:
    """The llama.cpp integration's model-hash cache is process-wide too: a parent thread inside
    file_sha256() at the fork (here: reading a FIFO nobody writes yet) must not stop the child's own
    first hash. The cache once had a lock such a thread left held in the child, which then hung."""
    from snapstore.engine.llamacpp import _identify

    model, fifo = tmp_path / "m.gguf", tmp_path / "slow.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    os.mkfifo(fifo)
    inside = threading.Thread(target=_identify.file_sha256, args=(str(fifo),), daemon=True)
    inside.start()
    time.sleep(0.2)  # the thread is blocked in open()/read() of the FIFO, inside file_sha256

    def child() -> None:
        assert _identify.file_sha256(str(model)) == hashlib.sha256(model.read_bytes()).hexdigest()

    try:
        assert inside.is_alive()
        assert _fork(child, timeout=20) == 0
    finally:
        with open(fifo, "wb"):  # lets the parent's thread finish its (empty) read
            pass
        inside.join(10)
