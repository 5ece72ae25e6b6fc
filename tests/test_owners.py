"""Owner liveness of pending captures across hosts, pod restarts and PID namespaces (issue 9, items 6, 7).

Real processes throughout: owners run as child processes (tests/helpers_owner.py), in another UTS
namespace (another hostname) or PID namespace (``unshare``, as root) where the kernel allows it,
and die by SIGKILL. The one thing a single machine cannot provide, another kernel, is stood in for
by ``SNAPSTORE_TEST_KERNEL_ID`` (the owner then looks like a process on another host: its lock
cannot be probed and only its lease speaks for it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

import snapstore as ss
from snapstore._catalog import Txn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import helpers_proc as hp  # noqa: E402

ROOT = os.path.dirname(HERE)
CHILD = os.path.join(HERE, "helpers_owner.py")
DISK = 60_000  # one 320-token capture (~51 KB) fits; two do not
OWNERS_DIR = "owners"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    env.update(extra)
    return env


def _unshare(*flags: str) -> list[str]:
    """The unshare prefix, or skip the test with the reason when the kernel does not permit it."""
    try:
        r = subprocess.run(["unshare", *flags, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"unshare is not available: {e}")
    if r.returncode != 0:
        pytest.skip(f"unshare {' '.join(flags)} is not permitted here: {r.stderr.strip()}")
    return ["unshare", *flags]


class Child:
    """An owner process holding one pending capture of conversation ``k`` after ``n`` tokens."""

    def __init__(self, path: str, k: int, n: int, *, prefix: list[str] | None = None, hostname: str | None = None,
                 **env: str):
        cmd = [sys.executable, CHILD, "capture", path, str(k), str(n), str(DISK)]
        if hostname is not None:  # another UTS namespace: the pod restarted under a new hostname
            cmd = [*_unshare("--uts"), "sh", "-c", f"hostname {hostname} && exec \"$@\"", "sh", *cmd]
        self.p = subprocess.Popen([*(prefix or []), *cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=_env(**env))
        self.sid = int(self._read("P"))

    def _read(self, tag: str) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line.startswith(tag + " "):
            self.p.kill()
            raise AssertionError(f"child said {line!r}; stderr: {self.p.communicate()[1][-2000:]}")
        return line.split()[1]

    def send(self, cmd: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def commit(self) -> str:
        self.send("commit")
        return self._read("C")

    def die(self) -> None:
        self.send("die")
        self.p.wait(timeout=30)

    def close(self) -> None:
        if self.p.poll() is None:
            self.send("close")
            self.p.wait(timeout=30)


def _pending(path: str) -> list[int]:
    with hp.open_store(path, disk=DISK, drop_stale=False) as s:
        return [i.snapshot_id for i in s.snapshots() if i.pending]


def _gc_cli(path: str, prefix: list[str] | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    r = subprocess.run([*(prefix or []), sys.executable, "-m", "snapstore", "--dir", path, "gc", "--json",
                        *(extra or [])],
                       capture_output=True, text=True, env=_env(), timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


# -- item 7: a gc in another PID namespace ----------------------------------------------------------
def test_live_owner_in_another_pid_namespace_is_never_collected(tmp_path: Any) -> None:
    path = str(tmp_path / "store")
    hp.open_store(path, disk=DISK).close()
    pidns = _unshare("--pid", "--fork", "--mount-proc")
    child = Child(path, 1, 160, prefix=pidns)  # the engine: pid 1 of its own PID namespace
    try:
        # a gc from outside (the host's view: that pid is someone else's) ...
        assert _gc_cli(path)["dead_pending"] == []
        with hp.open_store(path, disk=DISK, drop_stale=False) as s:  # ... open-time housekeeping ...
            assert s.gc(grace=3600).dead_pending == []
            assert s.verify(deep=False).dead_pending == []
        # ... and a gc sidecar in a PID namespace of its own (the engine's pid is not visible there)
        assert _gc_cli(path, prefix=pidns)["dead_pending"] == []
        assert child.sid in _pending(path)
        assert child.commit() == str(child.sid)  # the engine's commit() succeeds
    finally:
        child.close()
    with hp.open_store(path, disk=DISK) as s:
        m = s.match(hp.conv_tokens(1)[:160])
        assert m is not None and m.snapshot_id == child.sid
        hp.check_restore(s, m, 1, 160)


# -- item 6: a pod restarted under another hostname ------------------------------------------------
def test_killed_owner_under_another_hostname_is_collected_at_once(tmp_path: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Same kernel, another hostname: the free lock proves the owner gone, without waiting for any lease."""
    path = str(tmp_path / "store")
    hp.open_store(path, disk=DISK).close()
    child = Child(path, 2, 320, hostname="pod-old-7f9c")
    child.die()
    monkeypatch.setenv("SNAPSTORE_PENDING_LEASE_S", "3600")  # an hour's lease: only the lock decides
    with hp.open_store(path, disk=DISK) as s:
        assert all(i.snapshot_id != child.sid for i in s.snapshots())
        assert s.stats().stored_bytes == 0 and s.stats().abandoned == 1
        r = s.save(hp.conv_tokens(3)[:320], hp.expected_state(3, 320))
        assert r.snapshot_id is not None, r.skipped
        s.gc(grace=3600)
        names = os.listdir(os.path.join(path, OWNERS_DIR))
        assert names == [s._lease_owner.id + ".lock"]  # the dead owner's lock file is gone, ours stays
        assert list(s._repo.db.read(Txn.owners)) == [s._lease_owner.id]


