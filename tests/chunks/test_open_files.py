"""Issue 31: small chunk files kept open, with their checked headers, for plans made from memory
(snapstore.chunks.open_files), for as long as the catalog generation they were checked under stands.

- a repeated restore of a 12-link chain opens no chunk file, and restores exactly;
- a change to the catalog by another process (the generation moves) closes every kept file: the next
  restore opens and checks its files again, and a file the other process deleted is held no longer;
- a file that fails a read is opened afresh next time (tests/save/test_diskfull.py, test_eio_on_read);
- the bounds (file size, count, bytes), an older stamp, a read-only store, close().
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from support.fds import open_targets
from support.pagecache import cached_pages, drop_cache
from test_plan_memo import BLOCK, _chain, _open, _state

import snapstore as ss
from snapstore.catalog.rate_queries import RateRow
from snapstore.chunks import direct_io
from snapstore.chunks.chunkfile import ChunkHeader
from snapstore.chunks.open_files import OpenFiles

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there


def _dest(tokens: list[int]) -> dict[str, np.ndarray]:
    want = _state(tokens, 0)
    return {"kv": np.zeros_like(want["kv"]), "h": np.zeros(4, np.float32)}


def _chunk_opens(s: ss.Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Chunk files opened from here on (os.open of a path under blobs/)."""
    seen: list[str] = []
    real = os.open

    def counting(path: Any, *a: Any, **kw: Any) -> int:
        if os.fspath(path).startswith(s._repo.blobs + os.sep):
            seen.append(os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "open", counting)
    return seen


def _deleted_open() -> list[str]:
    """Files this process holds open that were unlinked."""
    return [t for t in open_targets() if t.endswith(" (deleted)")]


