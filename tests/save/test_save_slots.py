"""The save pipeline's staging slots, freed once a chunk's O_DIRECT write returned (before its
fsync and link): what must still hold after that point, on real files and threads."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from support import store_factory

import snapstore as ss

MIB = 1 << 20
BIG = ss.Layout(fixed={"run": ss.Fixed("uint8", (4 * MIB,))}, rows={"kv": ss.Rows("uint8", (64 * 1024,))})
_open_big = store_factory(layout=BIG, chunk_bytes=4 * MIB, staging_bytes=16 * MIB,
                          budget=ss.Budget(reserve_bytes=0, ram_bytes=0), check_rows=None)


def _state(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"run": rng.integers(0, 256, 4 * MIB, dtype=np.uint8),
            "kv": rng.integers(0, 256, (n, 64 * 1024), dtype=np.uint8)}


class _Reader:
    """A part that is not a host buffer (``PartReader``): records the thread of every read."""

    def __init__(self, arr: np.ndarray):
        self.arr, self.nbytes, self.reads = arr, arr.nbytes, 0
        self.threads: set[int] = set()

    def read_into(self, offset: int, out: memoryview) -> None:
        self.threads.add(threading.get_ident())
        self.reads += 1
        out[:] = self.arr.reshape(-1).data[offset:offset + len(out)]


@pytest.mark.parametrize("reader", [False, True], ids=["host", "reader"])
def test_a_temp_file_gc_removes_after_its_direct_write_is_written_again(
        store_dir: str, monkeypatch: pytest.MonkeyPatch, reader: bool) -> None:
    """gc with no grace period removes a chunk's temp file after its O_DIRECT write returned (here:
    during its fsync), before its link. The save writes that chunk again and succeeds, as it did
    before slots were freed at the write (then the slot still held the bytes; once freed, main
    raised the ENOENT out of save())."""
    from snapstore.lifecycle.gc import temp_files

    real_fsync = os.fsync
    removed: list[str] = []
    lock = threading.Lock()

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        with lock:
            if removed or not os.path.basename(path).startswith("w-"):
                return
            # what gc(grace=0) removes at this moment: this chunk's temp file (and any other in flight)
            for p in temp_files(repo, time.time(), 0):
                if p == path:
                    os.unlink(p)
                    removed.append(p)

    state = _state(256, 21)  # 5 chunks of 4 MiB, 4 slots
    with _open_big(store_dir) as s:
        repo: Any = s._repo
        monkeypatch.setattr(os, "fsync", fsync)
        parts: dict[str, Any] = dict(state)
        if reader:
            parts = {k: _Reader(v) for k, v in state.items()}
        r = s.save(list(range(256)), parts)
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert removed and s._chunker.direct  # the window was hit, on the O_DIRECT path
        if reader:  # one chunk read again, on the saving thread only (docs/api.md, the reader contract)
            assert sum(p.reads for p in parts.values()) == 5 + 1
            assert set().union(*(p.threads for p in parts.values())) == {threading.get_ident()}
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(s.match(list(range(256))) or r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)


_NO_MEMORY_CHILD = r"""
import resource, sys, threading, numpy as np, snapstore as ss
lay = ss.Layout(fixed={"run": ss.Fixed("uint8", (1 << 20,))}, rows={"kv": ss.Rows("uint8", (4096,))})
s = ss.Store.open(sys.argv[1], identity=ss.Identity(build="t", pack="p"), layout=lay, chunk_bytes=4 << 20,
                  staging_bytes=64 << 20, budget=ss.Budget(reserve_bytes=0, ram_bytes=0))
rng = np.random.default_rng(1)
state = {"run": rng.integers(0, 256, 1 << 20, dtype=np.uint8), "kv": rng.integers(0, 256, (2048, 4096), dtype=np.uint8)}
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
errors = []
for attempt in range(6):  # more failed saves than the staging buffer has slots
    resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), hard))  # no room for 64 MiB of staging
    try:
        s.save(list(range(2048)), state)
        errors.append("saved")
    except BaseException as e:
        errors.append(type(e).__name__ + ":" + str(getattr(e, "errno", "")))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
print("ERRORS", ",".join(errors), flush=True)
done = []
t = threading.Thread(target=lambda: done.append(s.save(list(range(2048)), state)), daemon=True)
t.start()
t.join(30)
print("SAVED" if done and done[0].ok else "HUNG", flush=True)
if done:
    out = {k: np.zeros_like(v) for k, v in state.items()}
    s.restore(done[0], out)
    print("EXACT" if all(np.array_equal(out[k], state[k]) for k in state) else "WRONG", flush=True)
"""


def test_a_staging_buffer_that_cannot_be_allocated_fails_the_save_clearly_and_loses_no_slot(tmp_path: Any) -> None:
    """A save whose staging buffer cannot be allocated (a real address-space limit, in a child)
    raises StoreIOError(ENOMEM) with what to do, again and again, and takes no slot: once memory is
    back the next save runs (the old code raised a bare MemoryError and lost a slot each time, so
    after as many failures as slots every later save waited for a slot forever)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _NO_MEMORY_CHILD, str(tmp_path / "s")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in r.stdout.splitlines())
    assert "ERRORS" in lines, r.stdout + r.stderr
    assert lines["ERRORS"].split(",") == ["StoreIOError:12"] * 6, lines["ERRORS"]
    assert "SAVED" in lines and "EXACT" in lines, r.stdout + r.stderr


def test_an_interrupted_save_returns_only_once_no_chunk_job_is_left_running(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt (KeyboardInterrupt) while the save awaits the oldest chunk of a full window: it
    reaches the caller only once that chunk's job is done too, so nothing of the save still reads
    the engine's buffer or writes a slot after save() has raised (the old code had already taken the
    awaited job off its list and left it running)."""
    from snapstore.save import chunker as _chunker
    go, lock = threading.Event(), threading.Lock()
    running, hashed = [0], [0]
    real_one, real_taken = _chunker.Chunker._one, _chunker._taken

    def one(self: Any, *a: Any, **k: Any) -> Any:
        with lock:
            running[0] += 1
        try:
            return real_one(self, *a, **k)
        finally:
            with lock:
                running[0] -= 1

    def hook(stage: str, chunker: Any, cid: bytes) -> None:
        if stage == "hashed":
            with lock:
                hashed[0] += 1
                first = hashed[0] == 1
            if first:
                go.wait(5)  # the first chunk's job stays in flight

    def taken(*a: Any) -> Any:
        threading.Timer(0.3, go.set).start()
        monkeypatch.setattr(_chunker, "_taken", real_taken)
        raise KeyboardInterrupt

    monkeypatch.setattr(_chunker.Chunker, "_one", one)
    monkeypatch.setattr(_chunker, "_TEST_HOOK", hook)
    monkeypatch.setattr(_chunker, "_taken", taken)
    state = _state(640, 4)  # 11 chunks of 4 MiB: more than the window of 8 (4 slots)
    with _open_big(store_dir) as s:
        with pytest.raises(KeyboardInterrupt):
            s.save(list(range(640)), state)
        with lock:
            assert running[0] == 0, "a chunk job of the interrupted save was still running"
        go.set()
        monkeypatch.setattr(_chunker, "_TEST_HOOK", None)
        r = s.save(list(range(640)), state)  # the store is usable and the next save exact
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
