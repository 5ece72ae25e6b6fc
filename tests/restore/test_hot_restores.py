"""Issue 48 item 2: a restore repeated into the same arrays is replayed from the plan kept for it
(restore/hot.py) — exact, every chunk checked — and only while nothing it was made from changed:
the catalog (another process's delete, a quarantine), the chunk bytes (damage in place), the
destination (another array, a new shape, read-only). The WAL-index stamp it stands on moves with
every commit of any connection."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import snapstore as ss
from snapstore.catalog.wal_stamp import WalStamp

BLOCK = 32
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 1024))}, tokens_per_row=BLOCK)
IDENT = ss.Identity(build="t", pack="hot", kv="u8")
ROWS = 24


def _open(path: Any, ram: int = 0) -> ss.Store:
    return ss.Store.open(str(path), identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0, ram_bytes=ram))


def _chain(s: ss.Store, links: int = 4, seed: int = 0) -> tuple[int, np.ndarray, list[int]]:
    kv = np.random.default_rng(seed).integers(0, 256, (ROWS, 2, 1024), dtype=np.uint8)
    tokens = [seed * 100_000 + t for t in range(ROWS * BLOCK)]
    sid = 0
    for k in range(1, links + 1):
        rows = ROWS * k // links
        res = s.save(tokens[:rows * BLOCK], {"kv": kv}, rows=rows, parent="auto")
        assert res.ok and res.snapshot_id is not None
        sid = res.snapshot_id
    return sid, kv, tokens


def _blob_files(root: Any) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(str(root), "blobs")) for f in fs)


@pytest.mark.parametrize("ram", [0, 64 << 20])
def test_a_repeated_restore_is_replayed_exact(tmp_path: Any, ram: int) -> None:
    """The third restore of a chain into the same array (and every later one) is a replay, with the
    RAM tier off and on; each is byte-exact and returns what the full path returned."""
    with _open(tmp_path / "s", ram) as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        first = s.restore(sid, {"kv": dst})
        s.restore(sid, {"kv": dst})
        assert s._hot.replays == 0
        for k in range(5):
            dst[:] = k
            res = s.restore(sid, {"kv": dst})
            assert np.array_equal(dst, kv)
            assert (res.n_tokens, res.rows, res.chain, res.bytes_restored) == \
                (first.n_tokens, first.rows, first.chain, first.bytes_restored)
        assert s._hot.replays == 5
        assert s.stats().restores >= 7


def test_another_processs_delete_stops_the_replay(tmp_path: Any) -> None:
    """A delete committed by another process moves the catalog: the next restore plans again and
    says the snapshot is gone, though this process still holds its chunk files open."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1
        code = ("import snapstore as ss, sys\n"
                "lay = ss.Layout(rows={'kv': ss.Rows('uint8', (2, 1024))}, tokens_per_row=32)\n"
                "with ss.Store.open(sys.argv[1], identity=ss.Identity(build='t', pack='hot', kv='u8'), layout=lay,"
                " budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as o:\n"
                "    assert int(sys.argv[2]) in o.delete(int(sys.argv[2])).snapshot_ids\n")
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "s"), str(sid)], check=True, timeout=120)
        with pytest.raises(ss.SnapshotUnavailableError):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1 and len(s._hot) == 0


def test_a_commit_that_changes_no_plan_keeps_the_replay(tmp_path: Any) -> None:
    """A commit that moves the WAL index but not the catalog generation (another snapshot's save
    in another chain does move it; the bookkeeping stats() writes does not) is checked against the
    generation in one read, and the replay goes on."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        before = s._hot.wal()
        s.stats()  # writes the restores' bookkeeping (last use, counters)
        s.restore(sid, {"kv": dst})
        assert s._hot.replays == 2 and np.array_equal(dst, kv)
        assert before is not None and s._hot.wal() is not None


def test_damage_in_place_is_found_reported_and_quarantined(tmp_path: Any) -> None:
    """A chunk file changed in place under a kept plan: the replay's checksum fails, the full path
    reports the damage (touched: the replay wrote) and quarantines the chunk; no further replay."""
    with _open(tmp_path / "s") as s:
        sid, kv, tokens = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1
        victim = _blob_files(tmp_path / "s")[0]
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) - 1)
            last = f.read(1)
            f.seek(os.path.getsize(victim) - 1)
            f.write(bytes([last[0] ^ 0xFF]))
        with pytest.raises(ss.CorruptChunkError) as e:
            s.restore(sid, {"kv": dst})
        assert e.value.touched
        assert s._hot.replays == 1 and len(s._hot) == 0
        m = s.match(tokens)
        assert m is None or m.snapshot_id != sid  # quarantined: the damaged chain no longer matches whole


def test_another_destination_takes_the_full_path(tmp_path: Any) -> None:
    """Another array, a reshaped one or a read-only one is never written by a kept plan: the full
    path binds (or refuses) it as it would without one."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1
        other = np.zeros_like(kv)
        s.restore(sid, {"kv": other})
        assert np.array_equal(other, kv) and s._hot.replays == 1
        dst.shape = (ROWS * 2, 1, 1024)  # same bytes, another shape: the full path refuses it
        with pytest.raises(ss.DestinationError):
            s.restore(sid, {"kv": dst})
        dst.shape = kv.shape
        dst.flags.writeable = False
        with pytest.raises(ss.DestinationError):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1