def test_a_repeated_small_restore_opens_no_chunk_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = list(range(10, 10 + 48 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 12)
        s.restore(sid, _dest(tokens))  # planned and opened: the plan and the files kept
        s.restore(sid, _dest(tokens))
        hits = s._repo.files.hits
        opened = _chunk_opens(s, monkeypatch)
        dst = _dest(tokens)
        s.restore(sid, dst)
        want = _state(tokens, 0)
        assert np.array_equal(dst["kv"], want["kv"]) and np.array_equal(dst["h"], want["h"])
        assert opened == []
        assert s._repo.files.hits >= hits + 12  # one kept file per link at least (kv), taken


def test_another_process_changing_the_catalog_closes_the_kept_files(tmp_path: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chains restored here (their files kept). Another process deletes one of them and
    collects its files: the next restore here (of the other) plans under the new generation,
    closes every kept file — the deleted chain's files are held open no longer — and opens its
    own files again, then restores exactly."""
    tokens = list(range(10, 10 + 24 * BLOCK))
    other_tokens = [7, *tokens[1:]]
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 4)
        other = _chain(s, other_tokens, 3, seed=5)
        for x, toks in ((sid, tokens), (other, other_tokens)):
            s.restore(x, _dest(toks))
        assert len(s._repo.files) > 0
        code = ("import os, sys; sys.path[:0] = sys.argv[1].split(os.pathsep); import test_plan_memo as t\n"
                "with t._open(sys.argv[2]) as s:\n"
                "    s.delete(int(sys.argv[3])); s.gc(grace=0)\n")
        subprocess.run([sys.executable, "-c", code, os.pathsep.join([TESTS_DIR, os.path.join(TESTS_DIR, "plan")]),
                        str(tmp_path / "s"), str(other)],
                       check=True, timeout=120, capture_output=True)
        assert any(str(tmp_path / "s") in d for d in _deleted_open())  # held by the kept files, so far
        opened = _chunk_opens(s, monkeypatch)
        dst = _dest(tokens)
        s.restore(sid, dst)
        assert np.array_equal(dst["kv"], _state(tokens, 0)["kv"])
        assert len(opened) >= 4  # every link's files opened and checked again
        assert not any(str(tmp_path / "s") in d for d in _deleted_open())


def test_a_damaged_kept_file_is_found_and_a_heal_is_read(tmp_path: Any) -> None:
    """A kept file damaged in place is found by its checksum (nothing kept vouches for bytes), the
    chunk is quarantined, a save heals it, and the next restore reads the healed file exactly."""
    tokens = list(range(10, 10 + 24 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 4)
        s.restore(sid, _dest(tokens))
        s.restore(sid, _dest(tokens))
        row = s._repo.db.conn().execute(
            "SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'kv'", (sid,)).fetchone()
        blob = s._repo.blob_path(bytes(row[0]))
        os.chmod(blob, 0o600)
        with open(blob, "r+b") as f:  # in place: the kept descriptor reads the damage
            f.seek(-3, os.SEEK_END)
            f.write(b"\xff\xfe\xfd")
        with pytest.raises(ss.CorruptChunkError):
            s.restore(sid, _dest(tokens))
        with pytest.raises(ss.CorruptChunkError) as ei:  # quarantined: refused at the plan
            s.restore(sid, _dest(tokens))
        assert ei.value.touched is False
        res = s.save(tokens, _state(tokens, 0), rows=len(tokens), parent="auto")  # heals the chunk
        assert res.ok
        for _ in range(2):
            dst = _dest(tokens)
            s.restore(sid, dst)
            assert np.array_equal(dst["kv"], _state(tokens, 0)["kv"])


_HEAD = ChunkHeader(0, 100, 100, b"c" * 16)


def _file(tmp_path: Any, name: str, size: int) -> int:
    """A file of ``size`` bytes that starts with _HEAD's bytes."""
    p = tmp_path / name
    head = _HEAD.pack()
    p.write_bytes(head + b"\0" * (size - len(head)))
    return os.open(p, os.O_RDONLY)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_the_bounds_and_the_stamps(tmp_path: Any) -> None:
    """Only small files are kept, at most ``max_files`` and ``max_bytes`` of them (oldest closed
    first); a take under an older stamp gets nothing and drops nothing; a newer one closes all."""
    head = _HEAD
    files = OpenFiles(max_files=3, max_bytes=1 << 20)
    s1, s0, s2 = (b"n", 5), (b"n", 4), (b"n", 6)
    big = _file(tmp_path, "big", 5 << 20)
    files.keep(s1, b"big", big, head, 5 << 20)
    assert len(files) == 0  # a large file is not kept
    os.close(big)
    fds = [_file(tmp_path, f"f{i}", 100) for i in range(5)]
    for i, fd in enumerate(fds):
        files.keep(s1, bytes([i]), fd, head, 164)
        os.close(fd)
    assert len(files) == 3
    assert files.take(s1, bytes([0]), 100, b"c" * 16) is None  # the oldest went first
    got = files.take(s1, bytes([4]), 100, b"c" * 16)
    assert got is not None and got[1] == head
    os.close(got[0])
    assert files.take(s1, bytes([4]), 99, b"c" * 16) is None  # a header that does not match the row
    assert files.take(s1, bytes([4]), 100, b"c" * 16) is None  # ... and it was closed
    assert files.take(s0, bytes([3]), 100, b"c" * 16) is None  # an older stamp: nothing
    kept_fd = files._kept[bytes([3])][0]
    assert not _closed(kept_fd)
    assert files.take(s2, bytes([3]), 100, b"c" * 16) is None  # a newer one: everything closed
    assert len(files) == 0 and _closed(kept_fd)
    many = OpenFiles(max_files=100, max_bytes=300)
    for i in range(3):
        fd = _file(tmp_path, f"g{i}", 100)
        many.keep(s1, bytes([i]), fd, head, 164)
        os.close(fd)
    assert len(many) == 1  # 164-byte files, at most 300 bytes kept
    many.close()
    assert len(many) == 0


def test_closing_the_store_closes_the_kept_files_and_read_only_keeps_none(tmp_path: Any) -> None:
    tokens = list(range(10, 10 + 24 * BLOCK))
    before = len(os.listdir("/proc/self/fd"))
    s = _open(tmp_path / "s")
    sid = _chain(s, tokens, 4)
    s.restore(sid, _dest(tokens))
    kept = [fd for fd, *_ in s._repo.files._kept.values()]
    assert kept
    s.close()
    assert all(_closed(fd) for fd in kept)
    assert len(os.listdir("/proc/self/fd")) <= before
    with ss.Store.open(str(tmp_path / "s"), identity=s.identity, layout=s.layout, read_only=True) as ro:
        for _ in range(2):
            ro.restore(sid, _dest(tokens))
        assert len(ro._repo.files) == 0


def test_direct_reads_never_set_o_direct_on_a_kept_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept descriptor is a dup: it shares its open file description, O_DIRECT flag included, with
    every restore that takes it. A restore that finds a kept file cold reads it with O_DIRECT through
    a description of its own: the kept one never has the flag (else another thread's buffered read
    of the same file into an unaligned buffer fails with EINVAL meanwhile)."""
    layout = ss.Layout(rows={"kv": ss.Rows("uint8", (4096,))})
    tokens = list(range(10, 10 + 256))
    state = {"kv": np.random.default_rng(3).integers(0, 256, (256, 4096), dtype=np.uint8)}
    with ss.Store.open(str(tmp_path / "s"), identity=ss.Identity(build="t", pack="p", kv="u8"), layout=layout,
                       budget=ss.Budget(reserve_bytes=0, ram_bytes=0), direct_reads=True) as s:
        res = s.save(tokens, state)
        assert res.ok and res.snapshot_id is not None
        sid = res.snapshot_id
        for _ in range(2):
            s.restore(sid, {"kv": np.zeros_like(state["kv"])})
        kept = [fd for fd, *_ in s._repo.files._kept.values()]
        assert kept
        files = [os.path.join(r, f) for r, _, fs in os.walk(s._repo.blobs) for f in fs]
        for f in files:
            drop_cache(f)
        if any(cached_pages(f) for f in files):
            pytest.skip("this file system keeps files in memory: no cold reads to test")
        flags: list[int] = []
        real = direct_io.DirectReads.read

        def read(self: Any, fd: int, *a: Any) -> int:
            flags.extend(fcntl.fcntl(k, fcntl.F_GETFL) for k in kept)
            return real(self, fd, *a)

        monkeypatch.setattr(direct_io.DirectReads, "read", read)
        dst = np.zeros_like(state["kv"])
        s.restore(sid, {"kv": dst})
        assert np.array_equal(dst, state["kv"])
        assert flags, "the cold restore did not read with O_DIRECT"
        assert not any(f & direct_io.O_DIRECT for f in flags)


def _kept_chain(tmp_path: Any, name: str = "s") -> tuple[ss.Store, int, list[int]]:
    tokens = list(range(10, 10 + 24 * BLOCK))
    s = _open(tmp_path / name)
    sid = _chain(s, tokens, 4)
    s.restore(sid, _dest(tokens))
    return s, sid, tokens


def test_a_header_damaged_in_place_is_found_before_a_byte_is_written(tmp_path: Any) -> None:
    """The payload checksum cannot see a header damaged in place; a take reads the header again and
    compares it with the one checked, so the restore opens the file, finds the damage and writes
    nothing (without: the kept header served on, the damage unseen until the file was dropped)."""
    s, sid, tokens = _kept_chain(tmp_path)
    with s:
        row = s._repo.db.conn().execute(
            "SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'kv'", (sid,)).fetchone()
        blob = s._repo.blob_path(bytes(row[0]))
        os.chmod(blob, 0o600)
        with open(blob, "r+b") as f:
            f.write(b"XXXX")  # the magic
        dst = _dest(tokens)
        with pytest.raises(ss.CorruptChunkError) as ei:
            s.restore(sid, dst)
        assert ei.value.touched is False and not dst["kv"].any()


def test_out_of_descriptors_a_take_opens_the_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE on the dup of a kept file: the restore opens the file as usual (a raw OSError never
    reaches the caller); when that open fails too, a RestoreError says so, nothing written."""
    import errno

    s, sid, tokens = _kept_chain(tmp_path)
    with s:
        def emfile(fd: int) -> int:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        monkeypatch.setattr(os, "dup", emfile)
        dst = _dest(tokens)
        s.restore(sid, dst)
        assert np.array_equal(dst["kv"], _state(tokens, 0)["kv"])
        real_open = os.open

        def no_open(path: Any, *a: Any, **kw: Any) -> int:
            if os.fspath(path).startswith(s._repo.blobs):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return real_open(path, *a, **kw)

        monkeypatch.setattr(os, "open", no_open)
        dst = _dest(tokens)
        with pytest.raises(ss.RestoreError) as ei:
            s.restore(sid, dst)
        assert ei.value.touched is False and not dst["kv"].any()


def test_a_store_dropped_unclosed_and_a_forked_child_hold_no_kept_file(tmp_path: Any) -> None:
    """A store collected without close() closes its kept files; a forked child closes its copies at
    once (the parent keeps its own)."""
    import gc

    s, _, _ = _kept_chain(tmp_path)
    kept = [fd for fd, *_ in s._repo.files._kept.values()]
    assert kept
    pid = os.fork()
    if pid == 0:  # the child: every copy closed, by the fork hook alone
        os._exit(0 if all(_closed(fd) for fd in kept) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not any(_closed(fd) for fd in kept)  # the parent's are untouched
    del s
    gc.collect()
    assert all(_closed(fd) for fd in kept)


def test_any_plan_of_the_process_under_a_newer_generation_closes_the_kept_files(tmp_path: Any) -> None:
    """Another store of this process on the same catalog deletes a snapshot (the generation moves):
    a describe by a third store, planned from memory, closes the files the first store kept."""
    tokens = list(range(10, 10 + 24 * BLOCK))
    with _open(tmp_path / "s") as a, _open(tmp_path / "s") as b, _open(tmp_path / "s") as c:
        sid = _chain(a, tokens, 4)
        other = _chain(a, [7, *tokens[1:]], 3, seed=5)
        a.restore(sid, _dest(tokens))
        assert len(a._repo.files) > 0
        b.delete(other)
        c.describe(sid)
        assert len(a._repo.files) == 0


def test_the_process_budget_holds_across_stores(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from snapstore.chunks import open_files

    monkeypatch.setattr(open_files._SLOTS, "limit", open_files._SLOTS.used + 3)
    s1, _, _ = _kept_chain(tmp_path, "a")
    s2, _, _ = _kept_chain(tmp_path, "b")
    with s1, s2:
        assert len(s1._repo.files) + len(s2._repo.files) <= 3
    assert open_files._SLOTS.used <= open_files._SLOTS.limit - 3


def test_a_store_that_only_looks_up_probes_its_chain_without_opening_it_again(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler's store never restores, so it has no restore's files to probe through. A lookup
    weighed against prefill that probes (here the disk is too slow for the bound to decide) keeps
    the files its probes opened a second time (their headers checked against the rows), under the
    plan's stamp: the next lookups and estimates open no chunk file, and a probe through a kept
    descriptor still sees the page cache as it is (a dropped file is cold)."""
    tokens = list(range(10, 10 + 48 * BLOCK))
    with _open(tmp_path / "s") as saver:
        sid = _chain(saver, tokens, 12)
    with _open(tmp_path / "s") as s:
        s._rates.load([RateRow("cold", 1.0, 1e-9, 1e-3, 1e-18, 1e-12, 3, 0.0)])  # 1 KB/s
        first = s.lookup(tokens, prefill_tokens_per_s=1_000.0)
        s.lookup(tokens, prefill_tokens_per_s=1_000.0)  # the same files probed again: kept
        assert len(s._repo.files) > 0
        opened = _chunk_opens(s, monkeypatch)
        again = s.lookup(tokens, prefill_tokens_per_s=1_000.0)
        assert first is not None and again is not None and first.why is not None and again.why is not None
        assert again.snapshot_id == first.snapshot_id == sid
        assert again.why.considered[0].estimate.tiers == first.why.considered[0].estimate.tiers
        assert set(first.why.considered[0].estimate.tiers) == {"warm"}  # probed, not bounded
        assert opened == []
        files = [os.path.join(r, f) for r, _, fs in os.walk(s._repo.blobs) for f in fs]
        for f in files:
            drop_cache(f)
        if any(cached_pages(f) for f in files):
            pytest.skip("this file system keeps files in memory: no cold files to probe")
        opened.clear()  # the drops' own opens
        est = s.estimate_restore(sid)
        assert opened == []
        assert est.tiers.get("cold", 0) > 0 and "warm" not in est.tiers, est.tiers


def test_a_probe_keeps_only_a_file_whose_header_describes_the_row(tmp_path: Any) -> None:
    """``offer``: a file offered the second time under one stamp is kept if its header, read and
    checked against the row (raw length, checksum, file size), describes it; a mismatch, a plan not
    made from memory (no stamp), a first offer, or one under a stamp that moved since, keeps nothing."""
    stamp = (b"n", 5)
    files = OpenFiles(max_files=8)
    fd = _file(tmp_path, "f", 164)
    try:
        for args in ((None, 164, 100, b"c" * 16), (stamp, 164, 99, b"c" * 16), (stamp, 164, 100, b"d" * 16),
                     (stamp, 165, 100, b"c" * 16)):
            for _ in range(2):
                files.offer(args[0], b"a", fd, *args[1:])  # type: ignore[arg-type]
        assert len(files) == 0
        files.offer(stamp, b"a", fd, 164, 100, b"c" * 16)
        assert len(files) == 0  # once: a chain looked up once costs no header read
        assert files.resident(stamp, b"a", 164) is None  # none kept: the caller opens the file
        files.offer(stamp, b"a", fd, 164, 100, b"c" * 16)
        assert len(files) == 1
        assert files.resident(stamp, b"a", 164) is True  # just written: cached
        assert files.resident((b"n", 4), b"a", 164) is None  # an older stamp: not probed through
        files.offer(stamp, b"b", fd, 164, 100, b"c" * 16)
        files.offer((b"n", 6), b"b", fd, 164, 100, b"c" * 16)  # the stamp moved: everything dropped, "b" once
        assert len(files) == 0
    finally:
        os.close(fd)
        files.close()


def test_probing_a_cold_chain_reads_none_of_it(tmp_path: Any) -> None:
    """An estimate reads nothing: a cold file a probe opened is not kept (keeping it means reading
    its header, from the disk, and the read-ahead around it would make a small file look cached to
    every later probe). Weighed lookups of a cold chain, on a disk too slow for the bound to
    decide, leave its files as cold as they were, and say so every time (without: the second
    lookup found the first one's header reads and restored "from the page cache")."""
    tokens = list(range(10, 10 + 48 * BLOCK))
    with _open(tmp_path / "s") as saver:
        _chain(saver, tokens, 12)
    with _open(tmp_path / "s") as s:
        s._rates.load([RateRow("cold", 1.0, 1e-9, 1e-3, 1e-18, 1e-12, 3, 0.0)])  # 1 KB/s
        files = [os.path.join(r, f) for r, _, fs in os.walk(s._repo.blobs) for f in fs]
        for f in files:
            drop_cache(f)
        if any(cached_pages(f) for f in files):
            pytest.skip("this file system keeps files in memory: no cold files to probe")
        for _ in range(3):
            assert s.lookup(tokens, prefill_tokens_per_s=1_000.0) is None  # reading beats a 1 KB/s disk
            assert sum(cached_pages(f) for f in files) == 0
        assert len(s._repo.files) == 0
