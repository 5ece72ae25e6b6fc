"""Forks wait for threads inside SQLite: the fence every catalog call passes (issue 23 item 5).

SQLite keeps process-wide mutexes (its allocator's, its unix VFS's). A thread inside SQLite at a
``fork()`` can leave one locked in the child for good, and the child's own first SQLite call then
waits forever: a child that opens a Store of its own after forking from a process whose threads
were saving or matching hung in about 1 fork in 25 (docs/reliability.md §11). Python cannot reset
those mutexes, so the fork waits instead: every catalog call runs :func:`inside` the fence, and an
at-fork hook closes the fence (new calls wait) and waits until no other thread is inside, for at
most ``SNAPSTORE_FORK_WAIT_MS`` (default 2000 ms; a statement that runs longer is let be, logged,
and the fork goes ahead as it would without the fence; 0 turns the wait off). A thread that forks
from inside a catalog call does not wait for itself.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from snapstore._config import env_int

__all__ = ["fenced", "inside", "wait_ms"]

log = logging.getLogger("snapstore")
P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_WAIT_MS = 2000


class _Fence:
    """Which threads are inside SQLite (with their depth), and whether a fork is holding new ones back."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.inside: dict[int, int] = {}
        self.forking = False

    def enter(self) -> None:
        me = threading.get_ident()
        with self.cv:
            while self.forking and me not in self.inside:
                self.cv.wait()
            self.inside[me] = self.inside.get(me, 0) + 1

    def leave(self) -> None:
        me = threading.get_ident()
        with self.cv:
            depth = self.inside.get(me, 0) - 1
            if depth > 0:
                self.inside[me] = depth
            else:
                self.inside.pop(me, None)
                self.cv.notify_all()

    def before_fork(self) -> None:
        """Close the fence and wait (bounded) for the other threads to leave SQLite; the lock stays
        held across the fork, so no thread enters or leaves while the process is copied."""
        me = threading.get_ident()
        self.cv.acquire()
        self.forking = True
        bound = wait_ms()
        deadline = time.monotonic() + bound / 1000
        while bound and any(t != me for t in self.inside):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("fork: %d thread(s) still inside SQLite after %d ms; forking anyway (a child that "
                            "opens a store may hang: start children with spawn or forkserver)",
                            sum(1 for t in self.inside if t != me), bound)
                break
            self.cv.wait(left)

    def after_in_parent(self) -> None:
        self.forking = False
        self.cv.notify_all()
        self.cv.release()

    def after_in_child(self) -> None:
        """The child: a fresh fence with nobody inside (the parent's threads are not here; the
        forking thread's calls are the parent's copy, never entered again)."""
        self.cv = threading.Condition()
        self.inside = {}
        self.forking = False


_FENCE = _Fence()
os.register_at_fork(before=_FENCE.before_fork, after_in_parent=_FENCE.after_in_parent,
                    after_in_child=_FENCE.after_in_child)


def wait_ms() -> int:
    """How long a fork waits for threads inside SQLite (``SNAPSTORE_FORK_WAIT_MS``)."""
    v = env_int("SNAPSTORE_FORK_WAIT_MS")
    return DEFAULT_WAIT_MS if v is None else max(0, v)


@contextmanager
def inside() -> Iterator[None]:
    """Run the block inside the fence: a fork waits until it is done (bounded)."""
    _FENCE.enter()
    try:
        yield
    finally:
        _FENCE.leave()


def fenced(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs :func:`inside` the fence (the decorator of every catalog entry point)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        _FENCE.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _FENCE.leave()

    return run
