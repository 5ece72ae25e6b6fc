"""A Store's tiers, nearest first: the RAM tier (when ``Budget.ram_bytes`` is set), the local chunk
files, the shared tier (:data:`snapstore.tiers.interface.NO_SHARED_TIER` unless ``remote=`` is set).

The Store holds one :class:`Tiers` and asks each tier through its interface
(:mod:`snapstore.tiers.interface`): a restore reads the RAM tier's chunks, then the files', checking every
chunk (:mod:`snapstore.restore.stream`); a match asks the shared tier for a longer chain; a save hands
it the committed snapshot.
"""

from __future__ import annotations

from collections.abc import Callable

from snapstore._identity import Identity
from snapstore.chunks.file_tier import FileTier
from snapstore.chunks.repo import Repo
from snapstore.restore.ramtier import RamTier
from snapstore.tiers.interface import NO_SHARED_TIER, SharedTier, Tier

__all__ = ["Tiers"]


class Tiers:
    """The RAM tier (or None), the chunk files, the shared tier (always one: the null one without ``remote=``)."""

    __slots__ = ("files", "ram", "shared")

    def __init__(self, repo: Repo, ram_bytes: int | None) -> None:
        self.files = FileTier(repo)
        self.ram = RamTier(ram_bytes, self.files) if ram_bytes else None  # admission reads through the files
        self.shared: SharedTier = NO_SHARED_TIER

    @property
    def local(self) -> list[Tier]:
        """The chunk tiers a restore reads, nearest first."""
        return [self.files] if self.ram is None else [self.ram, self.files]

    def open_shared(self, url: str | None, identity: Identity, owner: str, count: Callable[[str, int], None],
                    wait: bool | None) -> None:
        """Open the shared tier for ``url`` (else ``$SNAPSTORE_REMOTE``); none set: the null one stays."""
        from snapstore.remote.tier import open_remote  # imported on demand: obstore only where remote= is used
        self.shared = open_remote(url, self.files.repo, identity, owner, count, wait) or NO_SHARED_TIER

    def close_shared(self, forked: bool) -> None:
        """Close the shared tier (it finishes its queued uploads first) and hold the null one from now on;
        in a forked child only let it go (its threads and sockets are the parent's)."""
        shared, self.shared = self.shared, NO_SHARED_TIER
        if not forked:
            shared.close()

    def close_local(self) -> None:
        """Stop the RAM tier's admission and forget what it held (the chunk files stay)."""
        if self.ram is not None:
            self.ram.clear()
