"""Child-process workers and the shared workload model of the reliability campaigns.

Run as a script: ``python tests/helpers_proc.py MODE STORE_DIR SEED [...]``.

The workload is support.Workload's (:data:`WORKLOAD`): conversation ``k`` has a fixed token
sequence whose first token is ``k``, and a snapshot after ``n`` of its tokens has deterministic
contents (:func:`expected_state`), so the parent can check any snapshot it finds in a store from its
tokens alone, without trusting anything the child said. Row-stream rows depend only on (k, row), so
a delta over any prefix is a valid delta.

Modes:

``crash``   loop forever: save (committed, pending then commit/abandon, whole or delta, with and
            without a session; also with wait=False: acknowledged once its handle is done, its fixed
            parts zeroed right after the call returns), match+restore, gc(grace=0); print ``A <sid> <k> <n>`` on stdout
            (one ``os.write``) after every acknowledged save. ``SNAPSTORE_TEST_CRASH_AT=name:N:when``
            makes the child SIGKILL itself at the N-th call of ``name`` (``fsync``, ``write``,
            ``link``, ``unlink``, ``txn`` = inside a metadata transaction before COMMIT, ``dbwrite`` =
            a metadata transaction that has committed), ``when`` = ``before`` or ``after`` the call.
``conc``    threads doing a mixed workload for a while; prints one JSON line of totals at the end.
``power``   records every file-system event of a few saves (Python os calls + a recording SQLite
            VFS) to a JSON-lines log for the power-loss model (tests/reliability/test_power_loss.py).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from support import IDENT, LAYOUT, Workload, make_state, small_budget, store_factory  # noqa: E402

import snapstore as ss  # noqa: E402

# The campaigns' workload: six conversations of up to 320 tokens, 16 values a byte (compressible).
N_CONV = 6
STEP = 16
MAX_N = 320
CHUNK = 4096
STAGING = 65536
DISK = 256 * 1024
WORKLOAD = Workload(LAYOUT, conversations=N_CONV, max_tokens=MAX_N, levels=16)
conv_tokens = WORKLOAD.tokens
identify = WORKLOAD.identify
_open = store_factory(chunk_bytes=CHUNK, staging_bytes=STAGING, check_rows=True)
__all__ = ["IDENT", "LAYOUT", "make_state"]  # re-exported for the tests that import them from here


def budget(disk: int = DISK) -> ss.Budget:
    return small_budget(disk)


def open_store(path: str, disk: int = DISK, **kw: Any) -> ss.Store:
    return _open(path, disk=disk, **kw)


def expected_state(k: int, n: int) -> dict[str, np.ndarray]:
    """The parts of conversation k after n tokens (row streams hold exactly n rows)."""
    return WORKLOAD.state(k, n)


def check_restore(store: ss.Store, ref: Any, k: int, n: int) -> None:
    """Restore ``ref`` into fresh buffers and assert every byte equals the model."""
    want = expected_state(k, n)
    into = {name: np.full_like(v, 0x5A) for name, v in want.items()}
    res = store.restore(ref, into=into)
    assert res.n_tokens == n, (res.n_tokens, n)
    assert not res.missing_components, res.missing_components
    for name, v in want.items():
        assert into[name].tobytes() == v.tobytes(), f"part {name} of conversation {k} at {n} differs"


def snapshot_tokens(store: ss.Store, sid: int) -> np.ndarray:
    """Tokens of a snapshot (through the catalog; tests only)."""
    from snapstore.plan.match import tokens_of
    return store._repo.db.read(lambda c: tokens_of(c.chain(sid)))


# -- fault injection ------------------------------------------------------------------------------
def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)


def install_crash_point(spec: str) -> None:
    """Make this process SIGKILL itself at the N-th call of a function (see module docstring)."""
    name, nth_s, when = spec.split(":")
    nth = int(nth_s)
    lock = threading.Lock()
    count = [0]

    def hit() -> bool:
        with lock:
            count[0] += 1
            return count[0] == nth

    def wrap(orig: Any) -> Any:
        def inner(*a: Any, **kw: Any) -> Any:
            fire = hit()
            if fire and when == "before":
                _die()
            r = orig(*a, **kw)
            if fire:
                _die()
            return r
        return inner

    if name in ("fsync", "write", "link", "unlink", "replace"):
        setattr(os, name, wrap(getattr(os, name)))
    elif name == "txn":
        from snapstore.catalog.db import Database
        orig_write = Database.write_collect
        orig_writing = Database.writing  # a save's transaction: a block (Database.writing), not a callback

        @contextmanager
        def writing(self: Any) -> Iterator[Any]:
            with orig_writing(self) as t:
                fire = hit()
                if fire and when == "before":
                    _die()
                yield t
                if fire:
                    _die()  # the block's statements ran, COMMIT did not

        def write(self: Any, fn: Any, **kw: Any) -> Any:
            def body(c: Any) -> Any:
                fire = hit()
                if fire and when == "before":
                    _die()
                r = fn(c)
                if fire:
                    _die()  # the transaction's statements ran, COMMIT did not
                return r
            return orig_write(self, body, **kw)
        Database.write_collect = write  # type: ignore[method-assign]
        Database.writing = writing  # type: ignore[method-assign]
    elif name == "dbwrite":
        from snapstore.catalog.db import Database
        Database.write_collect = wrap(Database.write_collect)  # type: ignore[method-assign]
        whole = Database.writing

        @contextmanager
        def writing_whole(self: Any) -> Iterator[Any]:
            fire = hit()
            if fire and when == "before":
                _die()
            with whole(self) as t:
                yield t
            if fire:
                _die()  # committed
        Database.writing = writing_whole  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown crash point {spec}")


# -- crash mode -----------------------------------------------------------------------------------
_RAW_WRITE = os.write  # bound before any crash point wraps os.write


def _say(line: str) -> None:
    _RAW_WRITE(1, (line + "\n").encode())  # one write(2) < PIPE_BUF: a line is whole or absent


def crash_loop(path: str, seed: int) -> None:
    spec = os.environ.get("SNAPSTORE_TEST_CRASH_AT", "")
    if spec:
        install_crash_point(spec)
    rng = np.random.default_rng(seed)
    store = open_store(path)
    _say("R")
    inflight: list[tuple[Any, int, int]] = []  # saves made with wait=False: acknowledged once done
    while True:
        for h, hk, hn in [x for x in inflight if x[0].done()]:
            inflight.remove((h, hk, hn))
            if h.exception() is None and h.result().snapshot_id is not None:
                _say(f"A {h.result().snapshot_id} {hk} {hn}")
        op = rng.random()
        k = int(rng.integers(N_CONV))
        n = int(rng.integers(1, MAX_N // STEP + 1)) * STEP
        if rng.random() < 0.2:
            n -= int(rng.integers(1, STEP))  # off-boundary lengths too
        toks = conv_tokens(k)[:n]
        session = f"s{k}" if rng.random() < 0.5 else None
        if op < 0.15:  # off the engine's path; the fixed parts are overwritten as soon as it returns
            state = expected_state(k, n)
            h = store.save(toks, state, session=session, wait=False)
            for name in LAYOUT.fixed:
                state[name][...] = 0
            inflight.append((h, k, n))
        elif op < 0.45:
            parent = None if rng.random() < 0.2 else "auto"
            r = store.save(toks, expected_state(k, n), session=session, parent=parent)
            if r.snapshot_id is not None:
                _say(f"A {r.snapshot_id} {k} {n}")
        elif op < 0.65:
            r = store.save(toks, expected_state(k, n), session=session, commit=False)
            if r.snapshot_id is not None:
                if rng.random() < 0.6:
                    c = store.commit(r)
                    if c.snapshot_id is not None:
                        _say(f"A {c.snapshot_id} {k} {n}")
                else:
                    store.abandon(r)
        elif op < 0.85:
            m = store.match(toks)
            if m is not None:
                try:
                    check_restore(store, m, k, m.n_tokens)
                except ss.SnapshotUnavailableError:
                    pass
        else:
            store.gc(grace=0)


# -- concurrency mode -----------------------------------------------------------------------------
CONC_CODECS = ("raw", "zstd", "zstd-shuffle2")  # worker seed % 3: writers of different codecs, one store


def conc_worker(path: str, seed: int, seconds: float, threads: int, disk: int, ack_path: str) -> None:
    store = open_store(path, disk=disk, codec=CONC_CODECS[seed % len(CONC_CODECS)])
    stop = time.monotonic() + seconds
    totals = {"ops": 0, "saves": 0, "acked": 0, "restores": 0, "matches": 0, "gc": 0, "commits": 0,
              "abandons": 0, "skipped": 0, "unavailable": 0, "errors": 0, "budget_samples": 0,
              "budget_exceeded": 0}
    errors: list[str] = []
    lock = threading.Lock()
    ack = open(ack_path, "a", buffering=1)

    def bump(key: str, d: int = 1) -> None:
        with lock:
            totals[key] += d

    def run(tid: int) -> None:
        rng = np.random.default_rng(seed * 100 + tid)
        while time.monotonic() < stop:
            try:
                op = rng.random()
                k = int(rng.integers(N_CONV))
                n = int(rng.integers(1, MAX_N // STEP + 1)) * STEP
                toks = conv_tokens(k)[:n]
                if op < 0.35:
                    r = store.save(toks, expected_state(k, n), session=f"s{k}" if rng.random() < 0.5 else None)
                    bump("saves")
                    if r.snapshot_id is None:
                        bump("skipped")
                    else:
                        with lock:
                            ack.write(f"{r.snapshot_id} {k} {n}\n")
                            totals["acked"] += 1
                elif op < 0.45:
                    r = store.save(toks, expected_state(k, n), commit=False)
                    bump("saves")
                    if r.snapshot_id is not None:
                        if rng.random() < 0.5:
                            c = store.commit(r)
                            bump("commits")
                            if c.snapshot_id is not None:
                                with lock:
                                    ack.write(f"{c.snapshot_id} {k} {n}\n")
                                    totals["acked"] += 1
                        else:
                            store.abandon(r)
                            bump("abandons")
                elif op < 0.85:
                    m = store.match(toks)
                    bump("matches")
                    if m is not None:
                        try:
                            check_restore(store, m, k, m.n_tokens)
                            bump("restores")
                        except ss.SnapshotUnavailableError:
                            bump("unavailable")  # evicted between match and restore: legitimate
                elif op < 0.9:
                    store.gc(grace=float(os.environ.get("SNAPSTORE_TEST_GC_GRACE", "2")))
                    bump("gc")
                else:
                    st = store.stats()
                    bump("budget_samples")
                    if st.stored_bytes > disk:
                        bump("budget_exceeded")
                        with lock:
                            errors.append(f"stored_bytes {st.stored_bytes} > budget {disk}")
                bump("ops")
            except Exception as e:  # every error counts; the parent asserts there are none
                import traceback
                bump("errors")
                with lock:
                    errors.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    store.close()
    ack.close()
    totals["error_messages"] = errors[:5]  # type: ignore[assignment]
    print(json.dumps(totals), flush=True)


# -- power mode -----------------------------------------------------------------------------------
def power_record(path: str, seed: int, log_path: str, n_ops: int) -> None:
    """Record every durable-relevant file-system event of a workload on a fresh store."""
    import apsw

    root = os.path.abspath(path)
    log = open(log_path, "w")
    lock = threading.RLock()
    fd_path: dict[int, str] = {}

    def emit(ev: dict[str, Any]) -> None:
        with lock:
            log.write(json.dumps(ev) + "\n")

    def inside(p: Any) -> bool:
        try:
            return os.path.abspath(os.fsdecode(p)).startswith(root)
        except TypeError:
            return False

    real = {n: getattr(os, n) for n in ("open", "write", "fsync", "close", "link", "unlink", "replace",
                                        "rename", "mkdir", "ftruncate", "utime")}

    def p_open(p: Any, flags: int, mode: int = 0o777, *a: Any, **kw: Any) -> int:
        with lock:
            fd = real["open"](p, flags, mode, *a, **kw)
            if inside(p):
                ap = os.path.abspath(os.fsdecode(p))
                fd_path[fd] = ap
                if flags & os.O_CREAT:
                    emit({"op": "create", "path": ap, "excl": bool(flags & os.O_EXCL)})
            return fd

    def p_write(fd: int, data: Any) -> int:
        with lock:
            n = real["write"](fd, data)
            if fd in fd_path:
                emit({"op": "append", "path": fd_path[fd], "data": base64.b64encode(bytes(data)[:n]).decode()})
            return n

    def p_fsync(fd: int) -> None:
        with lock:
            real["fsync"](fd)
            if fd in fd_path:
                emit({"op": "fsync", "path": fd_path[fd]})

    def p_close(fd: int) -> None:
        with lock:
            fd_path.pop(fd, None)
            real["close"](fd)

    def p_ftruncate(fd: int, size: int) -> None:  # a direct-I/O chunk: aligned write, then truncate
        with lock:
            real["ftruncate"](fd, size)
            if fd in fd_path:
                emit({"op": "truncate", "path": fd_path[fd], "size": size})

    def p_link(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        with lock:
            real["link"](src, dst, *a, **kw)
            if inside(dst):
                emit({"op": "link", "src": os.path.abspath(src), "dst": os.path.abspath(dst)})

    def p_unlink(p: Any, *a: Any, **kw: Any) -> None:
        with lock:
            real["unlink"](p, *a, **kw)
            if inside(p):
                emit({"op": "unlink", "path": os.path.abspath(p)})

    def p_rename(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        with lock:
            real["replace"](src, dst, *a, **kw)
            if inside(dst):
                emit({"op": "rename", "src": os.path.abspath(src), "dst": os.path.abspath(dst)})

    def p_mkdir(p: Any, mode: int = 0o777, *a: Any, **kw: Any) -> None:
        with lock:
            real["mkdir"](p, mode, *a, **kw)
            if inside(p):
                emit({"op": "mkdir", "path": os.path.abspath(p)})

    os.open, os.write, os.fsync, os.close = p_open, p_write, p_fsync, p_close  # type: ignore[assignment]
    os.ftruncate = p_ftruncate  # type: ignore[assignment]
    os.link, os.unlink, os.replace, os.rename, os.mkdir = (  # type: ignore[assignment]
        p_link, p_unlink, p_rename, p_rename, p_mkdir)

    class RecFile(apsw.VFSFile):
        def __init__(self, filename: Any, flags: list[int]):
            self.path = os.path.abspath(filename.filename() if hasattr(filename, "filename") else filename)
            self.wal = bool(flags[0] & (apsw.SQLITE_OPEN_WAL | apsw.SQLITE_OPEN_MAIN_JOURNAL))
            self.synced = False
            super().__init__("unix", filename, flags)
            if flags[0] & apsw.SQLITE_OPEN_CREATE and inside(self.path):
                emit({"op": "create", "path": self.path, "excl": False})

        def xWrite(self, data: bytes, offset: int) -> None:
            super().xWrite(data, offset)
            if inside(self.path) and not self.path.endswith("-shm"):
                emit({"op": "pwrite", "path": self.path, "off": offset, "data": base64.b64encode(data).decode()})

        def xTruncate(self, size: int) -> None:
            super().xTruncate(size)
            if inside(self.path):
                emit({"op": "truncate", "path": self.path, "size": size})

        def xSync(self, flags: int) -> None:
            super().xSync(flags)
            if inside(self.path):
                emit({"op": "fsync", "path": self.path})
                if self.wal and not self.synced:  # SQLite fsyncs the directory of a new WAL/journal
                    emit({"op": "fsync", "path": os.path.dirname(self.path)})
            self.synced = True

    class RecVFS(apsw.VFS):
        def __init__(self) -> None:
            super().__init__("snapstore-rec", "unix", makedefault=True)

        def xOpen(self, name: Any, flags: list[int]) -> RecFile:
            return RecFile(name, flags)

        def xDelete(self, name: str, syncdir: bool) -> None:
            super().xDelete(name, syncdir)
            p = os.path.abspath(name)
            if inside(p):
                emit({"op": "unlink", "path": p})
                if syncdir:
                    emit({"op": "fsync", "path": os.path.dirname(p)})

    vfs = RecVFS()
    rng = np.random.default_rng(seed)
    emit({"op": "mark", "what": "open"})
    store = open_store(path, disk=96 * 1024)
    for _ in range(n_ops):
        op = rng.random()
        k = int(rng.integers(3))
        n = int(rng.integers(1, MAX_N // STEP + 1)) * STEP
        toks = conv_tokens(k)[:n]
        if op < 0.7:
            r = store.save(toks, expected_state(k, n), session=f"s{k}" if rng.random() < 0.5 else None)
            if r.snapshot_id is not None:
                emit({"op": "ack", "sid": r.snapshot_id, "k": k, "n": n})
        elif op < 0.85:
            r = store.save(toks, expected_state(k, n), commit=False)
            if r.snapshot_id is not None:
                c = store.commit(r)
                if c.snapshot_id is not None:
                    emit({"op": "ack", "sid": c.snapshot_id, "k": k, "n": n})
        else:
            store.gc(grace=0)
    store.close()
    emit({"op": "mark", "what": "closed"})
    log.close()
    vfs.unregister()


def main(argv: list[str]) -> None:
    mode, path, seed = argv[0], argv[1], int(argv[2])
    if mode == "crash":
        crash_loop(path, seed)
    elif mode == "conc":
        conc_worker(path, seed, float(argv[3]), int(argv[4]), int(argv[5]), argv[6])
    elif mode == "power":
        power_record(path, seed, argv[3], int(argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
