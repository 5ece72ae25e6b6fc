"""Security checks (invariant 8): pure data, validated paths, private permissions, no symlink escape,
no cross-namespace leaks."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from typing import Any

import numpy as np
import pytest

import snapstore as ss
from snapstore.chunks.repo import Repo

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
sys.path.insert(0, TESTS_DIR)
from support import IDENT, LAYOUT, make_state, store_factory  # noqa: E402

PKG = os.path.dirname(os.path.abspath(ss.__file__))
FORBIDDEN = [r"\bimport pickle\b", r"\bpickle\.", r"\bmarshal\b", r"(?<![\w.])eval\(", r"(?<![\w.])exec\(",
             r"shell\s*=\s*True", r"\bos\.system\(", r"\byaml\.load\(", r"\bshelve\b"]


_open = store_factory(check_rows=None)


def test_no_unsafe_deserialization_in_package() -> None:
    hits = []
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(root, f), encoding="utf-8").read()
                for pat in FORBIDDEN:
                    for m in re.finditer(pat, text):
                        line = text[:m.start()].count("\n") + 1
                        hits.append(f"{f}:{line}: {pat}")
    assert not hits, hits


def test_blob_path_only_from_validated_digests(tmp_path: Any) -> None:
    repo = Repo.open(str(tmp_path / "s"))
    try:
        for bad in (b"", b"../../etc/passwd", b"\x00" * 31, b"\x00" * 33):
            with pytest.raises((ValueError, ss.SnapstoreError)):
                repo.blob_path(bad)
        p = repo.blob_path(bytes(range(32)))
        assert os.path.dirname(os.path.dirname(p)) == repo.blobs
        assert re.fullmatch(r"[0-9a-f]{64}", os.path.basename(p))
    finally:
        repo.close()


def test_permissions_files_0600_dirs_0700(tmp_path: Any) -> None:
    old = os.umask(0o022)
    try:
        st = _open(str(tmp_path / "s"))
        for n in (8, 40, 300):
            st.save(list(range(n)), make_state(LAYOUT, n, n), session="a")
        st.gc(grace=0)
        root = st.path
        bad = []
        for d, dirs, files in os.walk(root):
            for x in dirs:
                mode = stat.S_IMODE(os.lstat(os.path.join(d, x)).st_mode)
                if mode != 0o700:
                    bad.append((os.path.join(d, x), oct(mode)))
            for x in files:
                mode = stat.S_IMODE(os.lstat(os.path.join(d, x)).st_mode)
                if mode & 0o077:
                    bad.append((os.path.join(d, x), oct(mode)))
        assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
        st.close()
        assert not bad, bad[:10]
    finally:
        os.umask(old)


def _first_chunk(st: ss.Store) -> str:
    return sorted(p for _, p in st._repo.blob_files())[0]


def test_symlinked_chunk_file_is_not_followed(tmp_path: Any) -> None:
    outside = tmp_path / "outside.bin"
    st = _open(str(tmp_path / "s"))
    try:
        state = make_state(LAYOUT, 64, 1)
        sid = st.save(list(range(64)), state).snapshot_id
        victim = _first_chunk(st)
        outside.write_bytes(open(victim, "rb").read())  # identical bytes: only the link itself is wrong
        os.unlink(victim)
        os.symlink(outside, victim)
        rep = st.verify(deep=True)
        assert not rep.ok and bytes.fromhex(os.path.basename(victim)) in rep.damaged_chunks
        into = {k: np.zeros_like(v) for k, v in state.items()}
        with pytest.raises(ss.RestoreError) as ei:
            st.restore(sid, into=into)
        assert not ei.value.touched
        # gc must never delete through the link, and never the outside file
        st.gc(grace=0)
        assert outside.exists()
        from snapstore.check.verify import verify
        verify(st._repo, deep=True, repair=True)
        assert outside.exists()
    finally:
        st.close()


def test_symlinked_blob_dir_is_not_followed(tmp_path: Any) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    st = _open(str(tmp_path / "s"))
    try:
        state = make_state(LAYOUT, 64, 1)
        sid = st.save(list(range(64)), state).snapshot_id
        victim = _first_chunk(st)
        sub = os.path.dirname(victim)
        for f in os.listdir(sub):
            os.rename(os.path.join(sub, f), os.path.join(outside, f))
        os.rmdir(sub)
        os.symlink(outside, sub)
        planted = outside / ("ab" * 32)  # an orphan-looking file outside: gc must not delete it
        planted.write_bytes(b"x")
        rep = st.verify(deep=True)
        assert not rep.ok
        into = {k: np.zeros_like(v) for k, v in state.items()}
        try:
            st.restore(sid, into=into)
            restored = True
        except ss.RestoreError as e:
            restored = False
            assert not e.touched
        assert not restored, "restore read a chunk through a symlinked directory outside the store"
        st.gc(grace=0)
        assert planted.exists() and len(os.listdir(outside)) >= 2
    finally:
        st.close()


def test_store_root_symlink_components_refused(tmp_path: Any) -> None:
    real = tmp_path / "real"
    st = _open(str(real))
    st.close()
    os.rename(real / "tmp", tmp_path / "tmp-elsewhere")
    os.symlink(tmp_path / "tmp-elsewhere", real / "tmp")
    with pytest.raises(ss.SnapstoreError):
        _open(str(real))


def test_namespaces_leak_no_matches(tmp_path: Any) -> None:
    st = _open(str(tmp_path / "s"))
    try:
        toks = list(range(100))
        state = make_state(LAYOUT, 100, 3)
        a = st.save(toks, state, namespace="tenant-a")
        assert a.snapshot_id is not None
        assert st.match(toks, namespace="tenant-b") is None
        assert st.match(toks) is None
        assert st.match(toks, namespace="tenant-a") is not None
        b = st.save(toks, state, namespace="tenant-b")  # same bytes: no dedup of snapshots across tenants
        assert b.snapshot_id != a.snapshot_id and b.parent_id is None
        into = {k: np.zeros_like(v) for k, v in state.items()}
        m = st.match(toks, namespace="tenant-b")
        assert m is not None and m.snapshot_id == b.snapshot_id
        st.restore(m, into=into)
        c = st.save(toks + [5, 6], make_state(LAYOUT, 102, 4), namespace="tenant-c")
        assert c.parent_id is None  # parent="auto" never crosses a namespace
    finally:
        st.close()


# -- issue 23 item 2: nothing is removed through a link in place of tmp/ or owners/ ----------------
_LOCK_NAME = "0123456789abcdef0123456789abcdef.lock"


def _bait(d: Any) -> list[str]:
    """An outside directory holding what gc removes from a store: an old temp file, an owner lock
    file nobody holds, a stale half-made lock file; returns their names."""
    d.mkdir()
    names = ["w-precious", _LOCK_NAME, "fedcba9876543210fedcba9876543210.new"]
    for n in names:
        (d / n).write_bytes(b"someone else's data")
        os.utime(d / n, (1, 1))  # old: past every grace period
    return names


@pytest.mark.parametrize("entry", ["tmp", "owners"])
def test_cli_and_library_gc_refuse_a_linked_store_dir(tmp_path: Any, entry: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from snapstore.cli.main import main
    from snapstore.lifecycle.gc import gc

    root = tmp_path / "s"
    _open(str(root)).close()
    outside = tmp_path / "outside"
    names = _bait(outside)
    (root / entry).rename(tmp_path / "was")
    os.symlink(outside, root / entry)
    code = main(["--dir", str(root), "--json", "gc", "--grace", "0"])
    err = json.loads(capsys.readouterr().err)
    assert code != 0 and f"{root / entry} is a symbolic link" in err["error"], err
    with pytest.raises(ss.StoreFormatError, match="symbolic link"):
        gc(Repo.open(str(root)), grace=0)
    with pytest.raises(ss.StoreFormatError, match="symbolic link"):
        _open(str(root))
    for ro in (True, False):
        with pytest.raises(ss.StoreFormatError, match=f"{entry} must be a real directory"):
            ss.Store.open(str(root), identity=IDENT, layout=LAYOUT, read_only=ro)
    assert sorted(os.listdir(outside)) == sorted(names)


@pytest.mark.parametrize("entry", ["tmp", "owners"])
def test_gc_removes_nothing_through_a_link_made_after_the_open(tmp_path: Any, entry: str) -> None:
    """The open's check cannot see a link planted later: every removal goes through a directory
    descriptor opened without following links, so the files it points at stay."""
    st = _open(str(tmp_path / "s"))
    try:
        outside = tmp_path / "outside"
        names = _bait(outside)
        os.rename(os.path.join(st.path, entry), tmp_path / "was")
        os.symlink(outside, os.path.join(st.path, entry))
        rep = st.gc(grace=0)
        assert rep.temp_files == []
    finally:
        st.close()
    assert sorted(os.listdir(outside)) == sorted(names)


def test_database_file_link_refused(tmp_path: Any) -> None:
    root = tmp_path / "s"
    _open(str(root)).close()
    os.rename(root / "snapstore.db", tmp_path / "elsewhere.db")
    os.symlink(tmp_path / "elsewhere.db", root / "snapstore.db")
    with pytest.raises(ss.StoreFormatError, match="snapstore.db is a symbolic link"):
        _open(str(root))
    from snapstore.chunks.repo import SnapshotRepo
    with pytest.raises(ss.StoreFormatError, match="snapstore.db is a symbolic link"):
        SnapshotRepo.open(str(root))


def test_gc_removes_an_interrupted_bench_scratch_store_and_nothing_it_links_to(tmp_path: Any) -> None:
    """`snapstore bench` keeps a scratch store in tmp/w-bench-*; an interrupted run leaves it, and gc
    removes it once older than the grace (a fresh one stays), never following a link inside it."""
    outside = tmp_path / "outside"
    names = _bait(outside)
    st = _open(str(tmp_path / "s"))
    try:
        old = os.path.join(st.path, "tmp", "w-bench-left")
        _open(old).close()  # a store, as bench's scratch store is
        os.symlink(outside, os.path.join(old, "link"))
        fresh = os.path.join(st.path, "tmp", "w-bench-running")
        os.mkdir(fresh)
        os.utime(old, (1, 1))
        dry = st.gc(grace=3600, dry_run=True)
        assert dry.temp_files == [old] and os.path.isdir(old)
        rep = st.gc(grace=3600)
        assert rep.temp_files == [old]
        assert not os.path.exists(old) and os.path.isdir(fresh)
    finally:
        st.close()
    assert sorted(os.listdir(outside)) == sorted(names)
