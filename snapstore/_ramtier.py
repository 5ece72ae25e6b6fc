"""RAM tier: recently restored chunks kept decoded in process memory, LRU, up to ``ram_bytes``.

A chunk is admitted on its second restore, not its first: a one-off restore pays no extra copy
and holds no extra memory, while a hot prefix restored again is served at memory speed from then on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["RamTier"]


class RamTier:
    """An LRU of verified, decoded chunk bytes keyed by chunk id (content-addressed: never stale)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.hits = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # restored once: admitted next time
        self._lock = threading.Lock()

    def get(self, cid: bytes) -> bytes | None:
        """The chunk's bytes, or None; a hit refreshes its place."""
        with self._lock:
            data = self._items.get(cid)
            if data is not None:
                self._items.move_to_end(cid)
                self.hits += 1
            return data

    def put(self, cid: bytes, data: bytes | memoryview) -> None:
        """Keep a verified chunk (copied); evicts the least recently used to make room."""
        n = len(data)
        if n == 0 or n > self.capacity // 2:
            return
        with self._lock:
            if cid in self._items:
                self._items.move_to_end(cid)
                return
            if cid not in self._seen:
                self._seen[cid] = None
                if len(self._seen) > 65536:
                    self._seen.popitem(last=False)
                return
            del self._seen[cid]
        copy = bytes(data)
        with self._lock:
            if cid in self._items:  # another thread put it meanwhile
                return
            while self.used + n > self.capacity and self._items:
                _, old = self._items.popitem(last=False)
                self.used -= len(old)
            self._items[cid] = copy
            self.used += n

    def take_hits(self) -> int:
        """Hits since the last call (for the persistent counters)."""
        with self._lock:
            hits, self.hits = self.hits, 0
            return hits

    def discard(self, cid: bytes) -> None:
        """Forget a chunk (it was found corrupt or dropped)."""
        with self._lock:
            self._seen.pop(cid, None)
            old = self._items.pop(cid, None)
            if old is not None:
                self.used -= len(old)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._items.clear()
            self._seen.clear()
            self.used = 0