def test_a_dropped_destination_is_not_kept_alive(tmp_path: Any) -> None:
    """A kept plan holds its arrays weakly: an engine that drops its arena frees it."""
    import gc
    import weakref

    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        gone = weakref.ref(dst)
        del dst
        gc.collect()
        assert gone() is None
        again = np.zeros_like(kv)
        s.restore(sid, {"kv": again})
        assert np.array_equal(again, kv)


def test_close_releases_the_kept_files(tmp_path: Any) -> None:
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        fds = [fd for p in s._hot._plans.values() for fd in p.fds]
        assert fds
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_the_wal_stamp_moves_with_every_commit(tmp_path: Any) -> None:
    """The WAL-index header reads the same until a transaction commits, by any connection; with no
    -shm (a catalog not in WAL mode, or none) it reads None."""
    import apsw

    db = str(tmp_path / "c.db")
    assert WalStamp(db).read() is None
    a = apsw.Connection(db)
    assert a.execute("PRAGMA journal_mode=WAL").fetchall() == [("wal",)]
    a.execute("CREATE TABLE t(x)")
    stamp = WalStamp(db)
    h0 = stamp.read()
    assert h0 is not None and stamp.read() == h0
    a.execute("SELECT count(*) FROM t").fetchall()
    assert stamp.read() == h0  # a read commits nothing
    b = apsw.Connection(db)
    b.execute("INSERT INTO t VALUES (1)")
    h1 = stamp.read()
    assert h1 is not None and h1 != h0
    a.execute("INSERT INTO t VALUES (2)")
    assert stamp.read() not in (h0, h1)
    stamp.close()


