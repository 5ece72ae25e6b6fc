"""The cold-read path chosen by measurement (issue 48 item 1): a store measures buffered and O_DIRECT
reads on its own storage, keeps the choice in its catalog per storage (device + file system), uses
it, measures again on another storage or when its cold restores drift, and restores byte-exact
either way, read-only stores included. Which method wins is the machine's business: nothing here
depends on a timing; the page cache (mincore) tells which way a restore read."""

from __future__ import annotations

import os
import threading
from typing import Any

import apsw
import numpy as np
import pytest
from support import IDENT, store_factory
from support.pagecache import cached_pages, drop_cache

import snapstore as ss
from snapstore.catalog.rate_queries import ReadPathRow
from snapstore.chunks import direct_io as _direct_io
from snapstore.restore import read_path as rp

MIB = 1 << 20
ROW = 5000
N = 700  # 3.3 MiB of rows in 1 MiB chunks (payloads not 4 KiB multiples)
LAYOUT = ss.Layout(fixed={"run": ss.Fixed("uint8", (MIB + 1000,))}, rows={"kv": ss.Rows("uint8", (ROW,))})

# A RAM tier (a store without one reads buffered whatever was measured), too small to admit these
# chunks (it admits none over half its size): the page cache tells which way a restore read.
_open = store_factory(identity=IDENT, layout=LAYOUT, chunk_bytes=MIB, staging_bytes=4 * MIB,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=MIB // 2), check_rows=None)


@pytest.fixture
def cold_fs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A store path on a file system whose pages can be dropped and that takes O_DIRECT; small probes."""
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(MIB))
    drop_cache(str(probe))
    if cached_pages(str(probe)):
        pytest.skip("this file system keeps files in memory: no cold reads to test")
    try:
        os.close(os.open(probe, os.O_RDONLY | _direct_io.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.delenv("SNAPSTORE_DIRECT_READS", raising=False)
    monkeypatch.setattr(rp, "PROBE_BYTES", 2 * MIB)  # a cheap probe: the choice, not its figures, is tested
    monkeypatch.setattr(rp, "PROBE_ROUNDS", 1)
    monkeypatch.setattr(rp, "PROBE_AFTER", MIB)  # this test's restores are large enough to measure
    return str(tmp_path / "store")


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"run": rng.integers(0, 256, MIB + 1000, dtype=np.uint8),
            "kv": rng.integers(0, 256, (N, ROW), dtype=np.uint8)}


def _empty() -> dict[str, np.ndarray]:
    return {"run": np.zeros(MIB + 1000, dtype=np.uint8), "kv": np.zeros((N, ROW), dtype=np.uint8)}


def _cool(store_dir: str) -> list[str]:
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(store_dir, "blobs")) for f in fs]
    for f in files:
        drop_cache(f)
    return [f for f in files if os.path.getsize(f) > 256 * 1024]


def _bypassed(big: list[str]) -> bool:
    """Were these files read around the page cache (O_DIRECT)? The header read caches a few pages."""
    return bool(big) and all(cached_pages(f) < os.path.getsize(f) // 4096 // 4 for f in big)


def _cached(big: list[str]) -> bool:
    return bool(big) and all(cached_pages(f) >= os.path.getsize(f) // 4096 // 2 for f in big)


def _row(storage: str, method: str = "direct", cold_rate: float = 0.0, measured: float | None = None) -> ReadPathRow:
    import time
    return ReadPathRow(storage, method, 4, 256 << 10, '{"buffered": 1, "direct 4x4MiB": 2}', "set by the test",
                       cold_rate, time.time() if measured is None else measured)


def _rows(store_dir: str) -> list[tuple[Any, ...]]:
    c = apsw.Connection(os.path.join(store_dir, "snapstore.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return list(c.execute("SELECT storage, method, threads, piece FROM read_paths ORDER BY storage"))
    finally:
        c.close()


def _wait_probe(s: ss.Store) -> None:
    t = s._reads._thread
    if t is not None:
        t.join(60)


def test_choose_takes_o_direct_only_when_clearly_faster() -> None:
    """The rule, on given figures: buffered unless an O_DIRECT method is DIRECT_EDGE ahead; a refused
    O_DIRECT (0) never wins; the reason names both figures."""
    d8, d4 = rp.CANDIDATES[1].name, rp.CANDIDATES[2].name
    got, why = rp.choose({"buffered": 3.18e9, d8: 1.27e9, d4: 1.1e9})
    assert got == rp.BUFFERED and "3.18" in why and "1.27" in why
    got, _ = rp.choose({"buffered": 2.0e9, d8: 2.1e9, d4: 1.0e9})  # ahead, but not by the edge
    assert got == rp.BUFFERED
    got, _ = rp.choose({"buffered": 1.4e9, d8: 1.6e9, d4: 2.4e9})  # 1.7x: short of the edge
    assert got == rp.BUFFERED
    got, why = rp.choose({"buffered": 1.1e9, d8: 1.6e9, d4: 2.4e9, rp.CACHED: 9.0e9})
    assert got == rp.CANDIDATES[2] and "page cache" in why and "9.00" in why  # what it costs, said
    got, why = rp.choose({"buffered": 1.0e9, d8: 0.0, d4: 0.0})
    assert got == rp.BUFFERED and "refused" in why


def test_a_large_cold_restore_measures_and_the_choice_is_kept(cold_fs: str) -> None:
    """Unmeasured, a store reads buffered; a restore that read PROBE_AFTER cold bytes starts the probe,
    whose choice is used at once and kept in the catalog under this storage's key; a reopened store
    uses it without measuring again, and a store moved within the file system keeps it."""
    state = _state(1)
    with _open(cold_fs) as s:
        assert s._reads.row is None and not s._reads.on and s._reads.stale() is not None
        r = s.save(list(range(N)), state)
        _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        _wait_probe(s)
        row = s._reads.row
        assert row is not None and row.storage == rp.storage_key(cold_fs)
        assert s._reads.on == (row.method == "direct")
        assert not os.listdir(os.path.join(cold_fs, "tmp"))  # the probe file is gone
    assert _rows(cold_fs) == [(row.storage, row.method, row.threads, row.piece)]
    moved = cold_fs + "-moved"
    os.rename(cold_fs, moved)  # same device and file system: the same storage
    with _open(moved) as s:
        assert s._reads.row == row
        s._reads._cold_rate = lambda: 0.0  # drift is another test's (these tiny restores' rates are noise)
        assert s._reads.stale() is None
        r2 = s.save(list(range(N)), _state(2))
        _cool(moved)
        s.restore(r2, _empty())
        t = s._reads._thread
        assert t is None or t.name == "snapstore-read-path"  # no probe: at most that restore's timing, kept
        _wait_probe(s)
        assert s._reads.row is not None and s._reads.row.measured == row.measured  # nothing measured again


def test_another_storage_is_measured_again(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice kept for another device/file system (a store copied elsewhere) is not used: the store
    reads buffered, measures on its first large cold restore, and keeps both rows."""
    state = _state(3)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        s._repo.write(lambda t: t.set_read_path(_row("ffff:1234")))
    with _open(cold_fs) as s:
        assert s._reads.row is None and not s._reads.on
        assert s._reads.stale() == "not measured on this storage yet"
        _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        _wait_probe(s)
        assert s._reads.row is not None and s._reads.row.storage == rp.storage_key(cold_fs)
        assert all(np.array_equal(out[k], state[k]) for k in state)
    assert {row[0] for row in _rows(cold_fs)} == {"ffff:1234", rp.storage_key(cold_fs)}
    monkeypatch.setattr(rp, "storage_key", lambda path: "eeee:5678")  # the directory now on another device
    with _open(cold_fs) as s:
        assert s._reads.row is None and s._reads.stale() == "not measured on this storage yet"


def test_drift_and_age_call_for_a_new_measurement(cold_fs: str) -> None:
    """Cold restores DRIFT times slower or faster than at the choice, or a choice older than
    REMEASURE_S, make the choice stale; within the band it stands."""
    with _open(cold_fs) as s:
        key = s._reads.key
        rate = {"cold": 1.0e9}
        s._reads._cold_rate = lambda: rate["cold"]
        s._reads.apply(_row(key, cold_rate=1.0e9))
        assert s._reads.stale() is None
        rate["cold"] = 0.4e9
        assert "drifted" in (s._reads.stale() or "")
        rate["cold"] = 2.5e9
        assert "drifted" in (s._reads.stale() or "")
        rate["cold"] = 1.5e9
        assert s._reads.stale() is None
        s._reads.apply(_row(key, cold_rate=1.0e9, measured=1.0))
        assert "days ago" in (s._reads.stale() or "")


@pytest.mark.parametrize("method", ["direct", "buffered"])
def test_both_methods_restore_byte_exact(cold_fs: str, method: str) -> None:
    """With each method in force the cold restore is exact and goes the way chosen: O_DIRECT leaves
    the big chunk files out of the page cache, buffered reads leave them in."""
    state = _state(4)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        s._reads.apply(_row(s._reads.key, method))
        assert s._reads.on == (method == "direct")
        big = _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert _bypassed(big) if method == "direct" else _cached(big)
        out = _empty()
        s.restore(r, out)  # and again, from wherever the first left the bytes
        assert all(np.array_equal(out[k], state[k]) for k in state)


def test_a_forced_setting_beats_the_measured_choice(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with _open(cold_fs) as s:
        s._repo.write(lambda t: t.set_read_path(_row(rp.storage_key(cold_fs), "direct")))
    with _open(cold_fs, direct_reads=False) as s:
        assert not s._reads.on and s._reads.stale() is None
    monkeypatch.setenv("SNAPSTORE_DIRECT_READS", "0")
    with _open(cold_fs) as s:
        assert not s._reads.on and "SNAPSTORE_DIRECT_READS" in str(s._reads.describe()["why"])
    monkeypatch.delenv("SNAPSTORE_DIRECT_READS")
    with _open(cold_fs) as s:
        assert s._reads.on


def test_a_refused_o_direct_keeps_the_store_buffered(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A measured 'direct' on a file system that then refuses O_DIRECT: the restore is exact, buffered,
    and a later apply() of the same choice does not turn O_DIRECT back on."""
    state = _state(5)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        s._reads.apply(_row(s._reads.key, "direct"))
        monkeypatch.setattr(_direct_io, "_TEST_REFUSE", "setfl")
        big = _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state) and _cached(big)
        s._reads.apply(_row(s._reads.key, "direct"))
        assert not s._reads.on


def test_the_probe_sees_a_refusing_file_system(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """measure() on a file system that refuses O_DIRECT reads: the direct methods count 0 and buffered wins."""
    real = os.open

    def refuse(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & _direct_io.O_DIRECT and _direct_io.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse)
    got = rp.measure(str(tmp_path), size=MIB, rounds=1)
    assert got.chosen == rp.BUFFERED and "refused" in got.reason
    assert got.rates["buffered"] > 0 and got.rates[rp.CACHED] > 0
    assert all(got.rates[c.name] == 0 for c in rp.CANDIDATES if c.method == "direct")
    assert os.listdir(tmp_path) == []


def test_a_read_only_store_reads_with_the_kept_choice_and_never_measures(cold_fs: str) -> None:
    """read_only=True (the library's mode for read-only media): the kept choice is used, a large cold
    restore is exact and starts no probe, nothing is written, and an explicit measurement says why not."""
    state = _state(6)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        s._repo.write(lambda t: t.set_read_path(_row(rp.storage_key(cold_fs), "direct")))
    before = {p: os.stat(os.path.join(cold_fs, p)).st_mtime_ns for p in ("snapstore.db", "tmp")}
    with _open(cold_fs, read_only=True) as s:
        assert s._reads.on
        big = _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state) and _bypassed(big)
        assert s._reads._thread is None
        with pytest.raises(ss.StateError, match="read-only"):
            s._reads.measure_now(s._repo)
    assert before == {p: os.stat(os.path.join(cold_fs, p)).st_mtime_ns for p in ("snapstore.db", "tmp")}
    assert os.listdir(os.path.join(cold_fs, "tmp")) == []


def test_a_read_only_open_of_a_catalog_before_schema_14_reads_buffered(cold_fs: str) -> None:
    """An older catalog (no read_paths table) opened read-only is not migrated: nothing measured, buffered, exact."""
    state = _state(7)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
    c = apsw.Connection(os.path.join(cold_fs, "snapstore.db"))
    c.execute("DROP TABLE read_paths; PRAGMA user_version = 13")
    c.close()
    with _open(cold_fs, read_only=True) as s:
        assert s._reads.row is None and not s._reads.on
        out = _empty()
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)


def test_close_stops_a_probe_in_flight(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() abandons a probe between reads and waits for it: no thread left, no temp file left."""
    gate, entered = threading.Event(), threading.Event()
    from snapstore.restore import read_probe

    real = read_probe.drop_pages

    def slow_drop(fd: int, size: int) -> bool:
        entered.set()
        gate.wait(30)
        return real(fd, size)

    monkeypatch.setattr(read_probe, "drop_pages", slow_drop)
    s = _open(cold_fs)
    r = s.save(list(range(N)), _state(8))
    _cool(cold_fs)
    s.restore(r, _empty())
    assert entered.wait(30)
    thread = s._reads._thread
    assert thread is not None
    closer = threading.Thread(target=s.close)
    closer.start()
    gate.set()
    closer.join(60)
    assert not closer.is_alive() and not thread.is_alive()
    assert os.listdir(os.path.join(cold_fs, "tmp")) == []


@pytest.mark.parametrize("method", ["direct", "buffered"])
def test_a_direct_read_chunk_goes_to_the_ram_tier_at_once(cold_fs: str, method: str) -> None:
    """An O_DIRECT read leaves nothing in the page cache, so with a RAM tier the chunks it read are
    admitted after that first restore (in the background, checked), and the next restore is served
    from memory; a buffered read keeps the tier's second-sighting rule (the page cache holds them)."""
    state = _state(9)
    with _open(cold_fs, budget=ss.Budget(reserve_bytes=0, ram_bytes=64 * MIB)) as s:
        r = s.save(list(range(N)), state)
        s._reads.apply(_row(s._reads.key, method))
        _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        assert s._ram is not None and s._ram.drain(30)
        big = s.describe(r).nbytes
        assert (s._ram.used >= big - 2 * MIB) if method == "direct" else s._ram.used == 0
        hits = s._ram.hits
        out = _empty()
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert (s._ram.hits > hits) == (method == "direct")


def test_a_store_without_a_ram_tier_reads_buffered_whatever_was_measured(cold_fs: str) -> None:
    """ram_bytes=0: the page cache is the only copy a next restore can read from memory, so a measured
    'direct' is not used (and describe() says so); the restore leaves the pages cached, exact."""
    state = _state(10)
    with _open(cold_fs, budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        r = s._reads
        r.apply(_row(r.key, "direct"))
        assert not r.on and "no RAM tier" in str(r.describe()["why"])
        snap = s.save(list(range(N)), state)
        big = _cool(cold_fs)
        out = _empty()
        s.restore(snap, out)
        assert all(np.array_equal(out[k], state[k]) for k in state) and _cached(big)
    with _open(cold_fs, budget=ss.Budget(reserve_bytes=0, ram_bytes=0), direct_reads=True) as s:
        assert s._reads.on  # forced: as asked


def test_the_probe_never_takes_the_room_a_save_needs(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With less free space than twice the probe file plus a margin, nothing is written: the explicit
    measurement says why (ENOSPC), the background one after a large cold restore keeps nothing."""
    state = _state(11)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        real = os.statvfs

        class Full:
            def __init__(self, st: Any) -> None:
                self.f_bavail, self.f_frsize = 1000, st.f_frsize

        monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)) if str(p).endswith("tmp") else real(p))
        with pytest.raises(ss.StoreIOError, match="free") as e:
            s._reads.measure_now(s._repo)
        assert e.value.errno == 28
        _cool(cold_fs)
        out = _empty()
        s.restore(r, out)
        _wait_probe(s)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert s._reads.row is None and os.listdir(os.path.join(cold_fs, "tmp")) == []
    assert _rows(cold_fs) == []


@pytest.mark.parametrize("probe", ["cachestat", "mincore"])
def test_the_probe_drops_its_pages_with_either_residency_probe(cold_fs: str, monkeypatch: pytest.MonkeyPatch,
                                                              probe: str) -> None:
    """measure() checks that its file's pages really left before each read, with cachestat or with the
    mincore fallback (which maps the file: it needs a readable descriptor), and says so (``dropped``)."""
    from snapstore.chunks import residency

    lib = residency._libc()
    if lib is None:
        pytest.skip("no libc probe on this platform")
    if probe == "cachestat" and residency.probe_kind() != "cachestat":
        pytest.skip("this kernel has no cachestat(2)")
    monkeypatch.setattr(lib, "cachestat", probe == "cachestat")
    tmp = os.path.dirname(cold_fs)
    got = rp.measure(tmp, size=2 * MIB, rounds=1)
    assert got.dropped and "could not be dropped" not in got.reason
    assert all(v > 0 for v in got.rates.values())
    assert lib.cachestat == (probe == "cachestat")


def test_switching_methods_is_no_drift(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cold rate kept with a choice is the store's, scaled from the method its restores used to the
    one chosen: a store that goes from buffered to a 2x faster O_DIRECT expects 2x faster cold restores."""
    d4 = rp.CANDIDATES[2]
    rates = {"buffered": 1.0e9, rp.CANDIDATES[1].name: 1.5e9, d4.name: 2.0e9, rp.CACHED: 8.0e9}
    monkeypatch.setattr(rp, "measure", lambda *a, **k: rp.Measured(rates, d4, "given", True))
    with _open(cold_fs) as s:
        s._reads._cold_rate = lambda: 0.8e9  # measured with buffered reads
        assert not s._reads.on
        row, _ = s._reads.measure_now(s._repo)
        assert row.method == "direct" and s._reads.on
        assert row.cold_rate == pytest.approx(1.6e9)
        s._reads._cold_rate = lambda: 1.7e9  # as expected after the switch: no drift
        assert s._reads.stale() is None


def test_one_prober_per_store_and_none_under_a_write_budget(cold_fs: str) -> None:
    """Processes sharing a store take turns: one that finds the probe turn held (an flock of tmp/,
    which another process's probe holds) measures nothing now; a store with a write budget
    (Budget.write_bytes_per_hour: its writes are the operator's to pace) never measures unasked."""
    import fcntl

    state = _state(21)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
    fd = os.open(os.path.join(cold_fs, "tmp"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's probe in flight
        with _open(cold_fs) as s:
            _cool(cold_fs)
            out = _empty()
            s.restore(r, out)
            _wait_probe(s)
            assert all(np.array_equal(out[k], state[k]) for k in state)
            assert s._reads.row is None  # its turn was taken: nothing measured, nothing kept
    finally:
        os.close(fd)
    assert _rows(cold_fs) == []
    with _open(cold_fs, budget=ss.Budget(reserve_bytes=0, ram_bytes=MIB // 2, write_bytes_per_hour=1 << 40)) as s:
        _cool(cold_fs)
        s.restore(r, _empty())
        assert s._reads._thread is None and s._reads.row is None
    assert _rows(cold_fs) == []
    with _open(cold_fs) as s:  # the turn free, no write budget: the large cold restore measures
        _cool(cold_fs)
        s.restore(r, _empty())
        _wait_probe(s)
        assert s._reads.row is not None
    assert len(_rows(cold_fs)) == 1


def test_rechoose_follows_the_stores_own_restores_once_both_ways_are_timed() -> None:
    """Nothing to say until buffered and an O_DIRECT method are both timed; then O_DIRECT is taken
    RESTORED_EDGE ahead of buffered and kept while STAY_EDGE ahead (no flapping near the edge)."""
    b, d8, d4 = rp.BUFFERED, rp.CANDIDATES[1], rp.CANDIDATES[2]
    assert rp.rechoose({}, b) is None
    assert rp.rechoose({"buffered": 1.0e9}, b) is None
    assert rp.rechoose({d4.name: 2.0e9}, d4) is None  # buffered never timed: the probe's choice stands
    got, why = rp.rechoose({"buffered": 1.0e9, d4.name: 1.3e9}, b) or (None, "")
    assert got == d4 and "1.30x" in why
    got, _ = rp.rechoose({"buffered": 1.0e9, d4.name: 1.2e9}, b) or (None, "")
    assert got == b  # short of the edge to switch
    got, _ = rp.rechoose({"buffered": 1.0e9, d4.name: 1.2e9}, d4) or (None, "")
    assert got == d4  # ... but enough to stay
    got, why = rp.rechoose({"buffered": 1.0e9, d4.name: 1.05e9}, d4) or (None, "")
    assert got == b and "1.25x" in why
    got, _ = rp.rechoose({"buffered": 1.0e9, d4.name: 1.2e9, d8.name: 1.4e9}, d4) or (None, "")
    assert got == d8  # the fastest timed O_DIRECT method
    assert rp.Candidate("direct", 4, 256 << 10).name == "direct 4x256KiB"


def _probed_row(storage: str, method: str, figures: dict[str, float]) -> ReadPathRow:
    import json
    import time
    threads, piece = (4, 4 * MIB) if method == "direct" else (2, 4 * MIB)
    return ReadPathRow(storage, method, threads, piece, json.dumps(figures), "set by the test", 0.0, time.time())


BIG = 64 * MIB  # a large cold restore's bytes, as restored() is told them


def _kept(store_dir: str) -> tuple[str, dict[str, float]]:
    import json
    c = apsw.Connection(os.path.join(store_dir, "snapstore.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        method, figures = next(c.execute("SELECT method, figures FROM read_paths"))
        return str(method), json.loads(figures)
    finally:
        c.close()


def test_the_restores_switch_the_method_keep_it_and_do_not_flap(cold_fs: str) -> None:
    """The policy, on the figures restored() is given: a timed buffered restore begins a trial of the
    probe's best O_DIRECT method; that trial, 1.9x faster, makes O_DIRECT the choice, used at once and
    kept (its figures too, and the cold rate drift is judged against scaled to it); O_DIRECT stays
    while STAY_EDGE ahead and goes back below it; a restore that read both ways times neither."""
    d8, d4 = rp.CANDIDATES[1], rp.CANDIDATES[2]
    with _open(cold_fs) as s:
        r = s._reads
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d8.name: 2.0e9, d4.name: 2.5e9}))
        r._cold_rate = lambda: 0.9e9
        assert not r.on and r.stale() is None
        r.restored(s._repo, {"cold": BIG}, BIG / 1e9, 0)  # read buffered at 1 GB/s
        _wait_probe(s)
        assert r.row is not None and r.row.method == "buffered"
        assert _kept(cold_fs) == ("buffered", {"buffered": 3e9, d8.name: 2.0e9, d4.name: 2.5e9,
                                               "restored: buffered": pytest.approx(1e9)})
        assert r.on and (r.threads, r.piece) == (d4.threads, d4.piece)  # the trial: the probe's best O_DIRECT
        r.restored(s._repo, {"cold": BIG, "warm": BIG // 20}, BIG / 2e9, BIG // 2)  # both ways: not timed
        assert r._timings.medians() == {"buffered": pytest.approx(1e9)} and r.on
        r.restored(s._repo, {"cold": BIG}, BIG / 1.9e9, BIG)  # the trial read O_DIRECT at 1.9 GB/s
        _wait_probe(s)
        assert r.row.method == "direct" and r.on and (r.threads, r.piece) == (d4.threads, d4.piece)
        assert "1.90x" in r.row.reason and r.row.cold_rate == pytest.approx(1.9e9)
        assert _kept(cold_fs)[0] == "direct" and "restored: " + d4.name in _kept(cold_fs)[1]
        for rate, method in ((1.15e9, "direct"), (1.15e9, "direct"), (1.0e9, "direct"), (1.0e9, "buffered")):
            r.restored(s._repo, {"cold": BIG}, BIG / rate, BIG)
            assert r.row.method == method, (rate, r._timings.medians())
        _wait_probe(s)
        assert _kept(cold_fs)[0] == "buffered" and not r.on  # back, and no trial due yet


def test_a_choice_the_writer_could_not_keep_is_kept_by_a_later_restore(cold_fs: str) -> None:
    """A switch made while the store's one background thread was busy (a probe, an earlier write) is
    used at once and written when a later timed restore finds the thread free."""
    d4 = rp.CANDIDATES[2]
    with _open(cold_fs) as s:
        r = s._reads
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 2.5e9, "restored: buffered": 1e9}))
        r._cold_rate = lambda: 0.0
        s._repo.write(lambda t: t.set_read_path(r.row), durable=False)
        gate = threading.Event()
        busy = threading.Thread(target=gate.wait, daemon=True)
        busy.start()
        r._thread = busy
        try:
            assert r.on  # buffered timed, d4 not: the trial of d4 begins as the row is applied (an open)
            r.restored(s._repo, {"cold": BIG}, BIG / 3e9, BIG)  # d4 3x buffered: switched
            assert r.row is not None and r.row.method == "direct" and r.on
            assert _kept(cold_fs)[0] == "buffered"  # not written: the thread was busy
        finally:
            gate.set()
            busy.join()
            r._thread = None
        r.restored(s._repo, {"cold": BIG}, BIG / 3e9, BIG)
        _wait_probe(s)
        assert _kept(cold_fs)[0] == "direct"


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_real_restores_are_timed_under_the_method_they_read_with(cold_fs: str, codec: str | None) -> None:
    """A real large cold restore with buffered in force is timed as buffered and begins a trial; the
    trial reads around the page cache (exact) and is timed under that O_DIRECT method. Compressed
    chunks are read buffered whatever is in force: timed as buffered, never as O_DIRECT."""
    d4 = rp.CANDIDATES[2]
    state = _state(13)
    if codec is not None:  # compressible (incompressible chunks are stored raw)
        state = {k: v % 4 for k, v in state.items()}
    with _open(cold_fs, codec=codec) as s:
        r = s._reads
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 2.5e9}))
        r._cold_rate = lambda: 0.0
        snap = s.save(list(range(N)), state)
        big = _cool(cold_fs)
        out = _empty()
        s.restore(snap, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert set(r._timings.medians()) == {"buffered"} and r.on  # timed buffered; the trial begins
        _wait_probe(s)
        _cool(cold_fs)
        out = _empty()
        s.restore(snap, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        if codec is None:
            assert _bypassed(big) and set(r._timings.medians()) == {"buffered", d4.name}
        else:
            assert set(r._timings.medians()) == {"buffered"} and len(r._timings._by["buffered"]) == 2


def test_a_new_probe_times_the_restores_afresh(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings never outlive the probe they followed: a new measurement (drift, age, another storage,
    `snapstore bench`) starts them afresh, and the probe's choice stands until restores time both ways."""
    d4 = rp.CANDIDATES[2]
    rates = {"buffered": 3.0e9, rp.CANDIDATES[1].name: 1.5e9, d4.name: 2.0e9}
    monkeypatch.setattr(rp, "measure", lambda *a, **k: rp.Measured(rates, rp.BUFFERED, "given", True))
    with _open(cold_fs) as s:
        r = s._reads
        r.apply(_probed_row(r.key, "direct", {"buffered": 3e9, d4.name: 2.5e9, "restored: buffered": 1e9,
                                             "restored: " + d4.name: 2e9}))
        assert r.on and set(r._timings.medians()) == {"buffered", d4.name}
        row, _ = r.measure_now(s._repo)
        assert row.method == "buffered" and not r.on and r._timings.medians() == {}
        assert not any(k.startswith(rp.RESTORED) for k in _kept(cold_fs)[1])


def test_trials_are_bounded_and_a_switch_is_no_drift(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial is not ended by a restore begun before it, ends untimed after 64 restores that time
    nothing, and is not begun for an O_DIRECT method the probe found under half the buffered figure;
    a switch the restores make, 2.5x faster, is no drift (judged by the restores' own figure for the
    method in force, not the store-wide fit of its buffered past); a probe taken during a trial scales
    the drift figure from the method kept, not the one on trial."""
    d4 = rp.CANDIDATES[2]
    with _open(cold_fs) as s:
        r = s._reads
        r._cold_rate = lambda: 0.9e9  # the store-wide fit: its restores so far read buffered
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 2.5e9, "restored: buffered": 1e9}))
        assert r.on and r._trial == d4  # timed buffered, d4 not: a trial, as the row is applied
        r.restored(s._repo, {"cold": BIG}, BIG / 1e9, 0)  # a restore begun before the trial: buffered
        assert r.on and r._trial == d4
        for _ in range(62):  # 64 restores in all under the trial, the one above included
            r.restored(s._repo, {"warm": BIG}, 0.01, 0)  # nothing large and cold: the trial waits
        assert r.on
        r.restored(s._repo, {"warm": BIG}, 0.01, 0)
        assert not r.on and r._trial is None  # ended untimed
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 1.4e9, "restored: buffered": 1e9}))
        assert not r.on  # the probe found O_DIRECT under half the buffered figure: no trial
        r._timings.clear()
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 2.5e9, "restored: buffered": 1e9}))
        assert r.on
        r.restored(s._repo, {"cold": BIG}, BIG / 2.5e9, BIG)  # the trial: 2.5x the buffered restores
        assert r.row is not None and r.row.method == "direct" and r.row.cold_rate == pytest.approx(2.5e9)
        assert r.stale() is None  # the fit (0.9) is 2.8x off, the restores' own figure is not
        measured = r.row.measured
        r.restored(s._repo, {"cold": BIG}, BIG / 2.4e9, BIG)
        _wait_probe(s)
        assert r.row.method == "direct" and r.row.measured == measured  # no probe started
    with _open(cold_fs) as s:
        r = s._reads
        r._cold_rate = lambda: 0.9e9
        r._timings.clear()  # the catalog's row (the store above) seeded both methods at open
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 2.5e9, "restored: buffered": 1e9}))
        assert r._trial == d4
        rates = {"buffered": 2.0e9, rp.CANDIDATES[1].name: 1.5e9, d4.name: 3.0e9}
        monkeypatch.setattr(rp, "measure", lambda *a, **k: rp.Measured(rates, rp.BUFFERED, "given", True))
        row, _ = r.measure_now(s._repo)
        assert row.method == "buffered" and row.cold_rate == pytest.approx(0.9e9)  # from buffered to buffered


def test_the_timings_are_read_and_written_under_the_read_paths_lock(cold_fs: str) -> None:
    """Timings is not thread-safe: every call on it, stale()'s drift check included (restored() asks
    it outside the lock on every large cold restore), holds the read path's lock."""
    d4 = rp.CANDIDATES[2]
    with _open(cold_fs) as s:
        r = s._reads
        r.apply(_probed_row(r.key, "buffered", {"buffered": 3e9, d4.name: 2.5e9, "restored: buffered": 1e9}))
        timings, unlocked = r._timings, []
        real = type(timings)

        class Watched(real):  # type: ignore[misc,valid-type]
            def medians(self) -> dict[str, float]:
                if not r._lock.locked():
                    unlocked.append("medians")
                return super().medians()

        watched = Watched()
        watched.seed({"restored: buffered": 1e9})
        r._timings = watched
        r._cold_rate = lambda: 0.0
        assert r.stale() is None
        r.restored(s._repo, {"cold": BIG}, BIG / 2e9, BIG if r.on else 0)
        _wait_probe(s)
        assert unlocked == []
