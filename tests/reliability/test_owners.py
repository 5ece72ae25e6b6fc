"""Owner liveness of pending captures across hosts, pod restarts and PID namespaces (issue 9, items 6, 7).

Real processes throughout: owners run as child processes (tests/helpers_owner.py), in another UTS
namespace (another hostname) or PID namespace (``unshare``, as root) where the kernel allows it,
and die by SIGKILL. The one thing a single machine cannot provide, another kernel, is stood in for
by ``HELPER_KERNEL_ID`` in the child (it sets the private ``lifecycle.owner._kernel_override`` hook there:
the owner then looks like a process on another host, its lock cannot be probed and only its lease
speaks for it). Forked children use a real ``os.fork()``.
"""

from __future__ import annotations

import gc as pygc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import apsw
import pytest

import snapstore as ss
from snapstore.catalog.queries import Txn

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE = TESTS_DIR
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
    child = Child(path, 2, 320, hostname="pod-b-2", HELPER_KERNEL_ID="another-machine",
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
                  HELPER_KERNEL_ID="another-machine", SNAPSTORE_PENDING_LEASE_S="0.5")
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
    from snapstore.lifecycle.owner import OWNER_PREFIX

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


def _leftover(d: str, name: str, content: str, age: float = 0.0) -> str:
    p = os.path.join(d, name)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, content.encode())
    os.close(fd)
    if age:
        os.utime(p, (time.time() - age, time.time() - age))
    return p


