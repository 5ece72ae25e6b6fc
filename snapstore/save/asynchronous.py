"""Saves off the engine's path: ``Store.save(..., wait=False)`` returns a :class:`SaveHandle` at once.

An engine saves after the answer is out; it must not wait for the disk. The call checks its
arguments, takes what may change under it, and queues the save for one writer thread per store
(FIFO, so a session's saves land in order and ``parent="auto"`` finds the previous one):

- row streams in a host buffer are read in place later: rows below a boundary never change after
  it (invariant 2). The engine must not overwrite rows ``[0, n)`` it handed over until the handle
  is done (e.g. before reusing the slot for another sequence, call ``handle.result()``);
- fixed parts (overwritten in place by the next decode step), and of every source that is not
  a host buffer (a paged pool, a device tensor's reader, a strided array) the rows above the
  parent's (:mod:`snapstore.save.delta`), are copied before the call returns, under a bounded
  budget (``async_copy_bytes`` / ``SNAPSTORE_ASYNC_COPY_MIB``, default 1024 MiB).
  When the budget is full the call waits for earlier saves to finish rather than exceed it; a save
  whose copies alone exceed the whole budget waits for the queue to empty and runs synchronously;
- the tokens (small), the row counts and the parent's id are taken at the call: nothing else of
  the caller's is read later (an engine reuses its token array for the next request at once);
- ``parent=<SaveHandle>`` queues the save behind that one (:mod:`snapstore.save.chain`), and
  ``SaveHandle.add_done_callback`` tells the engine when a save is done, without polling.

The writer thread holds a Store only while it has a save of it to run: a Store dropped unclosed
is collected (its owner lock freed) once its queue is empty, and its writer thread then ends. A
failed save's error carries its traceback as text, a note (its frames would hold the Store).
In a forked child the parent's saves and writer thread are not there (:mod:`._forks`): the child's
copies of their handles refuse to wait.

Errors (I/O, a full disk, a lost race) surface on the handle; argument errors raise at once.
``Store.flush()`` and ``Store.close()`` wait for every queued save. A crash loses only saves whose
handle had not completed: a completed handle's snapshot is as durable as a ``wait=True`` save's.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from snapstore._config import MIB, env_int
from snapstore._errors import ConfigError, InvalidInputError, StateError
from snapstore._forks import track
from snapstore._layout import Layout
from snapstore._numbers import integer, wait_seconds
from snapstore._refs import namespace_key, session_key, snapshot_id
from snapstore._results import SaveResult
from snapstore._tokens import as_token_array
from snapstore.save.chain import parent_after
from snapstore.save.delta import copy_spans, take
from snapstore.save.stages import validate_parts
from snapstore.save.token_keys import TokenKeys

__all__ = ["AsyncSaver", "SaveHandle", "copy_budget"]

log = logging.getLogger("snapstore")

DEFAULT_ASYNC_COPY_MIB = 1024


def copy_budget(value: int | None) -> int:
    """The copy budget in bytes: the keyword, else ``$SNAPSTORE_ASYNC_COPY_MIB``, else 1024 MiB."""
    if value is None:
        env = env_int("SNAPSTORE_ASYNC_COPY_MIB")
        return (env if env is not None else DEFAULT_ASYNC_COPY_MIB) * MIB
    return integer(value, "async_copy_bytes", minimum=0, err=ConfigError)


class SaveHandle:
    """A save queued with ``wait=False``: ``result()`` waits for it and returns its SaveResult (or
    raises its error); ``done()`` says whether it finished. ``copied_bytes``: what the call copied."""

    def __init__(self, copied_bytes: int, future: Future[SaveResult] | None = None, *,
                 saver: AsyncSaver | None = None, rows: Mapping[str, int] | None = None):
        self.copied_bytes = copied_bytes
        self._future: Future[SaveResult] = future if future is not None else Future()
        self._forked = False
        # what a child queued over this handle (parent=handle) needs of it before it runs
        self._saver, self._rows = saver, dict(rows or {})
        track(self)

    def _after_fork_in_child(self) -> None:
        self._forked = True  # the save, its writer thread and its future's waiters are the parent's

    def _settled(self) -> Future[SaveResult]:
        if self._forked:
            raise StateError("this save was queued before a fork(); only the process that queued it can "
                             "wait for it (save again from a Store opened in this process)")
        return self._future

    def done(self) -> bool:
        """True once the save finished (durable and in the catalog, skipped, or failed)."""
        return self._settled().done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """The SaveResult, waiting up to ``timeout`` seconds (TimeoutError); raises the save's error."""
        return self._settled().result(_future_wait(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None when it succeeded), waiting like :meth:`result`."""
        return self._settled().exception(_future_wait(timeout))

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once, when the save completes or fails (at once, here, if it already has).

        It runs on the store's writer thread: keep it short (release the engine's blocks, wake a
        scheduler) and never wait in it for a save (``flush()``, ``close()``, a later handle's
        ``result()``). An exception from ``fn`` is logged (logger ``snapstore``), never raised into
        the writer thread, and the save's own outcome is unchanged."""
        if not callable(fn):
            raise InvalidInputError(f"add_done_callback takes a callable (called with the handle), got {fn!r:.80}")
        future = self._settled()

        def call(_: Future[SaveResult]) -> None:
            try:
                fn(self)
            except Exception:
                log.exception("a SaveHandle done-callback %r raised; the save's outcome is unchanged", fn)

        future.add_done_callback(call)

    def __repr__(self) -> str:
        state = "forked copy" if self._forked else "done" if self.done() else "in flight"
        return f"<SaveHandle {state}, {self.copied_bytes} bytes copied>"


class AsyncSaver:
    """One store's queue of saves made with ``wait=False``, its writer thread and copy budget."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0  # bytes of copies held by queued or running saves
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], SaveResult], Future[SaveResult], int]] = deque()
        self._running = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        track(self)

    def _after_fork_in_child(self) -> None:
        """The parent's queued and running saves and its writer thread are not in a forked child."""
        self._cv = threading.Condition()  # a parent thread may have held the old one
        self._queue.clear()
        self._running = self.used = 0
        self._thread = None

    # -- the calling thread ----------------------------------------------------------------------
    def submit(self, owner: object, save: Callable[..., SaveResult], layout: Layout, tokens: Any,
               parts: Mapping[str, Any], rows: Any, kwargs: dict[str, Any],
               parent_rows: Callable[[Any, TokenKeys, str | None, dict[str, int]], dict[str, int]] | None = None,
               ) -> SaveHandle:
        """Check, copy what may change, queue; returns the handle (see the module docstring).

        ``save`` runs one synchronous save of ``owner`` (the Store: ``Store._save``) on ``layout``;
        once ``owner`` is collected, the writer thread stops. ``parent_rows(parent, tokens,
        namespace, rows)``: the rows per stream the parent holds now (a catalog read), so only
        the rows above it are copied (:mod:`snapstore.save.delta`); the token keys it computes
        for that are handed to ``save`` (``hashed=``), which computes none again."""
        arr = np.array(as_token_array(tokens), dtype="<u8")  # always a copy: the writer reads it later
        namespace_key(kwargs.get("namespace"))  # refused at the call, as a waiting save refuses them
        session_key(kwargs.get("session"))
        if len(arr) == 0:
            save(arr, parts, rows, **kwargs)  # raises the same InvalidInputError a sync save does
        parent = kwargs.get("parent")
        if isinstance(parent, SaveHandle):
            if parent._saver is not self:
                raise InvalidInputError("parent=<SaveHandle> must be a handle of a save(wait=False) of this store")
            save = functools.partial(_over, save, parent)  # its outcome decides the parent (save.chain)
        elif parent is not None and not isinstance(parent, str):
            kwargs = {**kwargs, "parent": snapshot_id(parent)}  # an int, checked now
        sources, row_counts = validate_parts(layout, parts, rows, len(arr))
        floors: dict[str, int] = {}
        if any(name in row_counts and not src.zero_copy for name, src in sources.items()):
            if isinstance(parent, SaveHandle):
                floors = parent._rows
            elif parent is not None and parent_rows is not None:
                hashed = TokenKeys(arr)  # the prediction's keys: the save's own, computed once
                floors = parent_rows(kwargs["parent"], hashed, kwargs.get("namespace"), row_counts)
                kwargs = {**kwargs, "hashed": hashed}
        spans = copy_spans(layout, sources, floors)
        need = sum(end - start for start, end in spans.values())
        if need > self.budget:
            # larger than the whole budget: after the queue, on this thread (the engine waits)
            self.flush()
            done: Future[SaveResult] = Future()
            _settle(done, functools.partial(save, arr, parts, rows, **kwargs))
            return SaveHandle(0, done, saver=self, rows=row_counts)
        self._reserve(need)
        try:
            # copied now: the fixed parts, and of other sources the rows above the parent's
            # (a device tensor: its device->host copy); host row streams are read in place later
            # (invariant 2)
            private = {name: take(layout, name, src, spans[name]) if name in spans else src.mv
                       for name, src in sources.items()}
        except BaseException:
            self._release(need)
            raise
        frozen = {name: row_counts[name] for name in row_counts}
        future: Future[SaveResult] = Future()

        # not a closure: a frame keeps its function, a closure its variables, an error its frames
        run = functools.partial(save, arr, private, frozen, **kwargs)
        with self._cv:
            if self._closed:
                self.used -= need
                self._cv.notify_all()
                raise StateError("the store is closing; save with wait=True before close(), or open it again")
            self._queue.append((run, future, need))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="snapstore-save", daemon=True)
                self._thread.start()
                # the thread holds the store only through queued jobs: once it is dropped, stop the thread
                weakref.finalize(owner, self._stop).atexit = False
            self._cv.notify_all()
        return SaveHandle(need, future, saver=self, rows=frozen)

    def _reserve(self, n: int) -> None:
        with self._cv:
            while self.used + n > self.budget and not self._closed:
                self._cv.wait()
            if self._closed:
                raise StateError("the store is closing; save with wait=True before close(), or open it again")
            self.used += n

    def _release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    # -- the writer thread -----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                run, future, need = self._queue.popleft()
                self._running += 1
            try:
                if future.set_running_or_notify_cancel():
                    _settle(future, run)
            finally:
                del run, future  # the job holds the Store: nothing of it may wait here with the thread
                with self._cv:
                    self._running -= 1
                    self.used -= need
                    self._cv.notify_all()

    def _stop(self) -> None:
        """The store was dropped unclosed (its queue is empty): let the writer thread end."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def pending(self) -> int:
        """Saves queued or running."""
        with self._cv:
            return len(self._queue) + self._running

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save queued so far has finished; False on timeout."""
        limit = wait_seconds(timeout)
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._running, limit)

    def close(self) -> None:
        """Refuse new saves, finish the queued ones, stop the writer thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _over(save: Callable[..., SaveResult], handle: SaveHandle, /, *args: Any, **kwargs: Any) -> SaveResult:
    """Run ``save`` over the outcome of the save ``handle`` (done by now: it was queued first)."""
    return save(*args, **{**kwargs, "parent": parent_after(handle)})


def _settle(future: Future[SaveResult], fn: Callable[[], SaveResult]) -> None:
    """Complete ``future`` with ``fn()``'s result or error. The error keeps its traceback as text (a
    note), not as frames: their variables, functions and callers would keep the Store (or its owner
    lock) alive for as long as the caller keeps the handle."""
    outer = sys.exc_info()[1]  # an error the caller is handling: its own, left as it is
    try:
        future.set_result(fn())
    except BaseException as e:  # surfaces on the handle
        del fn
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        seen: set[int] = {id(outer)} if outer is not None else set()
        todo: list[BaseException | None] = [e]
        while todo:  # the error and the errors it was raised from or while handling
            err = todo.pop()
            if err is not None and id(err) not in seen:
                seen.add(id(err))
                err.__traceback__ = None
                todo += [err.__cause__, err.__context__]
        add_note = getattr(e, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note("where the save failed (" + threading.current_thread().name + "):\n" + text.rstrip())
        future.set_exception(e)


def _future_wait(timeout: object) -> float | None:
    """A SaveHandle wait's timeout (:func:`wait_seconds`); a negative one does not wait, as a Future's."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout < 0:
        return 0.0
    return wait_seconds(timeout)
