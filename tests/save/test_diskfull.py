"""Disk full and I/O errors: a failing save is a clear StoreIOError and leaves nothing behind; a failing
read is a clean RestoreError and verify names the chunk; the store keeps serving afterwards.

Faults come from a real full tmpfs (when running as root where ``mount`` works; skipped otherwise)
and from in-process fault injection in the os functions the publish/restore helpers call.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import snapstore as ss

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE = TESTS_DIR
sys.path.insert(0, HERE)
import helpers_proc as hp  # noqa: E402


def _seed_store(path: str, disk: int = 8 << 20) -> tuple[ss.Store, list[tuple[int, int, int]]]:
    st = hp.open_store(path, disk=disk)
    saved = []
    for k, n in ((0, 64), (0, 160), (1, 96), (2, 320)):
        r = st.save(hp.conv_tokens(k)[:n], hp.expected_state(k, n))
        assert r.snapshot_id is not None
        saved.append((r.snapshot_id, k, n))
    return st, saved


def _assert_clean_and_serving(st: ss.Store, saved: list[tuple[int, int, int]], before: set[int]) -> None:
    rep = st.verify(deep=True)
    assert rep.ok, rep.problems
    assert {i.snapshot_id for i in st.snapshots()} == before, "a failed save left a snapshot behind"
    st.gc(grace=0)
    rep = st.verify(deep=True)
    assert rep.ok and not rep.temp_files and not rep.orphan_files
    assert not os.listdir(os.path.join(st.path, "tmp"))
    for sid, k, n in saved:
        hp.check_restore(st, sid, k, n)
    r = st.save(hp.conv_tokens(4)[:48], hp.expected_state(4, 48))  # keeps serving
    assert r.snapshot_id is not None
    hp.check_restore(st, r.snapshot_id, 4, 48)


def _failing(orig: Callable[..., Any], err: int, after: int, counter: list[int], sizer: Callable[..., int]) -> Any:
    def inner(*a: Any, **kw: Any) -> Any:
        counter[0] += sizer(*a)
        if counter[0] > after:
            raise OSError(err, os.strerror(err))
        return orig(*a, **kw)
    return inner


@pytest.mark.parametrize("after", [0, 3000, 9000, 20000])
def test_enospc_while_writing_chunks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    st, saved = _seed_store(str(tmp_path / "s"))
    try:
        before = {i.snapshot_id for i in st.snapshots()}
        with monkeypatch.context() as m:
            m.setattr(os, "write", _failing(os.write, errno.ENOSPC, after, [0], lambda fd, data: len(data)))
            with pytest.raises(ss.StoreIOError) as ei:
                st.save(hp.conv_tokens(3)[:320], hp.expected_state(3, 320))
        assert ei.value.errno == errno.ENOSPC and "full" in str(ei.value)
        assert st.match(hp.conv_tokens(3)[:320]) is None
        _assert_clean_and_serving(st, saved, before)
    finally:
        st.close()


@pytest.mark.parametrize("fn,err", [("fsync", errno.EIO), ("fsync", errno.ENOSPC), ("link", errno.ENOSPC),
                                    ("open", errno.ENOSPC)])
def test_io_error_in_publish(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fn: str, err: int) -> None:
    st, saved = _seed_store(str(tmp_path / "s"))
    try:
        before = {i.snapshot_id for i in st.snapshots()}
        orig = getattr(os, fn)
        tmpdir = os.path.join(st.path, "tmp")

        def boom(*a: Any, **kw: Any) -> Any:
            if fn == "open" and not str(a[0]).startswith(tmpdir):
                return orig(*a, **kw)
            raise OSError(err, os.strerror(err))
        with monkeypatch.context() as m:
            m.setattr(os, fn, boom)
            with pytest.raises(ss.StoreIOError) as ei:
                st.save(hp.conv_tokens(3)[:200], hp.expected_state(3, 200))
        assert ei.value.errno == err
        _assert_clean_and_serving(st, saved, before)
    finally:
        st.close()


def test_eio_on_read(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    st, saved = _seed_store(str(tmp_path / "s"))
    try:
        sid, k, n = saved[-1]
        victim_id = next(iter(hp_chunks(st, sid)))
        victim = st._repo.blob_path(victim_id)
        vst = os.stat(victim)
        real_preadv, real_pread = os.preadv, os.pread

        def on_victim(fd: int) -> bool:
            """The device fails the file, whichever descriptor reads it (one opened now or one the
            store kept open from an earlier restore: snapstore.chunks.open_files)."""
            fst = os.fstat(fd)
            return (fst.st_dev, fst.st_ino) == (vst.st_dev, vst.st_ino)

        def p_preadv(fd: int, *a: Any, **kw: Any) -> int:
            if on_victim(fd):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_preadv(fd, *a, **kw)

        with monkeypatch.context() as m:
            m.setattr(os, "preadv", p_preadv)
            want = hp.expected_state(k, n)
            sentinel = {name: np.full_like(v, 0x11) for name, v in want.items()}
            into = {name: v.copy() for name, v in sentinel.items()}
            with pytest.raises(ss.RestoreError) as ei:
                st.restore(sid, into=into)
            if not ei.value.touched:
                assert all(into[x].tobytes() == sentinel[x].tobytes() for x in into)
            rep = st.verify(deep=True)
            assert victim_id in rep.damaged_chunks and victim_id.hex() in " ".join(rep.problems)

            def p_pread(fd: int, *a: Any, **kw: Any) -> bytes:  # EIO on the header read too
                if on_victim(fd):
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return real_pread(fd, *a, **kw)
            m.setattr(os, "pread", p_pread)
            with pytest.raises(ss.RestoreError) as ei2:
                st.restore(sid, into=into)
            assert ei2.value.touched is False
        # the fault is gone: everything restores again, the store never stopped serving
        for s2, k2, n2 in saved:
            hp.check_restore(st, s2, k2, n2)
        assert st.verify(deep=True).ok
    finally:
        st.close()


def hp_chunks(st: ss.Store, sid: int) -> set[bytes]:

    def run(c: Any) -> set[bytes]:
        out: set[bytes] = set()
        for p in c.parts(sid):
            out.update(ch.id for ch in c.part_chunks(sid, p.name) if ch is not None)
        return out
    return st._repo.db.read(run)


@pytest.fixture
def small_fs(tmp_path: Any) -> Any:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount for a real full file system")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path: str) -> tuple[ss.Store, dict[str, int], list[tuple[int, int, int]]]:
    st = hp.open_store(path, disk=64 << 20)
    outcomes = {"saved": 0, "skipped": 0, "ioerror": 0}
    saved: list[tuple[int, int, int]] = []
    for i in range(200):
        k = i % hp.N_CONV
        n = hp.MAX_N - (i // hp.N_CONV) % 8
        try:
            r = st.save(hp.conv_tokens(k)[:n], hp.expected_state(k, n), parent=None)
        except ss.StoreIOError as e:
            assert e.errno == errno.ENOSPC, e
            outcomes["ioerror"] += 1
            continue
        if r.snapshot_id is None:
            assert r.skipped in ("disk_full", "disk_reserve"), r.skipped
            outcomes["skipped"] += 1
        else:
            outcomes["saved"] += 1
            saved.append((r.snapshot_id, k, n))
    assert outcomes["skipped"] + outcomes["ioerror"] > 0 and saved, outcomes
    return st, outcomes, saved


def test_real_full_filesystem(small_fs: str) -> None:
    """Fill a 1 MiB tmpfs (budget far larger, no reserve): every save succeeds, is skipped for
    disk_full, or raises StoreIOError(ENOSPC); verify stays ok; once space is freed the store
    serves every saved snapshot exactly and saves again."""
    ballast = os.path.join(small_fs, "ballast")
    with open(ballast, "wb") as f:
        f.write(bytes(256 * 1024))
    path = os.path.join(small_fs, "store")
    st, outcomes, saved = _fill(path)
    try:
        print("real full tmpfs:", outcomes)
        rep = st.verify(deep=True)
        assert rep.ok, rep.problems
    finally:
        try:
            st.close()
        except ss.StoreIOError:
            pass  # flushing counters on a full disk may fail; the data is unaffected
    os.unlink(ballast)
    st = hp.open_store(path, disk=64 << 20)
    try:
        st.gc(grace=0)
        assert not os.listdir(os.path.join(path, "tmp"))
        rep = st.verify(deep=True)
        assert rep.ok and not rep.orphan_files, rep.problems
        for sid, k, n in saved:
            hp.check_restore(st, sid, k, n)
        r = st.save(hp.conv_tokens(5)[:16], hp.expected_state(5, 16))
        assert r.snapshot_id is not None
    finally:
        st.close()


def test_restore_on_full_filesystem(small_fs: str) -> None:
    """A full disk must not stop restores: they only read (bookkeeping is best-effort)."""
    st, _, saved = _fill(os.path.join(small_fs, "store"))
    try:
        for sid, k, n in saved:
            hp.check_restore(st, sid, k, n)
    finally:
        try:
            st.close()
        except ss.StoreIOError:
            pass
