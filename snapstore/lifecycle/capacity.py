"""Capacity: does a save fit the budget and the disk? (one copy, for save and commit alike)."""

from __future__ import annotations

import os
from collections.abc import Callable

from snapstore._config import Budget
from snapstore._errors import CorruptionError
from snapstore.catalog.queries import Txn
from snapstore.lifecycle.eviction import over_budget

__all__ = ["Capacity"]


class Capacity:
    """The budget of one store and the free space of its file system."""

    def __init__(self, root: str, budget: Budget, blob_path: Callable[[bytes], str]) -> None:
        self.root = root
        self.budget = budget
        self._blob_path = blob_path

    def free_space(self) -> int:
        """Bytes available to this process on the store's file system."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return 1 << 62  # cannot tell: the budget still applies, the reserve cannot
        return st.f_bavail * st.f_frsize

    def precheck(self, upper: int, stored: int) -> str | None:
        """Reasons to skip before writing anything: larger than the budget, or than the disk."""
        if upper > (self.budget.disk_bytes or 0):
            return "larger_than_budget"
        if self.free_space() + stored - upper < (self.budget.reserve_bytes or 0):
            return "disk_full"
        return None

    def excess(self, t: Txn) -> str | None:
        """Why the store does not fit its budget now (a skip reason), or None when it does."""
        b = self.budget
        reason = over_budget(t, b.disk_bytes or 0, b.max_entries)
        if reason is not None or not b.reserve_bytes:
            return reason
        free = self.free_space()
        if free < b.reserve_bytes:
            # chunk files freed in this transaction are unlinked right after it commits
            for cid in set(t.freed):
                try:
                    free += os.stat(self._blob_path(cid)).st_size
                except (OSError, CorruptionError):
                    pass
        return "disk_reserve" if free < b.reserve_bytes else None
