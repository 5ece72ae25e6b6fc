"""Capture chains: one turn's boundary snapshots, pending until the turn is accepted.

``with store.turn(session=...) as t: t.capture(tokens, parts)`` saves each capture with
``commit=False`` as a delta over the previous capture of the turn (the first over ``parent``,
``"auto"`` by default), so every capture stores only its new rows. Leaving the block normally
commits the last capture, which commits the chain root first; an exception abandons every
pending capture of the turn at once (none is left pinned until ``close()``).

``capture(..., wait=False)`` queues the capture (a :class:`snapstore.SaveHandle`) over the
previous one even while that one is in flight (the rule of :mod:`snapstore.save.chain`: a
skipped capture is passed over, a failed one fails the captures queued above it). ``commit()``
and ``abandon()`` wait for the turn's captures in flight first; ``commit(wait=False)`` does not: it
returns a Future at once and commits on the store's writer thread when the last capture in flight
lands (``in_flight`` lists them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from types import TracebackType
from typing import Literal, Protocol, overload

from snapstore._errors import StateError
from snapstore._refs import SnapshotRef
from snapstore._results import SaveResult
from snapstore._tokens import TokensLike
from snapstore.parts.buffers import PartSource
from snapstore.save.asynchronous import SaveHandle

__all__ = ["Turn", "TurnStore"]

log = logging.getLogger("snapstore")


class TurnStore(Protocol):
    """The calls a turn makes on its Store (:class:`snapstore.Store` is one): typed here, so this
    module sits below the Store rather than importing it."""

    def save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None,
             *, session: str | None = None, parent: SnapshotRef | SaveHandle | str | None = "auto",
             commit: bool = True, namespace: str | None = None, wait: bool) -> SaveResult | SaveHandle: ...

    def commit(self, res: SnapshotRef, *, namespace: str | None = None) -> SaveResult: ...

    def abandon(self, res: SnapshotRef, *, namespace: str | None = None) -> None: ...


def _saved(item: SaveResult | SaveHandle) -> SaveResult | None:
    """A finished capture's SaveResult when it was saved (not skipped, not failed), else None."""
    if not isinstance(item, SaveResult):
        if not item.done() or item.exception() is not None:
            return None
        item = item.result()
    return item if item.ok else None


class Turn:
    """One turn's capture chain (``Store.turn``); a context manager: commit on exit, abandon on error."""

    def __init__(self, store: TurnStore, *, session: str | None, namespace: str | None,
                 parent: SnapshotRef | str | None):
        self._store = store
        self.session = session
        self.namespace = namespace
        self._parent = parent
        self._items: list[SaveResult | SaveHandle] = []  # in order; skipped SaveResults dropped
        self.result: SaveResult | None = None  # what commit() returned
        self._done = False

    @property
    def captures(self) -> list[SaveResult]:
        """The captures saved so far, in order (skipped, failed and in-flight ones not listed)."""
        return [r for r in map(_saved, self._items) if r is not None]

    @property
    def in_flight(self) -> list[SaveHandle]:
        """The captures made with ``wait=False`` that have not landed yet, in order (their handles)."""
        return [h for h in self._items if isinstance(h, SaveHandle) and not h.done()]

    @property
    def last(self) -> SaveResult | None:
        """The last capture known saved (skipped ones passed over; in-flight ones not waited for)."""
        saved = self.captures
        return saved[-1] if saved else None

    @overload
    def capture(self, tokens: TokensLike, parts: Mapping[str, PartSource],
                rows: int | Mapping[str, int] | None = None, *, wait: Literal[True] = True) -> SaveResult: ...

    @overload
    def capture(self, tokens: TokensLike, parts: Mapping[str, PartSource],
                rows: int | Mapping[str, int] | None = None, *, wait: Literal[False]) -> SaveHandle: ...

    def capture(self, tokens: TokensLike, parts: Mapping[str, PartSource],
                rows: int | Mapping[str, int] | None = None, *, wait: bool = True) -> SaveResult | SaveHandle:
        """Save a pending boundary snapshot, a delta over the previous capture of this turn.

        ``wait=False``: returns a SaveHandle at once (``save(wait=False)``'s rules for what is
        copied), queued over the previous capture even while it is in flight."""
        if self._done:
            raise StateError("this turn is already committed or abandoned; start another with store.turn()")
        parent = self._items[-1] if self._items else self._parent
        res = self._store.save(tokens, parts, rows, session=self.session, parent=parent, commit=False,
                               namespace=self.namespace, wait=wait)
        if isinstance(res, SaveHandle) or res.ok:
            self._items.append(res)  # a skipped capture (budget) is no parent: the next one chains above
        return res

    def _settle(self) -> None:
        """Wait for the captures in flight; a failed one is logged (its handle keeps the error)."""
        for item in self._items:
            if not isinstance(item, SaveResult):
                err = item.exception()
                if err is not None:
                    log.warning("a capture of this turn failed (%s: %s); the turn ends at the capture "
                                "before it", type(err).__name__, err)

    @overload
    def commit(self, *, wait: Literal[True] = True) -> SaveResult | None: ...

    @overload
    def commit(self, *, wait: Literal[False]) -> Future[SaveResult | None]: ...

    def commit(self, *, wait: bool = True) -> SaveResult | None | Future[SaveResult | None]:
        """Make the turn visible: commit the last saved capture and with it the chain, root first.

        Waits for the captures in flight first. Returns the commit's SaveResult (``skipped`` set if
        the budget refused it), or None when nothing was saved. ``wait=False``: returns a Future of
        that at once; the commit runs when the last capture in flight lands (on the store's writer
        thread, or here when none is in flight), and ``result`` is set then.
        """
        if self._done:
            raise StateError("this turn is already committed or abandoned")
        self._done = True
        if wait:
            return self._commit_now()
        out: Future[SaveResult | None] = Future()
        flying = self.in_flight
        left, lock = [len(flying)], threading.Lock()

        def landed(_: object = None) -> None:
            with lock:
                left[0] -= 1
                if left[0] > 0:
                    return
            try:
                out.set_result(self._commit_now())
            except BaseException as e:  # the Future carries the commit's error (a closed store, ...)
                out.set_exception(e)

        if not flying:
            left[0] = 1
            landed()
        for h in flying:
            h.add_done_callback(landed)  # at once, here, for one that landed since in_flight was read
        return out

    def _commit_now(self) -> SaveResult | None:
        """The commit itself, once every capture of the turn has landed (waited for here otherwise)."""
        self._settle()
        last = self.last
        if last is None:
            return None
        self.result = self._store.commit(last)
        return self.result

    def abandon(self) -> None:
        """Drop every pending capture of this turn (and anything chained above them), once the
        captures in flight are done."""
        if self._done:
            return
        self._done = True
        self._settle()
        for res in self.captures:
            if res.pending:
                self._store.abandon(res)  # the first drops the rest with it; a gone id is a no-op

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            if not self._done:
                self.commit()
        else:
            try:
                self.abandon()
            except StateError:
                pass  # the store closed meanwhile: close() abandoned its pending captures itself
