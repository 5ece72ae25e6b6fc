"""Owners of pending captures, and the one rule that says when an owner is provably gone.

An open :class:`snapstore.Store` is an *owner*: a random 128-bit id (32 hex digits), a lock file
``owners/<id>.lock`` it holds ``flock``'d while it lives, and a row in ``owners`` carrying a lease it
renews. The kernel drops an flock when its holder dies, however it dies, and every PID namespace
(container) on one kernel sees the same lock, so on the owner's kernel the lock alone decides:
held → alive, free or gone → dead at once. An owner on another kernel (another host sharing the
directory; flock over NFS is not reliable) cannot be probed: it is alive until its lease expires.
Pids and hostnames are never used to decide anything (they lie across namespaces and pod restarts).

Every sweep of dead pending captures (open-time housekeeping, gc, verify's listing, close) goes
through :class:`Liveness` (and :func:`snapstore._lifecycle.drop_dead_pending`); nothing else judges
an owner.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterable

from ._catalog import OwnerRow, SnapRow
from ._catalog import Txn as Conn
from ._db import Database
from ._errors import SnapstoreError
from ._publish import ensure_dir, io_error

__all__ = ["OWNERS_DIR", "OWNER_PREFIX", "Liveness", "Owner", "kernel_id", "owner_id", "reap_lock_files"]

OWNERS_DIR = "owners"
# The token stored in snapshots.owner. Shaped like the previous "<host>:<pid>:<start>:<nonce>" form
# with a host that is never a real hostname ('@' is not allowed in one), so a reader of the old
# format (an engine not yet upgraded in a rolling deploy) presumes the capture alive and keeps it.
OWNER_PREFIX = "@lease:0:-:"
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LOCK_SUFFIX = ".lock"
_NEW_SUFFIX = ".new"
_KERNEL_FILE = "/proc/sys/kernel/random/boot_id"
_NEW_STALE_S = 60.0  # a .new name lives for microseconds (create, lock, write, rename); older: a crashed open

_live_here: set[str] = set()  # owner ids this process holds: never probed (POSIX-lock emulations are per process)
_live_lock = threading.Lock()


def kernel_id() -> str:
    """What one kernel is: its boot id (shared by every PID/UTS namespace on it), else the hostname.

    ``SNAPSTORE_TEST_KERNEL_ID`` (a test knob) stands in for another machine's boot id.
    """
    fake = os.environ.get("SNAPSTORE_TEST_KERNEL_ID")
    if fake:
        return fake
    try:
        with open(_KERNEL_FILE, encoding="ascii") as f:
            boot = f.read().strip()
        if boot:
            return boot
    except (OSError, ValueError):
        pass
    return "host:" + socket.gethostname()


def owner_id(token: str | None) -> str | None:
    """The owner id of a token of the current form, or None (no token, old form, garbage)."""
    if token is None or not token.startswith(OWNER_PREFIX):
        return None
    oid = token[len(OWNER_PREFIX):]
    return oid if _HEX32.fullmatch(oid) else None


def _lock_path(owners_dir: str, oid: str, suffix: str = _LOCK_SUFFIX) -> str:
    if not _HEX32.fullmatch(oid):  # paths are built only from validated hex
        raise ValueError(f"malformed owner id {oid!r}")
    return os.path.join(owners_dir, oid + suffix)


# -- the old token form ("<host>:<pid>:<start>:<nonce>", schema v1) ---------------------------------
def _proc_start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data.rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return "?"


def _legacy_proven_alive(token: str) -> bool | None:
    """For an old-form token: True when its process is provably running (same hostname, the pid
    exists here with the recorded start time), False when not provable, None when not old-form."""
    try:
        host, pid_s, start, nonce = token.rsplit(":", 3)
        pid = int(pid_s)
    except ValueError:
        return None
    if not nonce or pid <= 0:
        return None
    if host != socket.gethostname() or start == "?":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except OSError:
        return False
    return _proc_start(pid) == start


# -- the one liveness rule ----------------------------------------------------------------------------
_HELD, _FREE, _UNKNOWN = "held", "free", "unknown"


def _read_kernel(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""


def _try_lock(fd: int) -> bool | None:
    """True: we took the lock (nobody holds it); False: someone holds it; None: cannot tell."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        return False if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) else None


