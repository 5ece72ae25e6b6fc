"""Read-only stores (issue 23 item 12): ``Store.open(..., read_only=True)`` serves reads without
writing a byte (no -wal, -shm, lock, lease or owner file), refuses every change with StateError,
and follows a writer that comes along; the CLI's read commands write nothing either. The same on a
real read-only mount: tests/lifecycle/test_read_only_media.py (slow tier)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import apsw
import pytest
from support import IDENT, LAYOUT, Workload, empty_like_state, open_store, part_hashes

import snapstore as ss
from snapstore.cli.main import main

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there

W = Workload(LAYOUT, conversations=2, max_tokens=240)


def tree(root: str) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` with (mode, size, mtime_ns): what a session that writes nothing leaves alone."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    st = os.lstat(root)
    out["."] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def saved(store_dir: str) -> str:
    with open_store(store_dir) as s:
        for k in range(2):
            assert s.save(W.tokens(k)[:80], W.state(k, 80), parent=None).ok
            assert s.save(W.tokens(k)[:200], W.state(k, 200)).ok
    return store_dir


def _read_all(st: ss.Store) -> None:
    """Every read a read-only store serves, each checked."""
    for k in range(2):
        m = st.match(W.tokens(k))
        assert m is not None and m.n_tokens == 200
        d = st.describe(m)
        into = empty_like_state(W.state(k, 200))
        res = st.restore(m, into=into)
        assert d.nbytes == res.bytes_restored
        assert part_hashes(LAYOUT, into, res.rows) == part_hashes(LAYOUT, W.state(k, 200), res.rows)
    assert st.match([10**6, 1, 2]) is None
    assert len(st.snapshots()) == 4
    assert st.stats().snapshots == 4
    assert st.verify(deep=True).ok
    assert st.gc(dry_run=True).dry_run


def test_read_only_store_serves_reads_and_writes_nothing(saved: str) -> None:
    before = tree(saved)
    with ss.Store.open(saved, identity=IDENT, layout=LAYOUT, read_only=True) as st:
        assert st.read_only
        _read_all(st)
        assert tree(saved) == before  # while open: no -wal, -shm, owner lock file or temp file
    assert tree(saved) == before


def test_read_only_store_refuses_every_change(saved: str) -> None:
    before = tree(saved)
    with ss.Store.open(saved, identity=IDENT, layout=LAYOUT, read_only=True) as st:
        m = st.match(W.tokens(0))
        assert m is not None
        calls = {
            "save": lambda: st.save(W.tokens(0)[:100], W.state(0, 100)),
            "save(wait=False)": lambda: st.save(W.tokens(0)[:100], W.state(0, 100), wait=False),
            "commit": lambda: st.commit(m.snapshot_id),
            "abandon": lambda: st.abandon(m.snapshot_id),
            "delete": lambda: st.delete(m),
            "turn": lambda: st.turn(session="s"),
            "gc": lambda: st.gc(grace=0),
        }
        for name, call in calls.items():
            with pytest.raises(ss.StateError, match="open read-only") as ei:
                call()
            assert saved in str(ei.value), name
        st.flush()
    assert tree(saved) == before


def test_read_only_store_follows_a_writer(saved: str) -> None:
    """A read-only store reads the file as immutable only while nobody writes it: a writer's
    commits (in its -wal, then checkpointed) are seen by the next read."""
    ro = ss.Store.open(saved, identity=IDENT, layout=LAYOUT, read_only=True)
    try:
        toks = W.tokens(0)[:203]
        assert ro.match(toks).n_tokens == 200  # type: ignore[union-attr]
        with open_store(saved) as rw:
            r = rw.save(toks, W.state(0, 203))
            assert r.ok
            m = ro.match(toks)
            assert m is not None and m.snapshot_id == r.snapshot_id
            into = empty_like_state(W.state(0, 203))
            res = ro.restore(m, into=into)
            assert part_hashes(LAYOUT, into, res.rows) == part_hashes(LAYOUT, W.state(0, 203), res.rows)
        m = ro.match(toks)  # the writer closed (checkpointed and removed its -wal): still there
        assert m is not None and m.snapshot_id == r.snapshot_id
    finally:
        ro.close()


def _crash_with_frames(root: str) -> None:
    """Leave the catalog as a writer killed mid-life does: frames in the -wal, a -shm beside it."""
    pid = os.fork()
    if pid == 0:
        try:
            c = apsw.Connection(os.path.join(root, "snapstore.db"))
            c.pragma("wal_autocheckpoint", 0)
            c.execute("INSERT OR REPLACE INTO counters(name, value) VALUES ('remote_crash_marker', 41)")
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.path.getsize(os.path.join(root, "snapstore.db-wal")) > 0


def test_read_only_reads_a_crashed_writers_wal(saved: str) -> None:
    _crash_with_frames(saved)
    before = tree(saved)
    with ss.Store.open(saved, identity=IDENT, layout=LAYOUT, read_only=True) as st:
        assert st.stats().remote.get("crash_marker") == 41  # read through the -wal, not the file alone
        _read_all(st)
    assert tree(saved) == before


def test_wal_frames_without_shm_refused_in_one_sentence(saved: str, tmp_path: Any) -> None:
    _crash_with_frames(saved)
    os.unlink(os.path.join(saved, "snapstore.db-shm"))
    before = tree(saved)
    with pytest.raises(ss.StoreIOError, match=r"snapstore.db-wal holds changes not yet in snapstore.db .* "
                                              r"cannot be read without writing") as ei:
        ss.Store.open(saved, identity=IDENT, layout=LAYOUT, read_only=True)
    assert str(ei.value).count(". ") == 0 and f"snapstore gc --dir {saved}" in str(ei.value)
    assert tree(saved) == before
    shutil.rmtree(saved)


def test_cli_read_commands_write_nothing(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(saved)
    for argv in (["inspect"], ["inspect", "2"], ["stats"], ["verify", "--deep"], ["gc", "--dry-run"]):
        assert main(["--dir", saved, "--json", *argv]) == 0, capsys.readouterr()
        assert tree(saved) == before, argv
    capsys.readouterr()


def _as_nobody(fn: Any) -> str:
    """Run ``fn()`` in a forked child under uid/gid 65534 (nobody); what it returns, or its error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = str(fn())
        except BaseException as e:  # reported to the parent
            out = f"{type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_open_that_cannot_write_says_why(request: pytest.FixtureRequest) -> None:
    """A store this user may read but not write (another user's, readable by all): a read-write
    open says so in one sentence naming the path and the cause; read_only=True reads it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    base = tempfile.mkdtemp(prefix="snapstore-shared-")  # outside pytest's 0700 directory
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    saved = os.path.join(base, "store")
    with open_store(saved) as s:
        assert s.save(W.tokens(0)[:200], W.state(0, 200)).ok
    os.chmod(base, 0o755)
    for d, dirs, files in os.walk(saved):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)

    def read(path: str = saved) -> int:
        with ss.Store.open(path, identity=IDENT, layout=LAYOUT, read_only=True) as st:
            m = st.match(W.tokens(0))
            into = empty_like_state(W.state(0, 200))
            res = st.restore(m, into=into)  # type: ignore[arg-type]
            assert part_hashes(LAYOUT, into, res.rows) == part_hashes(LAYOUT, W.state(0, 200), res.rows)
            assert st.verify(deep=True).ok
            return m.n_tokens  # type: ignore[union-attr]

    # The checkout may lie where uid 65534 cannot read it (a clone under /root, mode 0700): the
    # child then cannot import a module or read a file of the package. Everything it runs is run
    # here first, as this user, on a copy: every module it needs is imported (and the migrations
    # read) before the fork, so the test does not depend on where the checkout lies.
    warm = os.path.join(base, "warm")
    shutil.copytree(saved, warm)
    assert read(warm) == 200 and main(["--dir", warm, "--json", "verify"]) == 0
    open_store(warm).close()
    shutil.rmtree(warm)
    before = tree(saved)

    err = _as_nobody(lambda: open_store(saved))
    assert err == (f"StoreIOError: [Errno 13] cannot open the store at {saved} for writing: this user (uid 65534) "
                   f"has no write permission on {saved}; to read it, open it with read_only=True (snapstore "
                   "inspect, stats, verify and gc --dry-run do so by themselves)"), err
    assert _as_nobody(read) == "200"
    assert _as_nobody(lambda: main(["--dir", saved, "--json", "verify"])) == "0"
    assert tree(saved) == before


_DROPPED = """
import os, sys
import snapstore as ss
from support import IDENT, LAYOUT, Workload, open_store
W = Workload(LAYOUT, conversations=1, max_tokens=80)
with open_store(sys.argv[1]) as s:
    assert s.save(W.tokens(0)[:80], W.state(0, 80)).ok