def test_owner_on_another_host_is_collected_after_its_lease(tmp_path: Any) -> None:
    """Another kernel (a pod restarted elsewhere): nothing can probe its lock; its lease expires."""
    path = str(tmp_path / "store")
    hp.open_store(path, disk=DISK).close()
    child = Child(path, 2, 320, hostname="pod-b-2", SNAPSTORE_TEST_KERNEL_ID="another-machine",
                  SNAPSTORE_PENDING_LEASE_S="1")
    child.die()
    t_dead = time.time()
    with hp.open_store(path, disk=DISK, drop_stale=False) as s:
        # within the lease it may still be alive: kept, and it pins the budget
        assert child.sid in [i.snapshot_id for i in s.snapshots() if i.pending]
        assert s.gc(grace=3600).dead_pending == []
        r = s.save(hp.conv_tokens(3)[:320], hp.expected_state(3, 320))
        assert r.snapshot_id is None and r.skipped == "disk_budget"
        time.sleep(max(0.0, t_dead + 1.3 - time.time()))
        assert s.verify(deep=False).dead_pending == [child.sid]
        rep = s.gc(grace=3600)
        assert rep.dead_pending == [child.sid]
        assert s.stats().pending == 0
        r = s.save(hp.conv_tokens(3)[:320], hp.expected_state(3, 320))
        assert r.snapshot_id is not None, r.skipped  # the new pod's saves fit again
        assert list(s._repo.db.read(Txn.owners)) == [s._lease_owner.id]


def test_owner_on_another_host_that_renews_is_never_collected(tmp_path: Any) -> None:
    """A live owner nothing can probe (another kernel, another PID namespace) keeps its captures
    for many lease periods because it renews; then its commit() succeeds."""
    path = str(tmp_path / "store")
    hp.open_store(path, disk=DISK).close()
    child = Child(path, 4, 160, prefix=_unshare("--pid", "--fork", "--mount-proc"),
                  SNAPSTORE_TEST_KERNEL_ID="another-machine", SNAPSTORE_PENDING_LEASE_S="0.5")
    try:
        deadline = time.monotonic() + 2.5  # five leases
        with hp.open_store(path, disk=DISK, drop_stale=False) as s:
            while time.monotonic() < deadline:
                assert s.gc(grace=3600).dead_pending == []
                time.sleep(0.1)
        assert _gc_cli(path)["dead_pending"] == []
        assert child.commit() == str(child.sid)
    finally:
        child.close()


# -- old-form owner tokens (schema v1 "<host>:<pid>:<start>:<nonce>") ------------------------------
def _make_legacy(s: ss.Store, k: int, token: str) -> int:
    r = s.save(hp.conv_tokens(k)[:64], hp.expected_state(k, 64), commit=False)
    assert r.snapshot_id is not None
    sid = r.snapshot_id
    s._repo.db.write(lambda c: c.set_state(sid, 0, token, time.time()))
    return sid


