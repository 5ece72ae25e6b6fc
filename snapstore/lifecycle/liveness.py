"""The one rule that says when an owner of pending captures is provably gone, and the reaping of
lock files of owners that are.

On the owner's kernel its flock'd lock file alone decides: held → alive, free or gone → dead at
once. An owner on another kernel (another host sharing the directory) cannot be probed: it is
alive until its lease expires. Old-form tokens (schema v1, ``<host>:<pid>:<start>:<nonce>``) are
alive while their process provably runs, else for one lease from their capture.

Every sweep of dead pending captures (open-time housekeeping, gc, verify's listing, close) goes
through :class:`Liveness` (and :func:`snapstore.lifecycle.rules.drop_dead_pending`); nothing else judges
an owner. Lock files are made and held by :mod:`snapstore.lifecycle.owner`.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterable

from snapstore.catalog.queries import OwnerRow, SnapRow
from snapstore.catalog.queries import Txn as Conn
from snapstore.chunks.tree import list_dir, open_dir
from snapstore.lifecycle.owner import (
    _HEX32,
    _LOCK_SUFFIX,
    _NEW_SUFFIX,
    _STALE_S,
    OWNER_PREFIX,
    OWNERS_DIR,
    _is_held_here,
    _lock_path,
    _open_lock,
    _read_kernel,
    _try_lock,
    kernel_id,
    owner_id,
)

__all__ = ["Liveness", "reap_lock_files"]

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
        if _is_held_here(oid):
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
            fd = _open_lock(_lock_path(self._dir, oid))
        except OSError:
            # Absent: the owner is gone, or an operator removed owners/ under a live one (it makes
            # its file again at its next renewal); unreadable: cannot tell. The lease decides.
            return _UNKNOWN
        if fd is None:
            return _UNKNOWN  # not a lock file (a FIFO, a device): proves nothing
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
    """Unlink lock files of owners that are gone: ``ids`` (rows just deleted as dead), or with None
    every file in owners/ whose id is not in ``registered``. A ``.lock`` file goes only while this
    process holds its lock (nothing else does): on its own kernel at once; one of another kernel
    (another host, or this host before a reboot) once it is a minute old, since its owner may be
    between its rename and its row. A ``.new`` file (an open that crashed before its rename) goes
    once it is a minute old. Anything that is not a regular file is left alone. Returns how many went."""
    if ids is None:
        keep = set(registered)
        todo: list[tuple[str, str]] = []
        for name in list_dir(root, OWNERS_DIR):  # a link in place of owners/ lists nothing
            for suffix in (_LOCK_SUFFIX, _NEW_SUFFIX):
                oid = name[:-len(suffix)]
                if name.endswith(suffix) and _HEX32.fullmatch(oid) and oid not in keep:
                    todo.append((oid, suffix))
    else:
        todo = [(oid, _LOCK_SUFFIX) for oid in ids if _HEX32.fullmatch(oid)]
    todo = [(oid, suffix) for oid, suffix in todo if not _is_held_here(oid)]
    if not todo:
        return 0
    try:
        d = open_dir(root, OWNERS_DIR)  # every name below is opened and removed relative to it
    except OSError:
        return 0  # absent, or not a real directory: nothing in it is the store's to remove
    try:
        return _reap(d, todo, ids is None)
    finally:
        os.close(d)


def _reap(d: int, todo: list[tuple[str, str]], listed: bool) -> int:
    """:func:`reap_lock_files` over the owners/ directory open as ``d``."""
    kernel = kernel_id()
    n = 0
    now = time.time()
    for oid, suffix in todo:
        name = oid + suffix
        if suffix == _NEW_SUFFIX:
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime >= _STALE_S:
                    os.unlink(name, dir_fd=d)
                    n += 1
            except OSError:
                pass
            continue
        try:
            fd = _open_lock(name, dir_fd=d)
        except OSError:
            continue
        if fd is None:
            continue
        try:
            st = os.fstat(fd)
            if _read_kernel(fd) != kernel and (listed and now - st.st_mtime < _STALE_S):
                continue
            if _try_lock(fd):
                cur = os.stat(name, dir_fd=d, follow_symlinks=False)
                if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(name, dir_fd=d)  # while holding the lock: the owner is gone and its id never returns
                    n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n
