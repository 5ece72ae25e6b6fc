"""One interface in front of every place a store's bytes live (issue 51): what a tier must answer.

Two key spaces, so two faces. A :class:`Tier` holds chunks by content address: the RAM tier
(:class:`snapstore.restore.ramtier.RamTier`) and the local chunk files
(:class:`snapstore.chunks.file_tier.FileTier`); each answers whether it has a chunk, reads one into a
buffer checked against the catalog's checksum, forgets chunks and says how many bytes it holds. The
:class:`SharedTier` holds whole chains, sealed per identity and namespace and found from a prompt through
their manifests: the S3 tier (:class:`snapstore.remote.tier.RemoteTier`), or :data:`NO_SHARED_TIER` when
a store has none, so the Store asks it the same questions either way and never branches on its absence.

Writing is each tier's own, not part of either face: a chunk file is published by a save, durable before
its catalog row commits (invariant 4); the RAM tier admits a chunk on its second restore, read again
from its file; the shared tier uploads a committed chain. SGLang's HiCache sits above all of them: its
storage interface (exists / get / set) is answered by a Store (``snapstore.engine.sglang``), which reads
and writes through these tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from snapstore._errors import SnapshotUnavailableError
from snapstore._layout import Layout
from snapstore._results import Match, RestoreResult, SaveResult
from snapstore.catalog.db import Conn
from snapstore.catalog.rows import ChunkRow
from snapstore.remote.uploader import FlushResult

__all__ = ["NO_SHARED_TIER", "NoSharedTier", "SharedTier", "Tier"]


@runtime_checkable
class Tier(Protocol):
    """A place chunks live, by content address (their bytes never go stale)."""

    name: str  # the tier's name in the restore rates and stats: "ram", "disk"

    def has(self, cid: bytes) -> bool:
        """Whether the chunk is held now; nothing read, nothing counted."""

    def read_into(self, chunk: ChunkRow, out: memoryview) -> bool:
        """The chunk's raw bytes into ``out``, equal to the catalog's checksum; False: not held here."""

    def delete(self, cids: Iterable[bytes]) -> int:
        """Forget these chunks (damaged, or their rows gone); the bytes freed."""

    def measure(self) -> int:
        """The bytes held now."""


@runtime_checkable
class SharedTier(Protocol):
    """The tier behind the local ones, by prompt and chain: what the Store asks of it on every call."""

    present: bool  # False only for NO_SHARED_TIER (a lookup() then takes one catalog read, not two)

    def has(self, m: object) -> bool:
        """Whether ``m`` is a match this tier served (restored through :meth:`restore`)."""

    def lookup(self, arr: np.ndarray, ns: str, have: int) -> Match | None:
        """The longest chain matching prompt ``arr`` in namespace ``ns``, longer than ``have`` tokens."""

    def restore(self, m: Any, into: Any, layout: Layout, wanted: set[str], rows_from: int,
                fits: Callable[[Conn, list[bytes]], bool], room: Callable[[int], bool],
                identity_id: Callable[[Conn], int]) -> Match | RestoreResult:
        """Serve match ``m``: restored (a RestoreResult), or fetched into the local tier (a local Match)."""

    def localize(self, requests: list[Any], store: Any, wanted: set[str], rows_from: int) -> list[Any]:
        """A batch's requests with this tier's matches fetched into the local tier first."""

    def saved(self, res: SaveResult) -> None:
        """A save or commit made ``res`` durable locally: keep a committed snapshot here too."""

    def nbytes(self, m: Any, layout: Layout, wanted: set[str]) -> int:
        """The bytes restoring ``m`` writes (an estimate's input)."""

    def uploads(self) -> dict[str, int]:
        """Writes queued and in flight now (``Store.stats().remote``)."""

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Wait for the writes queued so far."""

    def close(self) -> None:
        """Finish queued writes, release threads."""


class NoSharedTier:
    """The shared tier of a store opened without ``remote=``: it holds nothing."""

    present = False

    def has(self, m: object) -> bool:
        return False

    def lookup(self, arr: np.ndarray, ns: str, have: int) -> Match | None:
        return None

    def restore(self, m: Any, into: Any, layout: Layout, wanted: set[str], rows_from: int,
                fits: Callable[[Conn, list[bytes]], bool], room: Callable[[int], bool],
                identity_id: Callable[[Conn], int]) -> Match | RestoreResult:
        raise SnapshotUnavailableError("not a match from the shared tier; nothing was written")

    def localize(self, requests: list[Any], store: Any, wanted: set[str], rows_from: int) -> list[Any]:
        return requests

    def saved(self, res: SaveResult) -> None:
        return None

    def nbytes(self, m: Any, layout: Layout, wanted: set[str]) -> int:
        return 0

    def uploads(self) -> dict[str, int]:
        return {}

    def flush(self, timeout: float | None = None) -> FlushResult:
        return FlushResult()

    def close(self) -> None:
        return None


NO_SHARED_TIER = NoSharedTier()
