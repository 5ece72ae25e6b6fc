"""Public calls in flight versus close(): calls that start after close() began are refused, close()
waits for the ones already running, and a second close() returns once the first has finished.

Calls nest on one thread (a public call made inside another, e.g. restore() planning through
describe()): only the outermost counts, so a call never waits for itself.

In a process forked from the opener's, the gate is the child's copy (:mod:`._forks`): it refuses
every call (the threads, locks and SQLite connections behind them are the parent's) and counts
none of the parent's calls in flight, so the child's close() returns at once.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from snapstore._errors import StateError
from snapstore._forks import track

__all__ = ["CallGate", "Gated", "operation"]

T = TypeVar("T")
P = ParamSpec("P")


class CallGate:
    """Counts one store's public calls in flight and orders them against its close()."""

    def __init__(self) -> None:
        self.closed = False  # close() has begun: every new call raises StateError
        # guards closed, _active and _shut; re-entrant: a signal handler on this thread may call close()
        # while a call is counting itself in
        self._cond = threading.Condition()
        self._active = 0
        self._shut = False  # close() has finished
        self._inside = threading.local()  # depth of public calls on this thread (nested calls pass)
        self._opener = os.getpid()
        self.forked = False  # the copy a forked child inherited: every call refused, close() releases it
        track(self)

    def _after_fork_in_child(self) -> None:
        """Only the forking thread came along: its own call, if it was inside one, is the one in
        flight; a close() a parent thread had begun is the parent's (the child's close() runs anew)."""
        self._cond = threading.Condition()  # a parent thread may have held the old one
        self._active = 1 if self.depth else 0
        self.closed = self._shut
        self.forked = True

    @property
    def depth(self) -> int:
        """How many public calls of this store the current thread is inside."""
        return int(getattr(self._inside, "depth", 0))

    def _refuse_forked(self) -> None:
        if self.forked:
            raise StateError(f"this Store was opened by process {self._opener} before a fork(); a forked "
                             "process cannot use it (its threads, locks and SQLite connections are the "
                             "parent's): open a Store in this process with Store.open(), and close() this copy")

    def check(self) -> None:
        """StateError once close() has begun, or in a forked child (for calls close() need not wait for)."""
        self._refuse_forked()
        if self.closed:
            raise StateError("the store is closed; open it again with Store.open()")

    @contextmanager
    def call(self) -> Iterator[None]:
        """Count a public call in flight; StateError once close() has begun, or in a forked child."""
        depth = self.enter()
        try:
            yield
        finally:
            self.leave(depth)

    def enter(self) -> int:
        """:meth:`call`'s first half (what :func:`operation` runs on every call, without a generator):
        the depth to hand to :meth:`leave`."""
        depth: int = getattr(self._inside, "depth", 0)
        if depth == 0:
            self._refuse_forked()
            with self._cond:
                if self.closed:
                    raise StateError("the store is closed (or closing); open it again with Store.open()")
                self._active += 1
        self._inside.depth = depth + 1
        return depth

    def leave(self, depth: int) -> None:
        """:meth:`call`'s second half."""
        self._inside.depth = depth
        if depth == 0:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def begin_close(self) -> bool:
        """Refuse new calls and wait for those in flight. False: another close() got here first
        (returned once it has finished: the caller has nothing left to do)."""
        with self._cond:
            if self.closed:
                while not self._shut:
                    self._cond.wait()
                return False
            self.closed = True
            while self._active:
                self._cond.wait()
        return True

    def finish_close(self) -> None:
        """close() has released everything: wake any second close() waiting for it."""
        with self._cond:
            self._shut = True
            self._cond.notify_all()


class Gated(Protocol):
    """An object whose public calls pass a :class:`CallGate` (the Store)."""

    _gate: CallGate


G = TypeVar("G", bound=Gated)


def operation(fn: Callable[Concatenate[G, P], T]) -> Callable[Concatenate[G, P], T]:
    """A public call: refused with StateError once close() began; close() waits for it."""

    def call(self: G, /, *args: P.args, **kwargs: P.kwargs) -> T:
        gate = self._gate
        depth = gate.enter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            gate.leave(depth)

    functools.update_wrapper(call, fn)  # name, docstring and signature for help() and the docs
    return call
