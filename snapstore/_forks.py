"""A Store's structures in a process forked from the one that opened it (no ``exec``).

A child gets a copy of every lock, condition and count of a Store in use as they were at the fork,
without the threads that held them: a lock a parent thread held stays held forever, a call or save
in flight never finishes. One hook, registered here once, gives each tracked structure its child
state (fresh locks, nothing in flight, no threads of its own); the Store's copy is then inert — its
calls refused, its close() releasing only the child's descriptors (docs/api.md, "Threads and
processes"). Process-wide locks (module level, shared by every Store) are :class:`ProcessLock`:
a child that opens a Store of its own must not wait for a parent thread's hold either.

Native handles are the other half. SQLite keeps process-wide mutexes (its allocator's, its unix
VFS's); a parent thread inside SQLite at the fork leaves them locked in the child for good, and
freeing or closing an inherited connection there enters them. CPython frees the other threads'
thread-locals inside ``os.fork()`` itself, before any hook runs, so a connection held only by a
parent thread's local was closed right there and the fork never returned (issue 23 item 5,
docs/reliability.md §11). A child therefore never releases an inherited connection through SQLite:
:func:`abandon` keeps the object for the life of the process, and :func:`release_inherited`
points the child's copies of its descriptors at ``/dev/null`` instead (only this process's copies:
the parent's descriptors, locks and files are untouched).
"""

from __future__ import annotations

import ctypes  # already loaded by numpy; Py_IncRef is the one way to keep an object past interpreter exit
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Protocol

__all__ = ["ForkAware", "ProcessLock", "abandon", "release_inherited", "track"]


class ForkAware(Protocol):
    """A structure that resets itself in a forked child."""

    def _after_fork_in_child(self) -> None:
        """Called once in the child, on the forking thread, before anything else runs there."""


_tracked: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def track(obj: ForkAware) -> None:
    """Reset ``obj`` in every process forked from this one while ``obj`` lives (held weakly)."""
    _tracked.add(obj)


class ProcessLock:
    """A module-level lock that a forked child gets fresh (a parent thread may have held it at the fork)."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        track(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def abandon(obj: object) -> None:
    """Never free ``obj`` in this process, not even at interpreter exit: its finalizer (an apsw
    connection's closes it through SQLite, whose process-wide locks a parent thread may have held
    at the fork) never runs. For a forked child's copy of a native handle; it costs the memory."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def release_inherited(paths: Iterable[str]) -> int:
    """In a forked child (from an after-fork hook: every descriptor is then inherited): point each
    descriptor open on one of ``paths`` at ``/dev/null``, without the library that opened it. The
    child's copy of the file goes (the parent's descriptors, locks and the file stay); the number
    stays taken, so whatever still names it can never reach another file. How many it released."""
    keys = set()
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        keys.add((st.st_dev, st.st_ino))
    fds: list[int] = []
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            fds = [int(n) for n in os.listdir(listing)]
            break
        except (OSError, ValueError):
            continue
    null = -1
    released = 0
    try:
        for fd in fds:
            try:
                st = os.fstat(fd)
            except OSError:
                continue  # the listing's own descriptor, closed since
            if (st.st_dev, st.st_ino) not in keys:
                continue
            if null < 0:
                null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            os.dup2(null, fd, inheritable=False)
            released += 1
    finally:
        if null >= 0:
            os.close(null)
    return released


def _in_child() -> None:
    for obj in list(_tracked):
        obj._after_fork_in_child()


os.register_at_fork(after_in_child=_in_child)
