"""Owners of pending captures: this process's owner (lock file, lease, fork rules) and the
lock-file primitives :mod:`snapstore.lifecycle.liveness` judges other owners by.

An open :class:`snapstore.Store` is an *owner*: a random 128-bit id (32 hex digits), a lock file
``owners/<id>.lock`` it holds ``flock``'d while it lives, and a row in ``owners`` carrying a lease it
renews. The kernel drops an flock when its holder dies, however it dies, and every PID namespace
(container) on one kernel sees the same lock, so on the owner's kernel the lock alone decides:
held → alive, free or gone → dead at once. An owner on another kernel (another host sharing the
directory; flock over NFS is not reliable) cannot be probed: it is alive until its lease expires.
Pids and hostnames are never used to decide anything (they lie across namespaces and pod restarts).

Every sweep of dead pending captures goes through :class:`snapstore.lifecycle.liveness.Liveness`; nothing
else judges an owner.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import socket
import stat
import threading
import time
import weakref

from snapstore._errors import SnapstoreError, StateError
from snapstore.catalog.db import Database
from snapstore.catalog.queries import Txn as Conn
from snapstore.chunks.publish import ensure_dir, io_error
from snapstore.chunks.tree import remove_in

__all__ = ["OWNERS_DIR", "OWNER_PREFIX", "Owner", "kernel_id", "owner_id"]

OWNERS_DIR = "owners"
# The token stored in snapshots.owner. Shaped like the previous "<host>:<pid>:<start>:<nonce>" form
# with a host that is never a real hostname ('@' is not allowed in one), so a reader of the old
# format (an engine not yet upgraded in a rolling deploy) presumes the capture alive and keeps it.
OWNER_PREFIX = "@lease:0:-:"
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LOCK_SUFFIX = ".lock"
_NEW_SUFFIX = ".new"
_KERNEL_FILE = "/proc/sys/kernel/random/boot_id"
# A .new name lives for microseconds (create, lock, write, rename): older means an open that crashed.
# A lock file of another kernel this young may belong to an owner between its rename and its row.
_STALE_S = 60.0

# Test hook, never set in production: a test sets it in a child process to make that process look
# like one on another machine (its lock then cannot be probed, only its lease speaks for it).
_kernel_override: str | None = None
_boot_id: str | None = None  # this kernel's id, read once: it cannot change while the process lives


class _LockFile:
    """The flock'd lock file of one owner in this process: what a fork or a finalizer releases."""

    __slots__ = ("fd", "id", "inherited")

    def __init__(self, fd: int, oid: str):
        self.fd: int | None = fd
        self.id = oid
        self.inherited = False  # set in a forked child: the lock and the row are the parent's


# The owners this process holds, by id: never probed (POSIX-lock emulations are per process).
# Re-entrant: a finalizer releasing an unclosed Store's lock may run inside any code that holds it.
_held: dict[str, _LockFile] = {}
_live_lock = threading.RLock()


def _before_fork() -> None:
    _live_lock.acquire()  # no fork while a lock file is being created or swapped: the child sees every fd


def _after_fork_in_parent() -> None:
    _live_lock.release()


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's owners: close their inherited lock fds (else a
    killed parent's captures stay pinned while the child lives) and make them inert."""
    global _live_lock
    files = list(_held.values())
    _held.clear()
    _live_lock = threading.RLock()  # the parent's may be held by a thread that does not exist here
    for f in files:
        f.inherited = True
        fd, f.fd = f.fd, None
        if fd is not None:
            try:
                os.close(fd)  # the parent's descriptor keeps the flock; only the child's copy goes
            except OSError:
                pass


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _is_held_here(oid: str) -> bool:
    with _live_lock:
        return oid in _held


def kernel_id() -> str:
    """What one kernel is: its boot id (shared by every PID/UTS namespace on it), else the hostname."""
    global _boot_id
    if _kernel_override:
        return _kernel_override
    if _boot_id is None:
        boot = ""
        try:
            with open(_KERNEL_FILE, encoding="ascii") as f:
                boot = f.read().strip()
        except (OSError, ValueError):
            pass
        _boot_id = boot or "host:" + socket.gethostname()
    return _boot_id


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


