"""The fast paths of issue 12: RAM-tier admission off the restoring thread, direct I/O saves with a
fallback, saves off the engine's path (wait=False). Speed itself is measured in benchmarks/bench.py;
these tests check the behaviour that makes it possible, on real files and threads."""

from __future__ import annotations

import gc
import resource
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest
from support import IDENT, LAYOUT, make_state, store_factory
from support.pagecache import cached_pages

import snapstore as ss
from snapstore.restore import ramtier as _ramtier

MIB = 1 << 20
BIG = ss.Layout(fixed={"run": ss.Fixed("uint8", (4 * MIB,))}, rows={"kv": ss.Rows("uint8", (64 * 1024,))})


def _big_state(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"run": rng.integers(0, 256, 4 * MIB, dtype=np.uint8),
            "kv": rng.integers(0, 256, (n, 64 * 1024), dtype=np.uint8)}


_open_big = store_factory(layout=BIG, chunk_bytes=4 * MIB, staging_bytes=16 * MIB,
                          budget=ss.Budget(reserve_bytes=0, ram_bytes=256 * MIB), check_rows=None)


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


def test_admission_waits_until_the_restore_that_triggered_it_returns(store_dir: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No admission work runs while a restore is in flight (it competed with that restore for the
    CPU and the GIL): the admission thread starts on a chunk only once restore() has returned."""
    main = threading.main_thread().ident
    assert main is not None
    overlapped: list[bool] = []

    def hook(cid: bytes) -> None:  # on the admission thread: is the main thread inside a restore?
        frame = sys._current_frames().get(main)
        names = set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        overlapped.append("stream_plan" in names)

    monkeypatch.setattr(_ramtier, "_TEST_HOOK", hook)
    state = _big_state(1024, 5)  # 64 MiB of rows + 4 MiB fixed: 17 chunks, each offered on its 2nd restore
    with _open_big(store_dir) as s:
        r = s.save(list(range(1024)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)
        s.restore(r, dest)
        assert s._ram is not None and s._ram.drain(30)
        assert len(overlapped) == 17 and not any(overlapped), overlapped
        assert s._ram.used == 68 * MIB
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)


_open_small_ram = store_factory(chunk_bytes=64 * 1024, budget=ss.Budget(reserve_bytes=0, ram_bytes=64 * MIB))


class _CountedCondition:
    """A RAM tier's Condition, its notify calls recorded (every other use passed through)."""

    def __init__(self, cond: threading.Condition, name: str, calls: list[str]) -> None:
        self._cond, self._name, self._calls = cond, name, calls

    def __enter__(self) -> bool:
        return self._cond.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cond.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._cond, attr)

    def notify(self, n: int = 1) -> None:
        self._calls.append(self._name)
        self._cond.notify(n)

    def notify_all(self) -> None:
        self._calls.append(self._name)
        self._cond.notify_all()