def test_gc_removes_leftover_lock_files_it_can_lock(store: ss.Store) -> None:
    """Review 1 item 7: lock files of another kernel (another host, or this one before a reboot)
    are no longer left forever: gone once a minute old and their lock is free."""
    import fcntl

    from snapstore.lifecycle.owner import kernel_id

    d = os.path.join(store.path, OWNERS_DIR)
    here = _leftover(d, "a" * 32 + ".lock", kernel_id() + "\n")              # crashed before registering: lock free
    remote = _leftover(d, "b" * 32 + ".lock", "another-machine\n")            # may be registering right now
    rebooted = _leftover(d, "e" * 32 + ".lock", "boot-before-reboot\n", age=120)  # nothing holds it any more
    held_remote = _leftover(d, "f" * 32 + ".lock", "another-machine\n", age=120)
    crashed_new = _leftover(d, "c" * 32 + ".new", "", age=120)                # an open that died before its rename
    fresh_new = _leftover(d, "d" * 32 + ".new", "")                           # may be an open in progress
    other = _leftover(d, "not-an-owner.lock", "")
    holder = os.open(held_remote, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its owner's lock, seen through the network fs
        store.gc(grace=3600)
    finally:
        os.close(holder)
    left = set(os.listdir(d))
    assert not {os.path.basename(p) for p in (here, rebooted, crashed_new)} & left
    assert {os.path.basename(p) for p in (remote, held_remote, fresh_new, other)} <= left
    assert store._lease_owner.id + ".lock" in left  # held: a live owner's lock is never removed


def test_lock_file_of_an_owner_on_another_kernel_goes_after_its_lease(tmp_path: Any) -> None:
    """Review 1 item 7, end to end: a killed owner of another kernel id (this host before a reboot)
    loses row and captures after its lease, and its lock file once it is a minute old."""
    path = str(tmp_path / "store")
    hp.open_store(path, disk=DISK).close()
    child = Child(path, 2, 160, HELPER_KERNEL_ID="boot-before-reboot", SNAPSTORE_PENDING_LEASE_S="1")
    child.die()
    t_dead = time.time()
    d = os.path.join(path, OWNERS_DIR)
    with hp.open_store(path, disk=DISK, drop_stale=False) as s:
        (lock,) = [n for n in os.listdir(d) if n != s._lease_owner.id + ".lock"]
        time.sleep(max(0.0, t_dead + 1.3 - time.time()))
        assert s.gc(grace=3600).dead_pending == [child.sid]
        assert list(s._repo.db.read(lambda c: c.owners())) == [s._lease_owner.id]
        assert lock in os.listdir(d)  # a minute has not passed since it was made
        then = time.time() - 120
        os.utime(os.path.join(d, lock), (then, then))  # as if a minute had passed
        s.gc(grace=3600)
        assert os.listdir(d) == [s._lease_owner.id + ".lock"]


def test_fifo_in_owners_does_not_hang_gc(tmp_path: Any) -> None:
    """Review 1 item 8: a FIFO named like a lock file (of an unregistered owner that a pending
    capture names) made every gc block in open() forever."""
    from snapstore.chunks.repo import Repo
    from snapstore.lifecycle.owner import OWNER_PREFIX

    path = str(tmp_path / "store")
    fifo_id = "0123456789abcdef0123456789abcdef"
    with hp.open_store(path, disk=DISK) as s:
        r = s.save(hp.conv_tokens(1)[:64], hp.expected_state(1, 64))
        assert r.snapshot_id is not None
        sid = r.snapshot_id
    repo = Repo(path)  # made pending for that owner without any sweep (an old one would hang here)
    try:
        repo.db.write(lambda c: c.set_state(sid, 0, OWNER_PREFIX + fifo_id, time.time()))
    finally:
        repo.close()
    fifo = os.path.join(path, OWNERS_DIR, fifo_id + ".lock")
    os.mkfifo(fifo, 0o600)
    assert _gc_cli(path)["dead_pending"] == [sid]  # no owner row, no lock: dead; and gc returns
    assert os.path.exists(fifo)  # not a lock file: left alone


# -- review 1: fork, unclosed stores, a removed owners/ --------------------------------------------
def _wait_child(pid: int, timeout: float = 60.0) -> int:
    """The exit code of forked child ``pid``; kills it (by its pid) and fails when it hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} hung for {timeout} s")


def test_forked_child_closing_its_copy_leaves_the_parents_owner_alone(tmp_path: Any) -> None:
    """Review 1 item 1: a forked child that closed its copy of the Store (left a ``with`` block)
    retired the parent's owner: its captures dropped, its lock file unlinked, later ones collected."""
    path = str(tmp_path / "store")
    s = hp.open_store(path, disk=1 << 30)
    try:
        before = s.save(hp.conv_tokens(1)[:64], hp.expected_state(1, 64), commit=False)
        lock = os.path.join(path, OWNERS_DIR, s._lease_owner.id + ".lock")
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                # the inherited owner refuses to register or retire (a pending capture made here
                # would be blamed on the parent); a throw-away connection stands in for a transaction
                scratch = apsw.Connection(":memory:")
                for act in (s._lease_owner.renew, s._lease_owner.retire):
                    try:
                        act(scratch)
                    except ss.StateError as e:
                        code = 0 if "fork" in str(e) and code != 3 else 3
                    else:
                        code = 3
                s.close()  # leaving a `with` block in a forked worker
            except BaseException:
                code = 2
            finally:
                os._exit(code)
        assert _wait_child(pid) == 0
        assert os.path.exists(lock)
        assert list(s._repo.db.read(lambda c: c.owners())) == [s._lease_owner.id]
        after = s.save(hp.conv_tokens(3)[:64], hp.expected_state(3, 64), commit=False)
        assert _gc_cli(path)["dead_pending"] == []  # another process sweeps
        assert s.commit(before).snapshot_id == before.snapshot_id
        assert s.commit(after).snapshot_id == after.snapshot_id
    finally:
        s.close()


def test_killed_engine_is_collected_while_its_forked_child_lives(tmp_path: Any) -> None:
    """Review 1 item 2: a forked helper's inherited lock fd kept a SIGKILLed engine's flock held,
    so its captures (and budget) stayed pinned as long as the helper lived."""
    path = str(tmp_path / "store")
    hp.open_store(path, disk=DISK).close()
    child = Child(path, 2, 320)
    child.send("fork")
    helper = int(child._read("F"))
    try:
        child.die()
        assert _pending(path) == []  # collected at once by the next open, the helper still running
        os.kill(helper, 0)
    finally:
        os.kill(helper, signal.SIGKILL)


def _lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "snapstore-lease"]


