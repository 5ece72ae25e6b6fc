"""A chain's part and chunk rows read in one statement, served to :func:`snapstore.plan.restore_plan.build_plan`.

``build_plan`` asks its :class:`~snapstore.plan.restore_plan.PlanSource` for each link's parts and
each part's chunks: against the catalog that was two statements per link and part (36 for a small
12-link restore, more than its bytes cost: issue 31). :class:`ChainRows` reads them all at once,
inside the plan's own read transaction, and answers from memory; every check ``build_plan`` makes
is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from snapstore.catalog.rows import ChunkRow, PartRow

__all__ = ["ChainRows"]


class _Reads(Protocol):
    def chain_parts(self, ids: Sequence[int]) -> list[tuple[PartRow, list[ChunkRow | None]]]: ...


class ChainRows:
    """The parts (by snapshot, in name order) and chunk references of snapshots ``ids``."""

    __slots__ = ("_chunks", "_parts")

    def __init__(self, c: _Reads, ids: Sequence[int]) -> None:
        self._parts: dict[int, list[PartRow]] = {i: [] for i in ids}
        self._chunks: dict[tuple[int, str], list[ChunkRow | None]] = {}
        for part, chunks in c.chain_parts(ids):
            self._parts.setdefault(part.snapshot_id, []).append(part)
            self._chunks[(part.snapshot_id, part.name)] = chunks

    def parts(self, sid: int) -> list[PartRow]:
        """The parts of ``sid`` in name order (as ``Txn.parts``)."""
        return self._parts.get(sid, [])

    def part_chunks(self, sid: int, name: str) -> list[ChunkRow | None]:
        """The chunks of one part in order; None where a referenced chunk row is missing (as ``Txn.part_chunks``)."""
        return self._chunks.get((sid, name), [])