class Liveness:
    """Decides, for one sweep, which pending captures' owners are provably gone.

    Built inside the sweep's transaction (the ``owners`` rows it reads belong to that snapshot).
    ``lease`` is the reader's pending lease, applied only to old-form owners (which carry none).
    """

    def __init__(self, root: str, c: Conn, lease: float, now: float | None = None):
        self._dir = os.path.join(root, OWNERS_DIR)
        self._owners: dict[str, OwnerRow] = c.owners()
        self._lease = lease
        self._now = time.time() if now is None else now
        self._kernel = kernel_id()
        self._verdict: dict[str, bool] = {}

    def alive(self, token: str | None, since: float) -> bool:
        """Whether the owner named by ``token`` may still be alive (never False for a live one).

        ``since`` is when the capture was made: an old-form owner that cannot be proven running
        holds one lease from then.
        """
        if not token:
            return False  # a pending row without an owner: nothing can ever commit it
        oid = owner_id(token)
        if oid is None:
            proven = _legacy_proven_alive(token)
            if proven is None:
                return False  # not a token of any form snapstore writes
            return proven or since + self._lease > self._now
        if oid not in self._verdict:
            self._verdict[oid] = self._judge(oid)
        return self._verdict[oid]

    def _judge(self, oid: str) -> bool:
        with _live_lock:
            if oid in _live_here:
                return True
        row = self._owners.get(oid)
        probe = self._probe(oid, row)
        if probe == _HELD:
            return True
        if probe == _FREE or row is None:
            return False  # lock free on its own kernel, or no lease was ever registered
        return row.renewed + row.lease > self._now

    def _probe(self, oid: str, row: OwnerRow | None) -> str:
        """The owner's lock as seen from here; _UNKNOWN unless the owner runs on this kernel."""
        if row is not None and row.kernel != self._kernel:
            return _UNKNOWN
        try:
            fd = os.open(_lock_path(self._dir, oid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            # a live owner's file exists from before its row until after it is gone
            return _FREE if row is not None else _UNKNOWN
        except OSError:
            return _UNKNOWN
        try:
            if row is None and _read_kernel(fd) != self._kernel:
                return _UNKNOWN
            took = _try_lock(fd)
            return _UNKNOWN if took is None else (_FREE if took else _HELD)
        finally:
            os.close(fd)  # releases the lock if we took it

    def dead_pending(self, c: Conn) -> list[SnapRow]:
        """Pending captures whose owner is provably gone or whose lease expired."""
        return [s for s in c.pending() if not self.alive(s.owner, s.created)]

    def dead_owners(self) -> list[str]:
        """Registered owners that are provably gone or whose lease expired."""
        return [oid for oid in self._owners if not self.alive(OWNER_PREFIX + oid, self._now)]


def reap_lock_files(root: str, ids: Iterable[str] | None = None, registered: Iterable[str] = ()) -> int:
    """Unlink lock files of owners that are gone: ``ids``, or with None every file in owners/ whose
    id is not in ``registered``. A ``.lock`` file is removed only by a process on the owner's kernel
    that took its lock (flock is trusted only there); a ``.new`` file (an open that crashed before
    its rename) once it is a minute old. Returns how many went."""
    d = os.path.join(root, OWNERS_DIR)
    if ids is None:
        keep = set(registered)
        try:
            names = os.listdir(d)
        except OSError:
            return 0
        todo: list[tuple[str, str]] = []
        for name in names:
            for suffix in (_LOCK_SUFFIX, _NEW_SUFFIX):
                oid = name[:-len(suffix)]
                if name.endswith(suffix) and _HEX32.fullmatch(oid) and oid not in keep:
                    todo.append((oid, suffix))
    else:
        todo = [(oid, _LOCK_SUFFIX) for oid in ids if _HEX32.fullmatch(oid)]
    kernel = kernel_id()
    n = 0
    now = time.time()
    for oid, suffix in todo:
        with _live_lock:
            if oid in _live_here:
                continue
        path = _lock_path(d, oid, suffix)
        if suffix == _NEW_SUFFIX:
            try:
                if now - os.stat(path, follow_symlinks=False).st_mtime >= _NEW_STALE_S:
                    os.unlink(path)
                    n += 1
            except OSError:
                pass
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _read_kernel(fd) == kernel and _try_lock(fd):
                os.unlink(path)  # while holding the lock: the owner is gone and its id never returns
                n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


# -- this process's owner -----------------------------------------------------------------------------
class Owner:
    """The owner of one open Store: its lock (held until :meth:`release`) and its renewed lease."""

    def __init__(self, db: Database, root: str, lease: float):
        self.id = secrets.token_hex(16)
        self.token = OWNER_PREFIX + self.id
        self.lease = lease
        self.kernel = kernel_id()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._db = db
        owners = os.path.join(root, OWNERS_DIR)
        ensure_dir(owners)
        self._path = _lock_path(owners, self.id)
        # locked under a temporary name, then renamed: no prober ever sees the final name unlocked
        tmp = _lock_path(owners, self.id, _NEW_SUFFIX)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise io_error(f"cannot create the owner lock {tmp}", e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, (self.kernel + "\n").encode("ascii", "replace"))
            os.rename(tmp, self._path)
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise io_error(f"cannot take the owner lock {self._path}", e) from None
        self._fd: int | None = fd
        with _live_lock:
            _live_here.add(self.id)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            # registered before any capture names it; not fsynced: every transaction that inserts one
            # of its captures (durable) registers it again, so a power cut cannot orphan a capture
            db.write(self.renew, durable=False)
        except BaseException:
            self.release()
            raise
        self._thread = threading.Thread(target=self._run, name="snapstore-lease", daemon=True)
        self._thread.start()

    @property
    def interval(self) -> float:
        """Seconds between renewals: a quarter of the lease (at most a minute)."""
        return min(self.lease / 4.0, 60.0)

    def renew(self, c: Conn) -> None:
        """Register or renew this owner's lease inside the caller's write transaction."""
        c.renew_owner(self.id, self.kernel, self.host, self.pid, self.lease, time.time())

    def _run(self) -> None:
        # its own thread and connection: an engine busy in save/restore never starves its lease
        while not self._stop.wait(self.interval):
            try:
                self._db.write(self.renew, durable=False)  # a renewal lost to a power cut is harmless
            except SnapstoreError:
                continue  # locked for long, disk full, store closing: retry at the next tick

    def stop(self) -> None:
        """Stop renewing (before the owner's row is deleted, so no renewal re-creates it)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def retire(self, c: Conn) -> None:
        """Remove this owner's row (in the transaction that drops its remaining captures)."""
        c.delete_owner(self.id)

    def release(self) -> None:
        """Stop renewing, unlink the lock file while still holding it, then let the lock go."""
        self.stop()
        with _live_lock:
            _live_here.discard(self.id)
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self._path)
        except OSError:
            pass  # a leftover file with a free lock reads as a dead owner; gc removes it
        os.close(fd)
