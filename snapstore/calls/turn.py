"""Capture chains: one turn's boundary snapshots, pending until the turn is accepted.

``with store.turn(session=...) as t: t.capture(tokens, parts)`` saves each capture with
``commit=False`` as a delta over the previous capture of the turn (the first over ``parent``,
``"auto"`` by default), so every capture stores only its new rows. Leaving the block normally
commits the last capture, which commits the chain root first; an exception abandons every
pending capture of the turn at once (none is left pinned until ``close()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Protocol

from snapstore._errors import StateError
from snapstore._refs import SnapshotRef
from snapstore._results import SaveResult
from snapstore._tokens import TokensLike
from snapstore.parts.buffers import PartSource

__all__ = ["Turn", "TurnStore"]


class TurnStore(Protocol):
    """The calls a turn makes on its Store (:class:`snapstore.Store` is one): typed here, so this
    module sits below the Store rather than importing it."""

    def save(self, tokens: TokensLike, parts: Mapping[str, PartSource], rows: int | Mapping[str, int] | None = None,
             *, session: str | None = None, parent: SnapshotRef | str | None = "auto", commit: bool = True,
             namespace: str | None = None) -> SaveResult: ...

    def commit(self, res: SnapshotRef, *, namespace: str | None = None) -> SaveResult: ...

    def abandon(self, res: SnapshotRef, *, namespace: str | None = None) -> None: ...


class Turn:
    """One turn's capture chain (``Store.turn``); a context manager: commit on exit, abandon on error."""

    def __init__(self, store: TurnStore, *, session: str | None, namespace: str | None,
                 parent: SnapshotRef | str | None):
        self._store = store
        self.session = session
        self.namespace = namespace
        self._parent = parent
        self.captures: list[SaveResult] = []  # the saved captures, in order (skipped ones not kept)
        self.result: SaveResult | None = None  # what commit() returned
        self._done = False

    def capture(self, tokens: TokensLike, parts: Mapping[str, PartSource],
                rows: int | Mapping[str, int] | None = None) -> SaveResult:
        """Save a pending boundary snapshot, a delta over the previous capture of this turn."""
        if self._done:
            raise StateError("this turn is already committed or abandoned; start another with store.turn()")
        parent = self.captures[-1] if self.captures else self._parent
        res = self._store.save(tokens, parts, rows, session=self.session, parent=parent, commit=False,
                               namespace=self.namespace)
        if res.ok:
            self.captures.append(res)  # a skipped capture (budget) is no parent: the next one chains above
        return res

    def commit(self) -> SaveResult | None:
        """Make the turn visible: commit the last capture and with it the chain, root first.

        Returns the commit's SaveResult (``skipped`` set if the budget refused it), or None when
        nothing was captured.
        """
        if self._done:
            raise StateError("this turn is already committed or abandoned")
        self._done = True
        if not self.captures:
            return None
        self.result = self._store.commit(self.captures[-1])
        return self.result

    def abandon(self) -> None:
        """Drop every pending capture of this turn (and anything chained above them)."""
        if self._done:
            return
        self._done = True
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