def _proc_start(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[19].decode()


def test_old_form_owner_tokens(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "store")
    me = f"{socket.gethostname()}:{os.getpid()}:{_proc_start(os.getpid())}:0badc0de"
    with hp.open_store(path, disk=DISK) as writer:
        running = _make_legacy(writer, 1, me)                            # provably running: this process
        elsewhere = _make_legacy(writer, 2, "pod-a-1:4242:12345:deadbeef")  # another host: unprovable
        garbage = _make_legacy(writer, 3, "not a token")
        monkeypatch.setenv("SNAPSTORE_PENDING_LEASE_S", "0.5")
        with hp.open_store(path, disk=DISK, drop_stale=False) as s:
            left = {i.snapshot_id for i in s.snapshots() if i.pending}
            assert left == {running, elsewhere}  # within one lease of its creation, kept; garbage is dead
            time.sleep(0.7)
            assert s.gc(grace=3600).dead_pending == [elsewhere]
            assert {i.snapshot_id for i in s.snapshots() if i.pending} == {running}
        assert garbage not in {i.snapshot_id for i in writer.snapshots()}


# -- the owner's lock, row and lease ---------------------------------------------------------------
def test_owner_lock_file_row_and_token(store: ss.Store) -> None:
    from snapstore._owner import OWNER_PREFIX

    d = os.path.join(store.path, OWNERS_DIR)
    own = store._lease_owner
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.listdir(d) == [own.id + ".lock"]
    assert os.stat(os.path.join(d, own.id + ".lock")).st_mode & 0o777 == 0o600
    r = store.save(list(range(50)), hp.make_state(hp.LAYOUT, 50, 1), commit=False)
    row = store._repo.db.read(lambda c: c.snapshot(r.snapshot_id))
    assert row is not None and row.owner == OWNER_PREFIX + own.id
    owners = store._repo.db.read(Txn.owners)
    assert owners[own.id].pid == os.getpid() and owners[own.id].lease == store.pending_lease == 300.0
    path = store.path
    store.close()
    assert os.listdir(d) == []
    with hp.open_store(path) as s2:
        assert list(s2._repo.db.read(Txn.owners)) == [s2._lease_owner.id]


def test_lease_is_renewed_in_the_background(store_dir: str) -> None:
    with hp.open_store(store_dir, pending_lease=0.5) as s:
        first = s._repo.db.read(Txn.owners)[s._lease_owner.id].renewed
        time.sleep(0.6)
        assert s._repo.db.read(Txn.owners)[s._lease_owner.id].renewed > first + 0.2


def test_pending_lease_configuration(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with hp.open_store(store_dir) as s:
        assert s.pending_lease == 300.0
    monkeypatch.setenv("SNAPSTORE_PENDING_LEASE_S", "7.5")
    with hp.open_store(store_dir) as s:
        assert s.pending_lease == 7.5
    with hp.open_store(store_dir, pending_lease=20) as s:  # the keyword wins over the environment
        assert s.pending_lease == 20.0
    for bad in (0, -1, 0.1, float("nan"), float("inf"), "60", True):
        with pytest.raises(ss.ConfigError, match="pending_lease"):
            hp.open_store(store_dir, pending_lease=bad)
    monkeypatch.setenv("SNAPSTORE_PENDING_LEASE_S", "soon")
    with pytest.raises(ss.ConfigError, match="SNAPSTORE_PENDING_LEASE_S"):
        hp.open_store(store_dir)


def test_cli_pending_lease_flag_for_old_form_owners(tmp_path: Any) -> None:
    path = str(tmp_path / "store")

    def verify_dead(lease: str) -> list[int]:
        r = subprocess.run([sys.executable, "-m", "snapstore", "--dir", path, "verify", "--json",
                            "--pending-lease", lease], capture_output=True, text=True, env=_env(), cwd=ROOT)
        assert r.returncode == 0, r.stderr
        dead: list[int] = json.loads(r.stdout)["dead_pending"]
        return dead

    with hp.open_store(path, disk=DISK) as writer:
        t0 = time.time()
        sid = _make_legacy(writer, 2, "pod-a-1:4242:12345:deadbeef")
        assert _gc_cli(path)["dead_pending"] == []  # the default lease (300 s) has not passed
        assert verify_dead("600") == []
        time.sleep(max(0.0, t0 + 0.6 - time.time()))
        assert verify_dead("0.5") == [sid]
        assert _gc_cli(path, extra=["--pending-lease", "0.5"])["dead_pending"] == [sid]
        r = subprocess.run([sys.executable, "-m", "snapstore", "--dir", path, "gc", "--pending-lease", "0.1"],
                           capture_output=True, text=True, env=_env(), cwd=ROOT)
        assert r.returncode == 2 and "pending_lease" in r.stderr


def test_gc_removes_leftover_lock_files_of_this_kernel_only(store: ss.Store) -> None:
    from snapstore._owner import kernel_id

    d = os.path.join(store.path, OWNERS_DIR)

    def leftover(name: str, content: str, age: float = 0.0) -> str:
        p = os.path.join(d, name)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, content.encode())
        os.close(fd)
        if age:
            os.utime(p, (time.time() - age, time.time() - age))
        return p

    here = leftover("a" * 32 + ".lock", kernel_id() + "\n")          # crashed before registering: lock free
    remote = leftover("b" * 32 + ".lock", "another-machine\n")        # another kernel: not ours to judge
    crashed_new = leftover("c" * 32 + ".new", "", age=120)            # an open that died before its rename
    fresh_new = leftover("d" * 32 + ".new", "")                       # may be an open in progress
    other = leftover("not-an-owner.lock", "")
    store.gc(grace=3600)
    left = set(os.listdir(d))
    assert os.path.basename(here) not in left and os.path.basename(crashed_new) not in left
    assert {os.path.basename(p) for p in (remote, fresh_new, other)} <= left
    assert store._lease_owner.id + ".lock" in left  # held: a live owner's lock is never removed
