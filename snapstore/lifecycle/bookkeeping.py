"""What a store records in memory between writes: counters, and restores' last use and hits.

A restore never queues behind a writer for its bookkeeping: it is recorded here and written by
the next write transaction of the store (or by a restore that finds the write lock free). A
transaction *takes* everything recorded so far (swapped out under the lock, so two concurrent
transactions never both write the same hits) and gives it back if it does not commit. A restore
from outside a snapshot's session is recorded here too (the session rule of :mod:`snapstore.lifecycle.rules`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

from snapstore._errors import SnapstoreError
from snapstore.catalog.queries import Txn
from snapstore.catalog.rate_queries import RateRow

if TYPE_CHECKING:
    from snapstore.chunks.repo import Repo

__all__ = ["USE_EVERY_S", "Batch", "Ledger", "flush_if_free", "record_use", "write_with", "writing"]

T = TypeVar("T")

# A restore writes its last use and hit at most this often: a write transaction per restore was
# ~0.1-0.2 ms of a 1.5 ms small restore (issue 31), and last use orders eviction by the second.
USE_EVERY_S = 0.5


class RateSource(Protocol):
    """What hands restore-rate rows over for persisting (:class:`snapstore.restore.rates.RestoreRates`)."""

    def staged(self, *, force: bool = False, now: float | None = None) -> list[RateRow]: ...

    def unstage(self, rows: Iterable[RateRow]) -> None: ...


class Batch:
    """Bookkeeping taken by one transaction: written inside it by :meth:`apply`."""

    __slots__ = ("counts", "rates", "shared", "touches")

    def __init__(self, counts: dict[str, int], touches: dict[int, tuple[float, int]], shared: set[int],
                 rates: list[RateRow] | None = None) -> None:
        self.counts = counts
        self.touches = touches
        self.shared = shared
        self.rates = rates or []

    def apply(self, t: Txn) -> None:
        """Write the counters, the restores' last use and hits, and outside uses in transaction ``t``."""
        for sid, (when, n) in self.touches.items():
            t.touch(sid, when, n)
        for sid in self.shared:
            t.mark_shared(sid)
        for k, v in self.counts.items():
            t.add_counter(k, v)
        for row in self.rates:  # restore rates: handed over at most every STAGE_EVERY_S (restore.rates)
            t.set_restore_rate(row)


class Ledger:
    """Counters and touches recorded in memory, thread-safe."""

    def __init__(self, ram_hits: Callable[[], int] | None = None, rates: RateSource | None = None) -> None:
        self._rates = rates
        self._lock = threading.Lock()
        self._taken_at = 0.0  # monotonic time of the last take() (0: never)
        self._counts: dict[str, int] = {}
        self._touches: dict[int, tuple[float, int]] = {}  # sid -> (latest use, hits)
        self._shared: set[int] = set()  # restored from outside their session
        self._ram_hits = ram_hits

    def count(self, name: str, delta: int = 1) -> None:
        """Add ``delta`` to counter ``name``."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + delta

    def record_use(self, sid: int, now: float, *, outside: bool = False) -> None:
        """Remember a successful restore (last use, one hit; ``outside``: by a caller outside the
        snapshot's session) for the next write to persist."""
        with self._lock:
            if outside:
                self._shared.add(sid)
            last, hits = self._touches.get(sid, (0.0, 0))
            self._touches[sid] = (max(last, now), hits + 1)
            self._counts["restores"] = self._counts.get("restores", 0) + 1

    def due(self, every: float) -> bool:
        """Whether ``every`` seconds passed since a transaction last took the bookkeeping."""
        with self._lock:
            return time.monotonic() - self._taken_at >= every

    def take(self) -> Batch:
        """Everything recorded so far, removed from the ledger (give it back if it is not committed)."""
        hits = self._ram_hits() if self._ram_hits is not None else 0
        with self._lock:
            self._taken_at = time.monotonic()
            if hits:
                self._counts["ram_hits"] = self._counts.get("ram_hits", 0) + hits
            batch = Batch(self._counts, self._touches, self._shared,
                          self._rates.staged() if self._rates is not None else None)
            self._counts, self._touches, self._shared = {}, {}, set()
        return batch

    def give_back(self, batch: Batch) -> None:
        """Return a batch whose transaction did not commit, merged with what was recorded since."""
        if batch.rates and self._rates is not None:
            self._rates.unstage(batch.rates)
        with self._lock:
            self._shared |= batch.shared
            for k, v in batch.counts.items():
                self._counts[k] = self._counts.get(k, 0) + v
            for sid, (when, n) in batch.touches.items():
                last, hits = self._touches.get(sid, (0.0, 0))
                self._touches[sid] = (max(last, when), hits + n)


def write_with(repo: Repo, ledger: Ledger, fn: Callable[[Txn], T], *, durable: bool = True,
               discard: Iterable[bytes] = (), committed: Callable[[], None] | None = None) -> T:
    """A write transaction through :meth:`Repo.write` (freed files unlinked after the commit) that
    also persists what ``ledger`` recorded — before ``fn``, so eviction in ``fn`` sees recent use.
    The bookkeeping is taken out of the ledger and given back if the transaction fails, so a
    retried or rolled-back transaction neither loses nor doubles it.
    """
    with _taken(ledger) as batch:

        def run(t: Txn) -> T:
            batch.apply(t)
            return fn(t)

        return repo.write(run, durable=durable, discard=discard, committed=committed,
                          deferred=lambda: ledger.count("unlink_deferred"))


@contextmanager
def writing(repo: Repo, ledger: Ledger, *, discard: Iterable[bytes] = (),
            committed: Callable[[], None] | None = None) -> Iterator[Txn]:
    """:func:`write_with` as a block (:meth:`Repo.writing`): a durable write transaction opened and
    committed where its caller reads it (a save's, whose COMMIT publishes it), ``ledger``'s
    bookkeeping written first in it and given back if it does not commit."""
    with _taken(ledger) as batch, repo.writing(discard=discard, committed=committed,
                                               deferred=lambda: ledger.count("unlink_deferred")) as t:
        batch.apply(t)
        yield t


@contextmanager
def _taken(ledger: Ledger) -> Iterator[Batch]:
    """The bookkeeping recorded so far, for one transaction; given back if the block raises."""
    batch = ledger.take()
    try:
        yield batch
    except BaseException:
        ledger.give_back(batch)
        raise


def flush_if_free(repo: Repo, ledger: Ledger) -> None:
    """Persist the bookkeeping now if the write lock is free; otherwise leave it for later."""
    batch = ledger.take()
    try:
        ran, _ = repo.db.try_write(batch.apply)
    except SnapstoreError:
        ran = False  # bookkeeping only: a full disk must not fail a restore that worked
    if not ran:
        ledger.give_back(batch)


def record_use(repo: Repo, ledger: Ledger, uses: Iterable[tuple[int, bool]]) -> None:
    """Restores' bookkeeping: (snapshot id, first use outside its session) each. An outside use is
    written now (the one wait a restore may make, once per snapshot), so a supersede in any
    process sees it; the rest only if the write lock is free and no transaction took the
    bookkeeping in the last :data:`USE_EVERY_S` (any write, stats() and close() take it too)."""
    now, outside = time.time(), False
    for sid, out in uses:
        ledger.record_use(sid, now, outside=out)
        outside |= out
    if not outside:
        if ledger.due(USE_EVERY_S):
            flush_if_free(repo, ledger)
        return
    try:
        write_with(repo, ledger, lambda t: None, durable=False)
    except SnapstoreError:
        pass  # kept in the ledger (given back): the store's next write records it
