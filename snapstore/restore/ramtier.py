"""RAM tier: recently restored chunks kept decoded in process memory, LRU, up to ``ram_bytes``.

A chunk is admitted on its second restore, not its first: a one-off restore pays no extra copy
and holds no extra memory, while a hot prefix restored again is served at memory speed from then on.

Admission never runs on the restoring thread. Copying a chunk into fresh memory costs a page
fault per 4 KiB page (~1.3-2 GB/s here, slower than reading the page cache), and it made the
first warm restore of a prefix slower than a cold one (docs/benchmarks.md). A restore only
*offers* the chunk (its catalog row): one background thread reads it again from the file tier
(:meth:`snapstore.chunks.file_tier.FileTier.read_into`, from the page cache the restore just filled),
checked against the catalog's XXH3, and admits it. The RAM
copy never comes from the engine's destination, which the engine may change once restore returns.

Nor does admission compete with a restore for the CPU or the GIL: on 2 vCPUs a background reader +
XXH3 running beside the restore that triggered it made that restore 0.61x the raw read. So the
admission thread waits while any restore is in flight (:meth:`RamTier.restoring`), loads a chunk
in ``_PIECE`` pieces and waits again between pieces, and runs at a lower scheduling priority.

It looks for a moment with no restore in flight every :data:`_QUIET_POLL_S` (less often while no
restore ends, up to :data:`_QUIET_POLL_MAX_S`); a restore's end does not wake it. When each
restore's end woke it, a hot prefix restored back to back handed the GIL to the admission thread
after every restore, which found the next restore already begun: 1K tokens over 12 links restored
in ~230 us with the RAM tier, ~140 without it, until the tier held them (docs/benchmarks.md,
"Issue 48, sixth pass"). Once :data:`_PATIENCE` restores ended while it waited, it loads its next
piece anyway: a store never without a restore in flight (back to back, or from several threads)
would otherwise never admit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import numpy as np

from snapstore._forks import track
from snapstore.catalog.rows import ChunkRow
from snapstore.chunks.file_tier import FileTier

__all__ = ["RamTier"]

# Test hook: called as _TEST_HOOK(chunk_id) on the admission thread before it reads a chunk;
# tests pause it there with an Event to observe a restore that does not wait for admission.
_TEST_HOOK: Callable[[bytes], None] | None = None

_MAX_QUEUED = 256  # offers waiting for the admission thread; more are dropped (admitted next time)
_QUIET_POLL_S = 0.002  # how often a waiting admission looks for a moment with no restore in flight
_QUIET_POLL_MAX_S = 0.05  # ... doubling up to this while no restore ends (one long restore in flight)
# restores that may end while one piece of admission waits for such a moment: then it goes ahead (a
# server restoring back to back, or from several threads at once, is never without a restore in
# flight). Its cost to those restores: docs/benchmarks.md, "Issue 48, sixth pass" (the defaults
# restored back to back, bench_small's ram_busy)
_PATIENCE = 16
_NICE = 10  # the admission thread's niceness increment (best effort, Linux: per-thread priority)
# an idle admission thread lets go of its tier this often: a store dropped without close() is then
# collected, its tier with it, and the thread ends (it holds the tier only weakly between waits)
_IDLE_S = 1.0


class RamTier:
    """An LRU of verified, decoded chunk bytes keyed by chunk id (content-addressed: never stale); a
    :class:`snapstore.tiers.interface.Tier` that admits from ``source``, the store's chunk files."""

    name = "ram"

    def __init__(self, capacity: int, source: FileTier):
        self.capacity = capacity
        self._source = source
        self.used = 0
        self.hits = 0
        self._items: OrderedDict[bytes, memoryview] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # restored once: admitted next time
        self._lock = threading.Lock()
        self._queue: deque[ChunkRow] = deque()
        self._queued: set[bytes] = set()
        # one lock, three waits: the admission thread for an offer (_work) and for no restore in flight
        # (_quiet: polled, woken only by clear()), drain() for the queue to empty (_idle). Separate, so
        # no restore wakes the admission thread (module docstring)
        self._work = threading.Condition(self._lock)
        self._quiet = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._busy = False  # the admission thread is working on an offer
        self._thread: threading.Thread | None = None
        self._stop = False
        # restoring()'s: a plain object, cheaper than a generator per restore; it counts the restores in
        # flight (admission waits while there are any) and ended (admission's patience counts them)
        self._in_flight = _InFlight(self._lock)
        track(self)

    def _after_fork_in_child(self) -> None:
        """A forked child: fresh locks; the parent's offers, admission thread and restores are not here."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._quiet = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._queue.clear()
        self._queued.clear()
        self._busy, self._thread = False, None
        self._in_flight.reset(self._lock)  # the same object: a restore in flight across the fork leaves on this lock

    def restoring(self) -> _InFlight:
        """Mark a restore in flight (a context manager): admission pauses (at the next piece) until none
        is, or until :data:`_PATIENCE` restores ended while it waited."""
        return self._in_flight

    def _yield_to_restores(self) -> bool:
        """Block while a restore is in flight, or until :data:`_PATIENCE` restores ended meanwhile (a
        store never without one in flight admits a piece then, between them); False once the tier
        is stopping."""
        with self._lock:
            flight = self._in_flight
            since = seen = flight.ended
            wait = _QUIET_POLL_S
            while flight.active and not self._stop and flight.ended - since < _PATIENCE:
                self._quiet.wait(wait)
                # no restore ended since the last look (a long one in flight): look less often
                wait = _QUIET_POLL_S if flight.ended != seen else min(2 * wait, _QUIET_POLL_MAX_S)
                seen = flight.ended
            return not self._stop

    def get(self, cid: bytes) -> memoryview | None:
        """The chunk's bytes, or None; a hit refreshes its place."""
        return self.get_all((cid,))[0]

    def get_all(self, cids: Iterable[bytes]) -> list[memoryview | None]:
        """:meth:`get` for each of ``cids``, under one lock (a replayed restore asks for every chunk
        of its plan at once)."""
        with self._lock:
            items, found = self._items, []
            for cid in cids:
                data = items.get(cid)
                if data is not None:
                    items.move_to_end(cid)
                    self.hits += 1
                found.append(data)
            return found

    def has(self, cid: bytes) -> bool:
        """Whether the chunk is held now (an estimate's probe: no hit counted, its place unchanged)."""
        with self._lock:
            return cid in self._items

    def read_into(self, chunk: ChunkRow, out: memoryview) -> bool:
        """The held bytes of ``chunk`` copied into ``out`` (checked when admitted; a hit); False when not
        held, or ``out`` cannot hold the chunk (as the file tier answers; nothing copied, no hit). A restore
        takes the held view instead (:meth:`get`): no copy but the one into its destination."""
        if len(out) < chunk.raw_len:
            return False
        data = self.get(chunk.id)
        if data is None:
            return False
        out[:len(data)] = data
        return True

    def measure(self) -> int:
        """The bytes held now."""
        return self.used

    def _wanted(self, cid: bytes, n: int, first: bool = False) -> bool:
        """Under the lock: should this restore of ``cid`` lead to admitting it (second sighting, or
        the first with ``first``)?"""
        if n == 0 or n > self.capacity // 2:
            return False
        if cid in self._items:
            self._items.move_to_end(cid)
            return False
        if cid in self._queued:
            return False
        if first:
            self._seen.pop(cid, None)
            return True
        if cid not in self._seen:
            self._seen[cid] = None
            if len(self._seen) > 65536:
                self._seen.popitem(last=False)
            return False
        del self._seen[cid]
        return True

    def offer(self, chunk: ChunkRow, first: bool = False) -> None:
        """A chunk was restored (verified) from its file: admit it in the background if it was
        restored before, or now with ``first`` (it was read with O_DIRECT, which left nothing in the
        page cache: the RAM tier is then the only copy the next restore can read from memory, issue
        48). Never blocks on the copy; a full queue drops the offer."""
        self.offer_all((chunk,), first)

    def offer_all(self, chunks: Iterable[ChunkRow], first: bool = False) -> None:
        """:meth:`offer` for each of ``chunks``, under one lock (a replayed restore offers what it read
        from files at its end)."""
        with self._lock:
            if self._stop:
                return
            queued = False
            for chunk in chunks:
                cid = chunk.id
                if not self._wanted(cid, chunk.raw_len, first) or len(self._queue) >= _MAX_QUEUED:
                    continue
                self._queue.append(chunk)
                self._queued.add(cid)
                queued = True
            if not queued:
                return
            if self._thread is None:
                thread = threading.Thread(target=_admission, args=(weakref.ref(self),), name="snapstore-ramtier",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had now: the offers are dropped (a later restore offers again)
                    self._queue.clear()  # with no admission thread, only this call queued anything
                    self._queued.clear()
                    return
                self._thread = thread
            self._work.notify()

    def put(self, cid: bytes, data: bytes | memoryview) -> None:
        """Keep verified bytes now (copied) if this is their second sighting; evicts LRU to make room."""
        n = len(data)
        with self._lock:
            if not self._wanted(cid, n):
                return
        self._insert(cid, memoryview(bytes(data)))

    def _insert(self, cid: bytes, data: memoryview) -> None:
        n = len(data)
        with self._lock:
            if cid in self._items or self._stop:
                return
            while self.used + n > self.capacity and self._items:
                _, old = self._items.popitem(last=False)
                self.used -= len(old)
            # read-only: a restore hands held bytes to a PartWriter as they are, and a writer that scribbled
            # on them would change every later restore of the chunk (the tier checks bytes once, when admitted)
            self._items[cid] = data.toreadonly()
            self.used += n

    def _admit_next(self) -> bool:
        """The admission thread's step: wait up to :data:`_IDLE_S` for an offer and admit it; False
        once the tier is stopping."""
        with self._lock:
            if not self._queue and not self._stop:
                self._busy = False
                self._idle.notify_all()
                self._work.wait(_IDLE_S)
            if self._stop:
                self._busy = False
                self._idle.notify_all()
                return False
            if not self._queue:
                return True  # idle (or woken early): the thread lets go of the tier for a moment
            chunk = self._queue.popleft()
            cid = chunk.id
            self._busy = True
        try:
            if not self._yield_to_restores():
                return True  # stopping: the finally below still forgets the offer; the next step returns
            hook = _TEST_HOOK
            if hook is not None:
                hook(cid)
            data = np.empty(chunk.raw_len, dtype=np.uint8).data
            if self._source.read_into(chunk, data, self._yield_to_restores):  # checked, in pieces
                self._insert(cid, data)
        except Exception:  # noqa: S110 - admission is best effort: a later restore offers it again
            pass
        finally:
            with self._lock:
                self._queued.discard(cid)
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every offer so far is admitted or dropped (tests, benchmarks); False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: (not self._queue and not self._busy) or self._thread is None,
                                       timeout)

    def take_hits(self) -> int:
        """Hits since the last call (for the persistent counters)."""
        with self._lock:
            hits, self.hits = self.hits, 0
            return hits

    def delete(self, cids: Iterable[bytes]) -> int:
        """Forget chunks (found corrupt, or dropped); the bytes freed."""
        freed = 0
        with self._lock:
            for cid in cids:
                self._seen.pop(cid, None)
                old = self._items.pop(cid, None)
                if old is not None:
                    freed += len(old)
            self.used -= freed
        return freed

    def discard(self, cid: bytes) -> None:
        """Forget one chunk (:meth:`delete`)."""
        self.delete((cid,))

    def clear(self) -> None:
        """Forget everything and stop the admission thread (the store is closing)."""
        with self._lock:
            self._stop = True
            self._queue.clear()
            for cond in (self._work, self._quiet, self._idle):
                cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            self._items.clear()
            self._seen.clear()
            self._queued.clear()
            self.used = 0
            self._thread = None
            self._stop = False


def _admission(ref: weakref.ref[RamTier]) -> None:
    """The admission thread. It holds its tier only while it waits for an offer (up to :data:`_IDLE_S`) or
    admits one, so a store dropped without close() is collected, its tier with it, and the thread ends."""
    with contextlib.suppress(OSError, AttributeError):  # best effort: a restore outranks admission
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id()) + _NICE))
    while True:
        tier = ref()
        if tier is None or not tier._admit_next():
            return
        del tier  # not held between steps


class _InFlight:
    """:meth:`RamTier.restoring`'s context manager: counts the restores in flight and those ended, under the
    tier's lock. It holds the lock, not the tier: no cycle keeps an unclosed tier alive."""

    __slots__ = ("_lock", "active", "ended")

    def __init__(self, lock: threading.Lock) -> None:
        self.reset(lock)

    def reset(self, lock: threading.Lock) -> None:
        """Count afresh under ``lock`` (a forked child's: the parent's restores and its lock are not there)."""
        self._lock = lock
        self.active = 0
        self.ended = 0

    def __enter__(self) -> None:
        with self._lock:
            self.active += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.active -= 1  # nobody woken: admission looks again at its next poll
            self.ended += 1