def test_store_dropped_without_close_frees_its_thread_fds_and_lock(tmp_path: Any) -> None:
    """Review 1 item 6: an unclosed Store kept its lease thread, connection and flock for the
    life of the process (the thread held the owner strongly), pinning its captures."""
    path = str(tmp_path / "store")
    hp.open_store(path, disk=1 << 30).close()
    pygc.collect()
    threads, fds = len(_lease_threads()), len(os.listdir("/proc/self/fd"))
    for k in range(10):
        s = hp.open_store(path, disk=1 << 30, drop_stale=False)
        s.save(hp.conv_tokens(k)[:64], hp.expected_state(k, 64), commit=False)
        del s
    pygc.collect()
    for t in _lease_threads():
        t.join(timeout=10)
    assert len(_lease_threads()) == threads
    assert len(os.listdir("/proc/self/fd")) <= fds + 1
    with hp.open_store(path, disk=1 << 30, drop_stale=False) as s:
        assert s.stats().pending == 0  # their locks are free: provably gone, collected at once


def test_owner_survives_removal_of_owners_dir_and_makes_its_file_again(tmp_path: Any) -> None:
    """Review 1, suspected: an operator removing owners/ made every live owner on this kernel read
    as dead at once (no file → dead); the owner never noticed its file was gone."""
    import fcntl

    path = str(tmp_path / "store")
    d = os.path.join(path, OWNERS_DIR)
    with hp.open_store(path, disk=1 << 30) as s:  # lease 300 s: no renewal during the test
        r = s.save(hp.conv_tokens(1)[:64], hp.expected_state(1, 64), commit=False)
        shutil.rmtree(d)
        assert _gc_cli(path)["dead_pending"] == []  # no file: the lease speaks for it
        r2 = s.save(hp.conv_tokens(2)[:64], hp.expected_state(2, 64), commit=False)  # renews: makes it again
        lock = os.path.join(d, s._lease_owner.id + ".lock")
        fd = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held: the lock speaks for the owner again
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert s.commit(r).snapshot_id == r.snapshot_id and s.commit(r2).snapshot_id == r2.snapshot_id
    assert os.listdir(d) == []
    with hp.open_store(path, disk=1 << 30, pending_lease=0.5) as s:  # the lease thread notices too
        os.unlink(os.path.join(d, s._lease_owner.id + ".lock"))
        deadline = time.monotonic() + 10
        while not os.listdir(d) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.listdir(d) == [s._lease_owner.id + ".lock"]


def test_fork_while_another_thread_registers_an_owner(tmp_path: Any) -> None:
    """Review 1, suspected: a fork while another thread held the owner registry's lock left it
    held forever in the child, whose Store.open then hung."""
    import snapstore.lifecycle.owner as own

    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with own._live_lock:
            held.set()
            go.wait(0.5)  # bounded: a fork waits for it (it must not copy a half-made registry)

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            hp.open_store(str(tmp_path / "child")).close()
            code = 0
        finally:
            os._exit(code)
    try:
        assert _wait_child(pid, timeout=30) == 0
    finally:
        go.set()
        t.join()


def test_kernel_id_is_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 1 nit: a test knob (``$SNAPSTORE_TEST_KERNEL_ID``) was read on every probe in
    production; tests now set the private ``_kernel_override`` hook in their child process."""
    import snapstore.lifecycle.owner as own

    real = own.kernel_id()
    monkeypatch.setenv("SNAPSTORE_TEST_KERNEL_ID", "another-machine")
    assert own.kernel_id() == real
    monkeypatch.setattr(own, "_kernel_override", "another-machine")
    assert own.kernel_id() == "another-machine"