# -- lock-file primitives (the judging is snapstore.lifecycle.liveness's) --------------------------------
def _read_kernel(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""


def _open_lock(path: str, dir_fd: int | None = None) -> int | None:
    """A read-only fd on the lock file at ``path`` (relative to ``dir_fd`` if given), or None when
    something else sits there (a FIFO would block an open without O_NONBLOCK forever). Raises
    OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _create_lock(owners: str, oid: str, kernel: str) -> int:
    """A new lock file for ``oid``: created, locked and written under ``<id>.new``, then renamed to
    ``<id>.lock`` (so no prober ever sees the final name unlocked). Returns its fd, flock held."""
    tmp, path = _lock_path(owners, oid, _NEW_SUFFIX), _lock_path(owners, oid)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise io_error(f"cannot create the owner lock {tmp}", e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, (kernel + "\n").encode("ascii", "replace"))
        os.rename(tmp, path)
    except OSError as e:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise io_error(f"cannot take the owner lock {path}", e) from None
    return fd


def _try_lock(fd: int) -> bool | None:
    """True: we took the lock (nobody holds it); False: someone holds it; None: cannot tell."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        return False if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) else None


# -- this process's owner -----------------------------------------------------------------------------
def _renew_loop(ref: weakref.ref[Owner], stop: threading.Event, interval: float) -> None:
    """The lease thread: holds only a weak reference, so a Store dropped unclosed takes its owner along."""
    while not stop.wait(interval):
        owner = ref()
        if owner is None:
            return
        try:
            owner._db.write(owner.renew, durable=False)  # a renewal lost to a power cut is harmless
        except SnapstoreError:
            pass  # locked for long, disk full, store closing: retry at the next tick
        del owner


def _abandon(lock: _LockFile, stop: threading.Event) -> None:
    """Finalizer of an Owner dropped without release(): stop its thread and let its lock go.

    The file stays (its row does too): a free lock reads as a dead owner, and gc removes both.
    """
    if not lock.inherited:  # in a forked child the event is the parent's thread's (its lock may be held)
        stop.set()
    with _live_lock:
        if _held.get(lock.id) is lock:
            del _held[lock.id]
        fd, lock.fd = lock.fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class Owner:
    """The owner of one open Store: its lock (held until :meth:`release`) and its renewed lease.

    Inert in a process forked from its own (:attr:`inherited`): the lock, the row and the captures
    stay the parent's. Dropped without release(), a finalizer stops its thread and frees its lock.
    """

    def __init__(self, db: Database, root: str, lease: float):
        self.id = secrets.token_hex(16)
        self.token = OWNER_PREFIX + self.id
        self.lease = lease
        self.kernel = kernel_id()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._db = db
        self._root = root
        self._dir = os.path.join(root, OWNERS_DIR)
        ensure_dir(self._dir)
        self._path = _lock_path(self._dir, self.id)
        with _live_lock:  # the fd is recorded before any fork can copy it
            self._lock = _LockFile(_create_lock(self._dir, self.id, self.kernel), self.id)
            _held[self.id] = self._lock
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(self, _abandon, self._lock, self._stop)
        self._thread: threading.Thread | None = None
        try:
            # registered before any capture names it; not fsynced: every transaction that inserts one
            # of its captures (durable) registers it again, so a power cut cannot orphan a capture
            db.write(self.renew, durable=False)
        except BaseException:
            self.release()
            raise
        # its own thread and connection: an engine busy in save/restore never starves its lease
        self._thread = threading.Thread(target=_renew_loop, args=(weakref.ref(self), self._stop, self.interval),
                                        name="snapstore-lease", daemon=True)
        self._thread.start()

    @property
    def interval(self) -> float:
        """Seconds between renewals: a quarter of the lease (at most a minute)."""
        return min(self.lease / 4.0, 60.0)

    @property
    def inherited(self) -> bool:
        """Whether this process only inherited the owner through fork() (it is the parent's)."""
        return self._lock.inherited or os.getpid() != self.pid

    def _refuse_inherited(self) -> None:
        if self.inherited:
            raise StateError(f"this Store was opened by process {self.pid} before a fork(); a forked "
                             "process cannot make or drop captures for it: open its own Store "
                             "in the child (Store.open)")

    def renew(self, c: Conn) -> None:
        """Register or renew this owner's lease inside the caller's write transaction."""
        self._refuse_inherited()
        self._keep_file()
        c.renew_owner(self.id, self.kernel, self.host, self.pid, self.lease, time.time())

    def _keep_file(self) -> None:
        """Make the lock file again if it is no longer the one we hold (an operator removed it or
        owners/): without it the lock cannot speak for this owner, only its lease."""
        with _live_lock:
            fd = self._lock.fd
            if fd is None:
                return  # released
            try:
                held = os.fstat(fd)
                cur = os.stat(self._path, follow_symlinks=False)
                if held.st_nlink and (cur.st_dev, cur.st_ino) == (held.st_dev, held.st_ino):
                    return
            except FileNotFoundError:
                pass
            except OSError:
                return  # cannot tell: keep the lock we hold
            try:
                ensure_dir(self._dir)
                remove_in(self._root, (OWNERS_DIR,), self.id + _NEW_SUFFIX)  # ours alone: a crashed remake
                self._lock.fd = _create_lock(self._dir, self.id, self.kernel)
            except (SnapstoreError, OSError):
                return  # retried at the next renewal; meanwhile the lease speaks for this owner
            os.close(fd)  # the new lock is in place before the old one goes

    def stop(self) -> None:
        """Stop renewing (before the owner's row is deleted, so no renewal re-creates it). In a
        forked child there is nothing to stop: the thread (and the event's lock) are the parent's."""
        if self.inherited:
            return
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def retire(self, c: Conn) -> None:
        """Remove this owner's row (in the transaction that drops its remaining captures)."""
        self._refuse_inherited()
        c.delete_owner(self.id)

    def _row_gone(self) -> bool:
        try:
            return self.id not in self._db.read(lambda c: c.owners())
        except SnapstoreError:
            return False

    def release(self) -> None:
        """Stop renewing, unlink the lock file (once the row is gone) while still holding it, then
        let the lock go. In a forked child: only its inherited copy of the fd goes."""
        self.stop()
        self._finalizer.detach()
        with _live_lock:
            if _held.get(self.id) is self._lock:
                del _held[self.id]
            fd, self._lock.fd = self._lock.fd, None
        if fd is None:
            return
        try:
            # with the row still there (a failed close), the file stays: a free lock reads as a
            # dead owner at once, where an absent file leaves the judgement to the lease
            if not self.inherited and self._row_gone():
                remove_in(self._root, (OWNERS_DIR,), os.path.basename(self._path))  # never through a link
        except OSError:
            pass  # a leftover file with a free lock reads as a dead owner; gc removes it
        finally:
            os.close(fd)
