"""The fast paths of issue 12: RAM-tier admission off the restoring thread, direct I/O saves with a
fallback, saves off the engine's path (wait=False). Speed itself is measured in benchmarks/bench.py;
these tests check the behaviour that makes it possible, on real files and threads."""

from __future__ import annotations

import resource
import threading
from typing import Any

import numpy as np
import pytest

import snapstore as ss
from snapstore import _ramtier

from conftest import IDENT

MIB = 1 << 20
BIG = ss.Layout(fixed={"run": ss.Fixed("uint8", (4 * MIB,))}, rows={"kv": ss.Rows("uint8", (64 * 1024,))})


def _big_state(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"run": rng.integers(0, 256, 4 * MIB, dtype=np.uint8),
            "kv": rng.integers(0, 256, (n, 64 * 1024), dtype=np.uint8)}


def _open_big(path: str, **kw: Any) -> ss.Store:
    kw.setdefault("budget", ss.Budget(reserve_bytes=0, ram_bytes=256 * MIB))
    return ss.Store.open(path, identity=IDENT, layout=BIG, chunk_bytes=4 * MIB, staging_bytes=16 * MIB, **kw)


def _thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_ram_tier_admission_does_not_fault_pages_on_the_restoring_thread(store_dir: str) -> None:
    """The restore that admits a prefix into the RAM tier (its second) touches no fresh memory:
    the copy happens on the admission thread, so it costs the engine nothing."""
    state = _big_state(512)  # 32 MiB of rows + 4 MiB fixed
    with _open_big(store_dir) as s:
        r = s.save(list(range(512)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)  # first: pages of dest faulted in, chunks seen once
        before = _thread_faults()
        s.restore(r, dest)  # second: admits every chunk
        faults = _thread_faults() - before
        # 36 MiB copied on this thread would fault ~9,000 fresh 4 KiB pages
        assert faults < 1000, faults
        assert s._ram is not None and s._ram.drain(30)
        assert s._ram.used == 36 * MIB
        for k in dest:
            dest[k][...] = 0
        s.restore(r, dest)
        assert all(np.array_equal(dest[k], state[k]) for k in state)
        assert s.stats().ram_hits > 0


def test_restore_does_not_wait_for_admission_and_admits_from_the_file(store_dir: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """While admission is paused, restores return; the RAM copy comes from the chunk file, never
    from the destination the engine may overwrite as soon as restore() returns."""
    gate, entered = threading.Event(), threading.Event()

    def hook(cid: bytes) -> None:
        entered.set()
        gate.wait(30)

    monkeypatch.setattr(_ramtier, "_TEST_HOOK", hook)
    state = _big_state(64, 3)
    with _open_big(store_dir) as s:
        r = s.save(list(range(64)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)
        s.restore(r, dest)  # offers the chunks; the admission thread blocks in the hook
        assert entered.wait(10)
        for k in dest:
            dest[k][...] = 0xEE  # the engine moves on and overwrites its buffers
        gate.set()
        assert s._ram is not None and s._ram.drain(30) and s._ram.used > 0
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert s.stats().ram_hits > 0
