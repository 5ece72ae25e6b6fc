"""What a store records in memory between writes: counters, and restores' last use and hits.

A restore never queues behind a writer for its bookkeeping: it is recorded here and written by
the next write transaction of the store (or by a restore that finds the write lock free). A
transaction *takes* everything recorded so far (swapped out under the lock, so two concurrent
transactions never both write the same hits) and gives it back if it does not commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from ._catalog import Txn
from ._errors import SnapstoreError

if TYPE_CHECKING:
    from ._repo import Repo

__all__ = ["Batch", "Ledger", "flush_if_free", "write_with"]

T = TypeVar("T")


class Batch:
    """Bookkeeping taken by one transaction: written inside it by :meth:`apply`."""

    __slots__ = ("counts", "touches")

    def __init__(self, counts: dict[str, int], touches: dict[int, tuple[float, int]]) -> None:
        self.counts = counts
        self.touches = touches

    def apply(self, t: Txn) -> None:
        """Write the counters and the restores' last use and hits in transaction ``t``."""
        for sid, (when, n) in self.touches.items():
            t.touch(sid, when, n)
        for k, v in self.counts.items():
            t.add_counter(k, v)


class Ledger:
    """Counters and touches recorded in memory, thread-safe."""

    def __init__(self, ram_hits: Callable[[], int] | None = None) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._touches: dict[int, tuple[float, int]] = {}  # sid -> (latest use, hits)
        self._ram_hits = ram_hits

    def count(self, name: str, delta: int = 1) -> None:
        """Add ``delta`` to counter ``name``."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + delta

    def record_use(self, sid: int, now: float) -> None:
        """Remember a successful restore (last use, one hit) for the next write to persist."""
        with self._lock:
            last, hits = self._touches.get(sid, (0.0, 0))
            self._touches[sid] = (max(last, now), hits + 1)
            self._counts["restores"] = self._counts.get("restores", 0) + 1

    def take(self) -> Batch:
        """Everything recorded so far, removed from the ledger (give it back if it is not committed)."""
        hits = self._ram_hits() if self._ram_hits is not None else 0
        with self._lock:
            if hits:
                self._counts["ram_hits"] = self._counts.get("ram_hits", 0) + hits
            batch = Batch(self._counts, self._touches)
            self._counts, self._touches = {}, {}
        return batch

    def give_back(self, batch: Batch) -> None:
        """Return a batch whose transaction did not commit, merged with what was recorded since."""
        with self._lock:
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
    batch = ledger.take()

    def run(t: Txn) -> T:
        batch.apply(t)
        return fn(t)

    try:
        return repo.write(run, durable=durable, discard=discard, committed=committed,
                          deferred=lambda: ledger.count("unlink_deferred"))
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
