"""A Store's structures in a process forked from the one that opened it (no ``exec``).

A child gets a copy of every lock, condition and count of a Store in use as they were at the fork,
without the threads that held them: a lock a parent thread held stays held forever, a call or save
in flight never finishes. One hook, registered here once, gives each tracked structure its child
state (fresh locks, nothing in flight, no threads of its own); the Store's copy is then inert — its
calls refused, its close() releasing only the child's descriptors (docs/api.md, "Threads and
processes"). Process-wide locks (module level, shared by every Store) are :class:`ProcessLock`:
a child that opens a Store of its own must not wait for a parent thread's hold either.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

__all__ = ["ForkAware", "ProcessLock", "track"]


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


def _in_child() -> None:
    for obj in list(_tracked):
        obj._after_fork_in_child()


os.register_at_fork(after_in_child=_in_child)
