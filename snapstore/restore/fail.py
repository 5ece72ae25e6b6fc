"""How a restore reports a chunk it could not use: one copy for the buffered and the direct paths.

A chunk whose bytes do not check out is recorded in ``damage`` (for ``restore.stream.quarantine``, which
re-checks its current bytes before it condemns it), dropped from the RAM tier, and raised as
CorruptChunkError; a read the operating system failed is a RestoreError. A chunk that was checked
in the destination's own memory is first re-read into private memory: when that copy is intact,
the destination changed the bytes (a DestinationError), and the chunk is left alone. Every error
says whether the destination was written.
"""

from __future__ import annotations

from snapstore._errors import CorruptChunkError, DestinationError, RestoreError
from snapstore.chunks.chunkfile import ChunkHeader, recheck
from snapstore.plan.restore_plan import RestorePlan
from snapstore.restore.ramtier import RamTier

__all__ = ["Damage", "corrupt", "outcome", "read_failed"]

# ids of the chunks a restore found damaged or missing: candidates, re-checked before quarantine
Damage = list[bytes]


def outcome(touched: bool) -> str:
    """The end of every restore error message: what the destination holds now."""
    return "the destination was partly written: re-read the prompt" if touched else "nothing was written"


def corrupt(plan: RestorePlan, cid: bytes, fd: int, reason: str, touched: bool, damage: Damage,
            ram: RamTier | None, in_place: ChunkHeader | None = None) -> RestoreError:
    """The error for chunk ``cid`` (open as ``fd``) found damaged, its damage recorded.

    ``in_place``: the chunk's header when its checksum was taken from the destination's memory (read
    in place, or into a buffer the writer lent); the file is re-read into private memory first, and
    when that copy checks out the destination changed the bytes: a DestinationError, no damage."""
    if in_place is not None:
        try:
            again = recheck(fd, in_place)
        except OSError as e:
            again = f"read error: {e.strerror}"
        if again is None:
            return DestinationError(
                f"snapshot {plan.snapshot_id}: chunk {cid.hex()} read into the destination's memory failed its "
                f"checksum ({reason}), yet the same file read into private memory is intact: the destination "
                "changed those bytes while they were restored (a block table that names one block twice, or "
                "another thread writing the destination); the chunk is kept; " + outcome(True),
                touched=True, snapshot_id=plan.snapshot_id)
    if ram is not None:
        ram.discard(cid)
    damage.append(cid)
    return CorruptChunkError(f"snapshot {plan.snapshot_id}: chunk {cid.hex()} is corrupt ({reason}); "
                             + outcome(touched), touched=touched, snapshot_id=plan.snapshot_id)


def read_failed(plan: RestorePlan, cid: bytes, e: OSError, touched: bool) -> RestoreError:
    """The error for a read of chunk ``cid`` that the operating system failed."""
    return RestoreError(f"snapshot {plan.snapshot_id}: reading chunk {cid.hex()} failed ({e.strerror}); "
                        + outcome(touched), touched=touched, snapshot_id=plan.snapshot_id)