for d, _dirs, files in os.walk(sys.argv[1]):  # the store: readable by all
    os.chmod(d, 0o755)
    for f in files:
        os.chmod(os.path.join(d, f), 0o644)
os.chmod(sys.argv[2], 0o700)  # the package's folder: no longer readable once this process is uid 65534
os.setgid(65534)
os.setuid(65534)
with ss.Store.open(sys.argv[1], identity=IDENT, layout=LAYOUT, read_only=True) as st:
    print(st.match(W.tokens(0)).n_tokens)
"""


def test_a_process_that_drops_privileges_still_opens_stores(tmp_path: Any) -> None:
    """A service that imports snapstore as root and then runs as another user, which cannot read
    the package's folder (a checkout under /root): its opens do not read the package again (the
    migrations are read once per process)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    here = TESTS_DIR
    root = os.path.dirname(here)
    pkg = tmp_path / "pkg"  # a copy of the package, importable from its own folder
    shutil.copytree(os.path.join(root, "snapstore"), pkg / "snapstore",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(root, "migrations"), pkg / "snapstore" / "migrations")
    shutil.copytree(os.path.join(root, "engine"), pkg / "snapstore" / "engine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    store = tempfile.mkdtemp(prefix="snapstore-dropped-")  # outside pytest's 0700 directory
    try:
        os.chmod(store, 0o777)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), here]), PYTHONDONTWRITEBYTECODE="1")
        out = subprocess.run([sys.executable, "-c", _DROPPED, os.path.join(store, "s"), str(pkg)],
                             capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    assert out.returncode == 0 and out.stdout.split() == ["80"], out.stderr[-2000:]