def test_header_damage_is_found_before_a_byte_is_written(tmp_path: Any) -> None:
    """A chunk file's header changed in place under a kept plan: the replay re-reads every header
    first (as the full path re-reads a kept file's), so the full path reports the damage with the
    destination untouched, as it would have without the plan."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1
        for path in _blob_files(tmp_path / "s"):
            fd = os.open(path, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, 0)[0] ^ 0xFF]), 0)
            finally:
                os.close(fd)
        dst[:] = 7
        with pytest.raises(ss.CorruptChunkError) as e:
            s.restore(sid, {"kv": dst})
        assert not e.value.touched and (dst == 7).all()
        assert s._hot.replays == 1


def test_a_store_dropped_unclosed_releases_its_kept_files(tmp_path: Any) -> None:
    """A Store collected without close() closes what its kept plans hold (and the WAL-index file)."""
    import gc

    from snapstore.chunks import open_files

    def blob_fds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            n += str(tmp_path / "s") in target and ("blobs" in target or target.endswith("-shm"))
        return n

    used = open_files._SLOTS.used
    s = _open(tmp_path / "s")
    sid, kv, _ = _chain(s)
    dst = np.zeros_like(kv)
    for _ in range(3):
        s.restore(sid, {"kv": dst})
    assert s._hot.replays == 1 and blob_fds() > 0
    del s
    gc.collect()
    assert blob_fds() == 0 and open_files._SLOTS.used == used


def test_a_replay_uses_the_ram_tier_as_the_full_path_does(tmp_path: Any) -> None:
    """With a RAM tier, a replay copies the chunks it holds and offers the others: its hits (and so
    the tier's recency) are the full path's."""
    def hits(repeat_into_one: bool) -> int:
        with _open(tmp_path / f"s{repeat_into_one}", 64 << 20) as s:
            sid, kv, _ = _chain(s)
            dst = np.zeros_like(kv)
            for _ in range(7):
                assert s._tiers.ram is not None
                s._tiers.ram.drain()
                out = dst if repeat_into_one else np.zeros_like(kv)
                s.restore(sid, {"kv": out})
                assert np.array_equal(out, kv)
            replays = s._hot.replays
            assert (replays > 0) == repeat_into_one
            return s.stats().ram_hits

    assert hits(True) == hits(False) > 0


def test_fresh_arrays_at_a_freed_arrays_address_are_never_kept_for(tmp_path: Any) -> None:
    """An engine that allocates per request often gets the freed array's address (and id) again: a
    plan is kept only for the same array restored into twice, never for two that shared an id."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        ids = set()
        for _ in range(8):
            dst = np.zeros_like(kv)
            ids.add(id(dst))
            s.restore(sid, {"kv": dst})
            assert np.array_equal(dst, kv)
            del dst
            assert len(s._hot) == 0
        assert s._hot.replays == 0
        assert len(ids) < 8  # (the case this is about: ids were reused)


def test_a_header_that_cannot_be_read_is_the_full_paths_to_report(tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO on a kept file's header: the replay gives way before it writes, and the restore fails as
    the full path fails it (a RestoreError, untouched), never with a bare OSError; once the device
    reads again, so does the store."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        assert s._hot.replays == 1
        victim = os.stat(_blob_files(tmp_path / "s")[0])
        real_pread, real_preadv = os.pread, os.preadv

        def failing(fd: int) -> None:  # the device fails the file, whichever call reads it
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (victim.st_dev, victim.st_ino):
                raise OSError(5, "Input/output error")

        def pread(fd: int, *a: Any) -> bytes:
            failing(fd)
            return real_pread(fd, *a)

        def preadv(fd: int, *a: Any) -> int:
            failing(fd)
            return real_preadv(fd, *a)

        with monkeypatch.context() as m:
            m.setattr(os, "pread", pread)
            m.setattr(os, "preadv", preadv)
            dst[:] = 3
            with pytest.raises(ss.RestoreError) as e:
                s.restore(sid, {"kv": dst})
            assert not e.value.touched and (dst == 3).all()
        assert len(s._hot) == 0
        s.restore(sid, {"kv": dst})
        assert np.array_equal(dst, kv)


def test_a_replay_tells_cached_files_from_cold_ones(tmp_path: Any) -> None:
    """A replay's bytes per tier (the restore rates' input) are the full path's: a file whose pages
    are cached counts warm, one that had to be read from the device cold — also after a cold one."""
    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        plan = next(iter(s._hot._plans.values()))
        key = plan.key

        def replay() -> dict[str, int]:
            done = s._hot.replay(key, {"kv": dst}, lambda: None, lambda _snap: True)
            assert done is not None and done.plan is not None and np.array_equal(dst, kv)
            return done.tiers

        assert replay()["warm"] == kv.nbytes
        first_fd = plan.chunks[0][0]
        os.posix_fadvise(first_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if plan.nowait and any(c[0] != first_fd for c in plan.chunks):
            tiers = replay()
            later = sum(c[2].raw_len for c in plan.chunks if c[0] != first_fd)
            assert tiers["warm"] == later and tiers["cold"] == kv.nbytes - later


def test_a_replay_whose_headers_are_cached_asks_for_the_later_small_files(tmp_path: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Files whose header page is cached but not their payload pass the header pass as cached: the
    first payload read that would wait asks for the later small files at once (their round trips
    overlap, restore.hot_plan.ask_ahead), and the restore is exact."""
    from support.pagecache import cached_pages, drop_cache

    with _open(tmp_path / "s") as s:
        sid, kv, _ = _chain(s, links=6)
        dst = np.zeros_like(kv)
        for _ in range(3):
            s.restore(sid, {"kv": dst})
        plan = next(iter(s._hot._plans.values()))
        if not plan.nowait:
            pytest.skip("this file system does not take RWF_NOWAIT: files are probed whole")
        files = _blob_files(tmp_path / "s")
        assert len(files) == 6
        for f in files:  # the payload dropped, the header page read back alone
            drop_cache(f)
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                os.pread(fd, 64, 0)
            finally:
                os.close(fd)
        if any(cached_pages(f) != 1 for f in files):
            pytest.skip("this file system does not drop or read single pages: nothing partly cached to test")
        hinted: list[int] = []
        real = os.posix_fadvise

        def fadvise(fd: int, offset: int, length: int, how: int) -> None:
            if how == os.POSIX_FADV_WILLNEED:
                hinted.append(fd)
            real(fd, offset, length, how)

        monkeypatch.setattr(os, "posix_fadvise", fadvise)
        replays = s._hot.replays
        dst[:] = 0
        s.restore(sid, {"kv": dst})
        assert np.array_equal(dst, kv) and s._hot.replays == replays + 1
        first = plan.chunks[0][0]
        assert sorted(hinted) == sorted({c[0] for c in plan.chunks} - {first})