def test_restores_wake_no_admission_thread(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore's end wakes nobody (issue 48): the admission thread, idle or waiting for a moment with
    no restore in flight, looks for one on its own. Woken by every restore's end, it took the GIL
    from the next one: 1K tokens over 12 links restored back to back in ~230 us, ~140 without the tier."""
    state = make_state(LAYOUT, 640, seed=4)
    with _open_small_ram(store_dir) as s:
        r = s.save(list(range(640)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)
        s.restore(r, dest)  # the second sighting: offered, admitted in the background
        assert s._ram is not None and s._ram.drain(10) and s._ram.used > 0
        calls: list[str] = []
        for name, value in list(vars(s._ram).items()):
            if isinstance(value, threading.Condition):
                monkeypatch.setattr(s._ram, name, _CountedCondition(value, name, calls))
        for _ in range(20):  # replayed from the kept plan, every chunk from the RAM tier
            s.restore(r, dest)
        assert all(dest[k].tobytes() == state[k].tobytes() for k in state)
        assert calls == [], calls
        assert s._hot.replays >= 15


def test_admission_put_off_by_a_restore_goes_on_once_none_is_in_flight(store_dir: str) -> None:
    """Offers made while another restore is in flight wait for it, then are admitted with no wake-up
    from its end: the admission thread looks for a quiet moment on its own."""
    state = make_state(LAYOUT, 640, seed=5)
    with _open_small_ram(store_dir) as s:
        r = s.save(list(range(640)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)
        assert s._ram is not None
        with s._ram.restoring():  # another thread's restore, in flight throughout
            s.restore(r, dest)  # the second sighting: offered
            assert not s._ram.drain(0.2) and s._ram.used == 0  # waiting for the restore in flight
        assert s._ram.drain(10) and s._ram.used > 0
        held = s._ram.hits
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert s._ram.hits > held and all(out[k].tobytes() == state[k].tobytes() for k in state)


def test_a_store_never_without_a_restore_in_flight_still_admits(store_dir: str) -> None:
    """Restores back to back while another is in flight throughout (a server restoring from several
    threads): no moment is quiet, and admission loads a piece anyway once _PATIENCE restores ended
    while it waited. Waiting for quiet alone, it never admitted."""
    state = make_state(LAYOUT, 640, seed=6)
    with _open_small_ram(store_dir) as s:
        r = s.save(list(range(640)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        assert s._ram is not None
        with s._ram.restoring():
            s.restore(r, dest)
            s.restore(r, dest)  # the second sighting: every chunk offered
            for _ in range(4000):
                if s._ram.drain(0):
                    break
                s.restore(r, dest)
            assert s._ram.drain(0) and s._ram.used > 0
        assert all(dest[k].tobytes() == state[k].tobytes() for k in state)
        held = s._ram.hits
        s.restore(r, dest)
        assert s._ram.hits > held


def test_an_admission_thread_that_cannot_start_drops_the_offers_not_the_restore(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process out of threads: the restore that offers succeeds, the offers are dropped (nothing
    left queued for a thread that does not exist: drain() returns), and a later restore offers again
    and is admitted once a thread can start."""
    state = make_state(LAYOUT, 640, seed=7)
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "snapstore-ramtier":
            raise RuntimeError("can't start new thread")
        start(self)

    with _open_small_ram(store_dir) as s:
        r = s.save(list(range(640)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        s.restore(r, dest)  # the second sighting: offered, no thread to admit it
        assert all(dest[k].tobytes() == state[k].tobytes() for k in state)
        assert s._ram is not None and s._ram.drain(1) and s._ram.used == 0
        monkeypatch.setattr(threading.Thread, "start", start)
        s.restore(r, dest)  # a sighting again (the dropped offers forgot theirs)
        s.restore(r, dest)
        assert s._ram.drain(10) and s._ram.used > 0


class _ScribblingWriter:
    """A PartWriter that copies ``data``, as the contract asks, then uses it as scratch where it may."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buf = bytearray(nbytes)
        self.read_only = 0

    def write_from(self, offset: int, data: memoryview) -> None:
        self.buf[offset:offset + len(data)] = data
        if data.readonly:
            self.read_only += 1
        else:
            np.frombuffer(data, dtype=np.uint8)[:] ^= 0xFF


def test_a_destination_cannot_change_the_bytes_the_ram_tier_holds(store_dir: str) -> None:
    """A custom destination is handed the RAM tier's bytes as they are, read-only: a writer that wrote
    on them would have changed every later restore of the chunk, replays included (the tier checks
    bytes once, when it admits them)."""
    state = make_state(LAYOUT, 640, seed=8)
    with _open_small_ram(store_dir) as s:
        r = s.save(list(range(640)), state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        for _ in range(2):
            s.restore(r, dest)
        assert s._ram is not None and s._ram.drain(10) and s._ram.used > 0
        writers = {k: _ScribblingWriter(v.nbytes) for k, v in state.items()}
        s.restore(r, writers)
        assert all(bytes(writers[k].buf) == state[k].tobytes() for k in state)
        assert sum(w.read_only for w in writers.values()) > 0  # served from the RAM tier
        for out in (dest, {k: np.zeros_like(v) for k, v in state.items()}):  # a replay, then the full path
            s.restore(r, out)
            assert all(out[k].tobytes() == state[k].tobytes() for k in state)


def test_a_store_dropped_unclosed_lets_its_ram_tier_and_thread_go(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The admission thread holds its tier only while it waits or works: a store garbage-collected
    without close() releases the tier's memory, and the thread ends. It held the tier (and through it
    the catalog's descriptors) for the life of the process."""
    monkeypatch.setattr(_ramtier, "_IDLE_S", 0.05)
    state = make_state(LAYOUT, 640, seed=9)
    s = _open_small_ram(store_dir)
    r = s.save(list(range(640)), state)
    dest = {k: np.zeros_like(v) for k, v in state.items()}
    for _ in range(2):
        s.restore(r, dest)
    tier = s._ram
    assert tier is not None and tier.drain(10) and tier.used > 0
    thread, ref = tier._thread, weakref.ref(tier)
    assert thread is not None and thread.is_alive()
    del s, tier
    for _ in range(100):
        gc.collect()
        if ref() is None and not thread.is_alive():
            break
        thread.join(0.05)
    assert ref() is None and not thread.is_alive()


# -- direct I/O ----------------------------------------------------------------------------------
_cached_pages = cached_pages  # tests/support/pagecache.py (shared with test_cold_reads.py)


def _chunk_files(store_dir: str) -> list[str]:
    import os
    out = []
    for root, _, files in os.walk(os.path.join(store_dir, "blobs")):
        out += [os.path.join(root, f) for f in files]
    return out


def test_direct_save_bypasses_the_page_cache_and_restores_exactly(store_dir: str) -> None:
    """With the defaults a raw chunk is written with O_DIRECT: its pages do not stay cached."""
    import os
    state = _big_state(100, 5)
    with _open_big(store_dir) as s:
        assert s._chunker.direct
        r = s.save(list(range(100)), state)
        files = _chunk_files(store_dir)
        total = sum(-(-os.path.getsize(f) // 4096) for f in files)
        # at most the partial last block of each file (the truncate zeroes its tail through the cache)
        assert files and sum(_cached_pages(f) for f in files) <= 4 * len(files) < total // 10
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert s.verify(deep=True).ok


def test_buffered_save_when_direct_io_is_off(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTORE_DIRECT_IO", "0")
    state = _big_state(100, 5)
    with _open_big(store_dir) as s:
        assert not s._chunker.direct
        s.save(list(range(100)), state)
        files = _chunk_files(store_dir)
        assert sum(_cached_pages(f) for f in files) > 100 * len(files)
    with pytest.raises(ss.ConfigError):
        _open_big(store_dir, direct_io="yes")
    monkeypatch.setenv("SNAPSTORE_DIRECT_IO", "maybe")
    with pytest.raises(ss.ConfigError):
        _open_big(store_dir)


@pytest.mark.parametrize("where", ["open", "write"])
def test_file_system_refusing_direct_io_falls_back_cleanly(store_dir: str, where: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """EINVAL from O_DIRECT (at open or at the first write): the chunk is written buffered, no temp
    file is left behind, and the store stays on the buffered path."""
    import os

    from snapstore.chunks import direct_io as _direct_io
    monkeypatch.setattr(_direct_io, "_TEST_REFUSE", where)
    state = _big_state(100, 6)
    with _open_big(store_dir) as s:
        r = s.save(list(range(100)), state)
        assert r.ok and not s._chunker.direct
        assert os.listdir(os.path.join(store_dir, "tmp")) == []
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert s.verify(deep=True).ok


# -- saves off the engine's path (wait=False) ------------------------------------------------------
class _Gate:
    """Pauses the background writer inside its first chunk (the chunker's test hook) until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from snapstore.save import chunker as _chunker
        self.entered, self.opened = threading.Event(), threading.Event()
        self.main = threading.get_ident()

        def hook(stage: str, chunker: Any, cid: bytes) -> None:
            if stage == "hashed" and threading.get_ident() != self.main:
                self.entered.set()
                self.opened.wait(30)

        monkeypatch.setattr(_chunker, "_TEST_HOOK", hook)


def _fresh(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state.items()}


def test_save_without_waiting_returns_before_the_disk_and_copies_fixed_parts(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    state = _big_state(80, 7)
    engine = _fresh(state)
    with _open_big(store_dir) as s:
        h = s.save(list(range(80)), engine, session="c", wait=False)
        assert isinstance(h, ss.SaveHandle) and not h.done()
        assert h.copied_bytes == 4 * MIB  # the fixed part only: rows are read in place
        engine["run"][...] = 0x55  # the engine's next decode step overwrites its running state
        assert gate.entered.wait(10) and not h.done()
        gate.opened.set()
        res = h.result(30)
        assert res.ok and h.done() and h.exception() is None
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(res, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
    with _open_big(store_dir) as s:  # durable: another open sees it
        assert s.match(list(range(80))) is not None


def test_copy_budget_is_never_exceeded_the_call_waits(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    state = _big_state(16, 8)
    with _open_big(store_dir, async_copy_bytes=6 * MIB) as s:  # room for one fixed part (4 MiB) at a time
        h1 = s.save(list(range(16)), _fresh(state), wait=False)
        assert gate.entered.wait(10)
        returned = threading.Event()
        box: list[Any] = []

        def second() -> None:
            more = {"run": state["run"].copy(), "kv": np.concatenate([state["kv"], state["kv"][:1]])}
            box.append(s.save(list(range(17)), more, wait=False))
            returned.set()

        t = threading.Thread(target=second)
        t.start()
        assert not returned.wait(0.5)  # budget full: the second call waits rather than exceed it
        assert s._saver.used <= 6 * MIB
        gate.opened.set()
        assert returned.wait(30)
        t.join()
        assert h1.result(30).ok and box[0].result(30).ok
        assert s.flush(30) and s._saver.used == 0


def test_save_larger_than_the_copy_budget_runs_synchronously(store_dir: str) -> None:
    state = _big_state(16, 9)
    with _open_big(store_dir, async_copy_bytes=1 * MIB) as s:
        h = s.save(list(range(16)), _fresh(state), wait=False)
        assert h.done() and h.result().ok and h.copied_bytes == 0


def test_async_save_errors_surface_on_the_handle(store_dir: str) -> None:
    state = _big_state(16, 10)
    with _open_big(store_dir) as s:
        with pytest.raises(ss.LayoutError):  # argument errors raise at once
            s.save(list(range(16)), {"run": state["run"]}, wait=False)
        h = s.save(list(range(16)), _fresh(state), parent=987654, wait=False)
        assert isinstance(h.exception(30), ss.NotFoundError)
        with pytest.raises(ss.NotFoundError):
            h.result()
        ok = s.save(list(range(16)), _fresh(state), wait=False)  # the store carries on
        assert ok.result(30).ok


def test_close_and_flush_wait_for_saves_in_flight(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    state = _big_state(32, 11)
    s = _open_big(store_dir)
    h = s.save(list(range(32)), _fresh(state), wait=False)
    assert gate.entered.wait(10)
    assert not s.flush(timeout=0.2)  # still in flight
    closed = threading.Event()
    t = threading.Thread(target=lambda: (s.close(), closed.set()))
    t.start()
    assert not closed.wait(0.5)  # close() waits for the save
    gate.opened.set()
    assert closed.wait(30)
    t.join()
    assert h.result().ok
    with pytest.raises(ss.StateError):
        s.save(list(range(32)), _fresh(state), wait=False)
    with _open_big(store_dir) as s2:
        m = s2.match(list(range(32)))
        assert m is not None and m.snapshot_id == h.result().snapshot_id


def test_torch_adapter_save_async_copies_device_and_strided_tensors_before_returning(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from engine import TorchAdapter, layout_of
    gate = _Gate(monkeypatch)
    kv = torch.randn(8, 40, 16)  # token axis 1: not canonical, read through a TensorSource
    rec = torch.randn(4, 4)
    lay = layout_of(fixed={"rec": rec}, rows={"kv": kv}, token_dims={"kv": 1})
    want = {"kv": kv.clone(), "rec": rec.clone()}
    with ss.Store.open(store_dir, identity=IDENT, layout=lay, budget=ss.Budget(reserve_bytes=0)) as s:
        ad = TorchAdapter(s, token_dims={"kv": 1})
        h = ad.save_async(list(range(40)), {"kv": kv, "rec": rec})
        assert not h.done()
        kv.zero_()  # the engine reuses its buffers at once
        rec.fill_(3.0)
        gate.opened.set()
        res = h.result(30)
        out = {"kv": torch.zeros_like(kv), "rec": torch.zeros_like(rec)}
        ad.restore(res, out)
        assert torch.equal(out["kv"], want["kv"]) and torch.equal(out["rec"], want["rec"])
        ad.close()


# -- match(): cached chains ----------------------------------------------------------------------
def test_cached_chains_equal_a_fresh_hash_whatever_the_caller_does_with_its_buffer() -> None:
    """The chain cache keeps its own copy of the tokens: a caller that reuses its token buffer
    (a new prompt with the same first block) gets the chain of its new tokens, never a stale one."""
    import blake3

    from snapstore import _tokens

    def fresh(t: np.ndarray) -> list[bytes]:
        raw = np.ascontiguousarray(t, dtype="<u8").data.cast("B")
        h, out = _tokens._SEED, [_tokens._SEED]
        for off in range(0, len(t) // _tokens.BLOCK * 2048, 2048):
            h = blake3.blake3(h + raw[off:off + 2048]).digest(16)
            out.append(h)
        return out

    rng = np.random.default_rng(12)
    buf = rng.integers(0, 1000, 5000).astype("<u8")
    assert _tokens.TokenIndex(buf).chain == fresh(buf)
    buf[3000] += 1  # the engine reuses its buffer in place
    assert _tokens.TokenIndex(buf).chain == fresh(buf)
    for n in (255, 256, 257, 2999, 3000, 5000, 7000):
        t = np.concatenate([buf, rng.integers(0, 1000, 2000).astype("<u8")])[:n]
        assert _tokens.TokenIndex(t).chain == fresh(t)
    ix = _tokens.TokenIndex(buf)
    ix.chain.append(b"x" * 16)  # a caller's list is its own: the cache is not changed through it
    assert _tokens.TokenIndex(buf).chain == fresh(buf)


def test_stored_segments_spell_the_prefix_exactly_as_decoding_them_does() -> None:
    """match()'s token check compares the stored blobs with the query encoded once, instead of
    decoding every delta; it must agree with decode + concatenate + compare on every case,
    including a query token >= 2**31 whose low 32 bits equal an int32 stored token."""
    from snapstore import _tokens

    def reference(segs: list[tuple[bytes, int, int, int]], arr: np.ndarray) -> bool:
        got = np.concatenate([_tokens.decode_tokens(b, w, n - base) for b, w, base, n in segs])
        return len(got) <= len(arr) and bool(np.array_equal(got, arr[:len(got)]))

    rng = np.random.default_rng(3)
    for case in range(300):
        n = int(rng.integers(1, 3000))
        toks = rng.integers(0, 2**40 if case % 3 == 0 else 150_000, n).astype("<u8")
        cuts = sorted({0, n, *rng.integers(0, n, int(rng.integers(0, 6))).tolist()})
        segs = []
        for a, b in zip(cuts, cuts[1:]):
            blob, width = _tokens.encode_tokens(toks[a:b])
            segs.append((blob, width, a, b))
        query = np.concatenate([toks, rng.integers(0, 1000, int(rng.integers(0, 50))).astype("<u8")])
        variants = [query, query[:n - 1]]
        bad = query.copy()
        bad[int(rng.integers(0, n))] += 1
        variants.append(bad)
        wrap = query.copy()  # same low 32 bits, another token: no int32 blob holds it
        k = int(rng.integers(0, n))
        wrap[k] += 2**32
        variants.append(wrap)
        for q in variants:
            assert _tokens.spells_prefix(segs, q) == reference(segs, q), (case, len(q))
    blob, width = _tokens.encode_tokens(np.arange(10, dtype="<u8"))
    with pytest.raises(ss.CorruptionError):
        _tokens.spells_prefix([(blob[:-1], width, 0, 10)], np.arange(10, dtype="<u8"))


def test_match_probes_quarantined_chunks_from_their_partial_index_not_by_scanning(store: ss.Store) -> None:
    """match() asks which snapshots use a quarantined chunk for every candidate it finds; that
    probe starts from the partial index of quarantined chunks (usually empty) and never scans
    every part_chunks row (4 ms at 1,000 snapshots, growing with the store)."""
    from snapstore.catalog import queries as _catalog

    for n in range(1, 40):
        store.save(list(range(n * 3)), make_state(store.layout, n * 3, seed=n), parent=None)
    conn = store._repo.db.conn()
    plan = [str(r[-1]) for r in conn.execute("EXPLAIN QUERY PLAN " + _catalog.QUARANTINED_USERS_SQL)]
    scans = [p for p in plan if p.startswith("SCAN")]
    assert scans == ["SCAN q USING INDEX chunks_quarantined"], plan


def test_match_finds_a_prefix_beyond_the_first_statements_anchors(store: ss.Store) -> None:
    """The first match statement binds only the deepest anchors; a saved prefix far shorter than
    the query (its anchor in a later batch) is still found, and a deeper one still wins."""
    from snapstore.catalog import queries as _catalog

    query = list(range(1000, 1000 + 256 * (_catalog._FIRST_BATCH + 8)))
    short = store.save(query[:300], make_state(store.layout, 300, seed=1), parent=None)
    m = store.match(query)
    assert m is not None and m.snapshot_id == short.snapshot_id and m.n_tokens == 300
    deep = store.save(query[:len(query) - 100], make_state(store.layout, len(query) - 100, seed=2), parent=None)
    m = store.match(query)
    assert m is not None and m.snapshot_id == deep.snapshot_id
    m = store.match(query, exclude=[deep])
    assert m is not None and m.snapshot_id == short.snapshot_id
    assert store.match([7] + query) is None


# -- the save pipeline: every staging slot has a thread ------------------------------------------
def test_a_save_hashes_and_writes_as_many_chunks_at_once_as_the_staging_buffer_has_slots(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 MiB of staging in 4 MiB slots: four chunks are in the hash/write stage together (a pool of
    two threads left two staged chunks waiting while the disk idled between writes)."""
    from snapstore.save import chunker as _chunker
    inside, peak, met, lock = [0], [0], [0], threading.Lock()
    four = threading.Barrier(4, timeout=20)

    def hook(stage: str, chunker: Any, cid: bytes) -> None:
        if stage != "hashed":
            return
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            met[0] += 1
            meets = met[0] <= 4  # the fifth chunk has no partners left: it must not wait out the timeout
        if meets:
            try:
                four.wait()  # the first four chunks meet here; broken (timeout) if fewer run at once
            except threading.BrokenBarrierError:
                pass
        with lock:
            inside[0] -= 1

    monkeypatch.setattr(_chunker, "_TEST_HOOK", hook)
    state = _big_state(256, 9)  # 16 MiB of rows + 4 MiB fixed: 5 chunks of 4 MiB
    with _open_big(store_dir) as s:
        assert s._staging.slots == 4
        r = s.save(list(range(256)), state)
        assert peak[0] == 4, peak[0]
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)


def test_direct_chunk_writes_go_to_the_disk_one_at_a_time(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four staged chunks, but one O_DIRECT write in flight at a time: concurrent writes share the
    device and finish together, freeing every slot at once while the disk then idles."""
    from snapstore.chunks import direct_io as _direct_io
    real, inside, peak, lock = _direct_io.write_all, [0], [0], threading.Lock()

    def counted(fd: int, piece: Any) -> None:
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        try:
            threading.Event().wait(0.02)  # a slow disk: room for a second write to start, if allowed
            real(fd, piece)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(_direct_io, "write_all", counted)
    state = _big_state(256, 10)
    with _open_big(store_dir) as s:
        r = s.save(list(range(256)), state)
        assert s._chunker.direct and peak[0] == 1, peak[0]
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)


def test_a_written_chunk_frees_its_slot_before_its_fsync(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the first chunk file's fsync is held, the save goes on copying every later chunk into
    the staging slots: a slot is free once its O_DIRECT write returned (on the old code the first
    slot stayed taken through the fsync, and the save stopped after the slots' worth of copies)."""
    import os

    from snapstore.save import chunker as _chunker
    real_fsync, real_copy = os.fsync, _chunker.copy_addressed
    held, copies, first, by_copies = threading.Event(), [0], [True], [False]
    lock = threading.Lock()

    def fsync(fd: int) -> None:
        with lock:  # the first fsync of a chunk's temp file (tmp/w-...), on a pool thread
            hold = first[0] and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("w-")
            first[0] = first[0] and not hold
        if hold:
            held.wait(20)
        real_fsync(fd)

    def copy(*a: Any) -> tuple[bytes, bytes]:
        ids = real_copy(*a)  # a host-memory chunk's copy into its slot (hashed on the way)
        with lock:
            copies[0] += 1
            if copies[0] == 5 and not held.is_set():
                by_copies[0] = True  # every chunk copied while the first fsync was held
                held.set()
        return ids

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(_chunker, "copy_addressed", copy)
    state = _big_state(256, 11)  # 5 chunks of 4 MiB, 4 slots
    with _open_big(store_dir) as s:
        t = threading.Timer(5, held.set)  # the old code: stuck until this lets the fsync go
        t.start()
        try:
            r = s.save(list(range(256)), state)
        finally:
            t.cancel()
        assert by_copies[0] and copies[0] == 5
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)


def test_read_ahead_lanes_run_each_lane_in_order_and_lanes_at_once() -> None:
    """Jobs of one lane run on one thread in order, and a later lane's first job runs while an
    earlier lane's job is still in flight (a cold restore keeps two files' reads going)."""
    from snapstore.restore.read_ahead import ReadAhead
    lanes = [0, 0, 0, 1, 1, 1]
    ran: list[tuple[int, int]] = []
    second_started = threading.Event()
    lock = threading.Lock()

    def work(j: int) -> None:
        with lock:
            ran.append((j, threading.get_ident()))
        if j == 3:
            second_started.set()
        if j == 0:  # lane 0 waits until lane 1 is running: only true when lanes overlap
            assert second_started.wait(10), "lane 1 never started while lane 0 was reading"

    r = ReadAhead(len(lanes), work, depth=4, threads=2, lanes=lanes)
    try:
        for j in range(len(lanes)):
            r.wait(j)
            r.done()
    finally:
        r.stop()
    by_lane: dict[int, set[int]] = {}
    for j, tid in ran:
        by_lane.setdefault(lanes[j], set()).add(tid)
    assert all(len(t) == 1 for t in by_lane.values()) and by_lane[0] != by_lane[1]
    for lane in (0, 1):
        order = [j for j, _ in ran if lanes[j] == lane]
        assert order == sorted(order)


def test_buffered_restore_reads_each_chunk_file_on_one_thread_and_two_files_at_once(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big buffered restore reads every chunk file's pieces on one reader thread (its readahead
    stays sequential) and uses two reader threads (the old code read everything on one)."""
    from snapstore.restore import stream as _restore
    real = _restore.read_exact
    seen: dict[int, set[int]] = {}
    reads, lock = [0], threading.Lock()

    def spy(fd: int, out: Any, offset: int) -> None:
        with lock:
            seen.setdefault(fd, set()).add(threading.get_ident())
            reads[0] += 1
        real(fd, out, offset)

    monkeypatch.setattr(_restore, "read_exact", spy)
    monkeypatch.setattr(_restore, "_PIECE", MIB)  # 4 pieces per 4 MiB chunk file
    state = _big_state(256, 5)  # 5 chunk files
    with _open_big(store_dir, direct_reads=False) as s:
        r = s.save(list(range(256)), state)
        out = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
    assert len(seen) >= 5 and reads[0] >= 4 * len(seen)
    assert all(len(tids) == 1 for tids in seen.values()), seen
    assert len(set().union(*seen.values())) == 2


def test_a_failed_restore_says_touched_for_any_read_its_reader_threads_began(
        store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first chunk (zstd, through staging) is corrupt and no reader thread has begun yet; one
    could begin between the error and the readers' stop. The error's ``touched`` is taken after the
    stop, so it is False exactly when the destination is as it was (the old code read it before:
    a read that began in between wrote the destination under ``touched=False``)."""
    from snapstore.restore import stream as _restore
    from snapstore.restore.read_ahead import ReadAhead
    gate, began = threading.Event(), threading.Event()
    real_read, real_corrupt = _restore.read_exact, _restore.corrupt

    class Late(ReadAhead):  # reader threads that begin only once the error is being built
        def _run(self, lane: int) -> None:
            gate.wait(1.0)
            super()._run(lane)

    def read(*a: Any) -> None:
        began.set()
        real_read(*a)

    def corrupt(*a: Any) -> Any:
        gate.set()
        began.wait(0.5)  # the old code: a reader's read lands now, under the touched flag already taken
        return real_corrupt(*a)

    lay = ss.Layout(fixed={"a": ss.Fixed("uint8", (1 * MIB,))}, rows={"kv": ss.Rows("uint8", (64 * 1024,))})
    src = {"a": np.zeros(1 * MIB, dtype=np.uint8),  # compresses: a zstd chunk, read through staging
           "kv": np.random.default_rng(3).integers(0, 256, (256, 64 * 1024), dtype=np.uint8)}  # raw chunks
    with ss.Store.open(store_dir, identity=IDENT, layout=lay, chunk_bytes=4 * MIB, staging_bytes=16 * MIB,
                       codec="zstd", budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        r = s.save(list(range(256)), src)
        zstd_ids = [row[0] for row in s._repo.db.read(lambda c: c.execute(
            "SELECT c.id FROM chunks c WHERE c.codec != 0").fetchall())]
        assert len(zstd_ids) == 1
        path = s._repo.blob_path(bytes(zstd_ids[0]))
        with open(path, "r+b") as f:  # a flipped byte in the zstd payload
            f.seek(80)
            b = f.read(1)
            f.seek(80)
            f.write(bytes([b[0] ^ 0xFF]))
        monkeypatch.setattr(_restore, "ReadAhead", Late)
        monkeypatch.setattr(_restore, "read_exact", read)
        monkeypatch.setattr(_restore, "corrupt", corrupt)
        out = {"a": np.full(1 * MIB, 7, dtype=np.uint8), "kv": np.full((256, 64 * 1024), 7, dtype=np.uint8)}
        with pytest.raises(ss.RestoreError) as e:
            s.restore(r, out)
        written = not (np.all(out["a"] == 7) and np.all(out["kv"] == 7))
        assert e.value.touched == written, (e.value.touched, written)


def test_block_prefix_holders_start_from_the_key_index_not_the_identitys_snapshots(tmp_path: Any) -> None:
    """A block-granular lookup probes the holders of a prefix key up to a dozen times; each probe
    starts from the key's index (the snapshots sharing that prefix), never from every snapshot of
    the identity (the planner's own choice: 95 us a probe at 72 snapshots, growing with the store)."""
    from snapstore.catalog import prefix_queries

    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))}, tokens_per_row=16)
    with ss.Store.open(str(tmp_path / "s"), identity=ss.Identity(build="b", pack="p"), layout=lay,
                       budget=ss.Budget(reserve_bytes=0)) as s:
        for n in range(1, 30):
            s.save(list(range(n, n + 64)), {"kv": np.zeros((4, 64), np.uint8)}, parent=None)
        conn = s._repo.db.conn()
        plans = [[str(r[-1]) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args)] for sql, args in (
            (prefix_queries.ROW_PREFIX_HOLDERS_SQL.format(keys="?,?"), (b"k" * 16, b"j" * 16, "x", "", 8)),
            (prefix_queries.ROW_PREFIX_HELD_SQL, (b"k" * 16, 16, "x", "")))]
    for plan in plans:
        searches = [p for p in plan if p.startswith(("SEARCH", "SCAN")) and "identities" not in p]
        assert searches[0].startswith("SEARCH r USING COVERING INDEX row_prefixes_key"), plan
        assert not any(p.startswith("SCAN s") or p == "SCAN r" for p in plan), plan


def test_block_prefix_holders_are_the_most_recent_few_per_length(tmp_path: Any) -> None:
    """Twelve conversations share a 32-token prefix: the holders of each length come most recently
    used first, at most ``limit`` of them (a prefix shared by thousands sends few rows to Python)."""
    from snapstore.plan.prefix import prefix_chain, prefix_step

    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))}, tokens_per_row=16)
    with ss.Store.open(str(tmp_path / "s"), identity=ss.Identity(build="b", pack="p"), layout=lay,
                       budget=ss.Budget(reserve_bytes=0)) as s:
        shared = list(range(100, 132))
        ids = [s.save([*shared, *range(1000 * k, 1000 * k + 32)], {"kv": np.zeros((4, 64), np.uint8)},
                      parent=None).snapshot_id for k in range(12)]
        step = prefix_step(lay)
        assert step == 16
        keys = prefix_chain(np.array(shared, dtype="<u8"), step, 32)
        got = s._repo.db.read(lambda t: t.row_prefix_holders(s.identity.key, "", [(keys[1], 32), (keys[0], 16)], 3))
        newest = sorted(ids, reverse=True)[:3]  # saved in order: the last saved was used last
        assert got == {32: newest, 16: newest}
        assert s._repo.db.read(lambda t: t.row_prefix_held(s.identity.key, "", keys[1], 32))
        assert not s._repo.db.read(lambda t: t.row_prefix_held(s.identity.key, "", keys[1], 16))
