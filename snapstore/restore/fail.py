"""How a restore reports a chunk it could not use: one copy for the buffered and the direct paths.

A chunk whose bytes do not check out is recorded in ``damage`` (for :func:`quarantine`, which
re-checks its current bytes before it condemns it), dropped from the RAM tier, and raised as
CorruptChunkError; a read the operating system failed is a RestoreError. A chunk that was checked
in the destination's own memory is first re-read into private memory: when that copy is intact,
the destination changed the bytes (a DestinationError), and the chunk is left alone. Every error
says whether the destination was written.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from snapstore._errors import CorruptChunkError, CorruptionError, DestinationError, RestoreError
from snapstore.catalog.db import Conn, Database
from snapstore.chunks.chunkfile import ChunkHeader, chunk_damage, recheck
from snapstore.plan.restore_plan import RestorePlan
from snapstore.restore.ramtier import RamTier

__all__ = ["Damage", "corrupt", "outcome", "quarantine", "read_failed"]

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


def quarantine(db: Database, blob_path: Callable[[bytes], str], damage: Damage) -> int:
    """Quarantine the chunks a restore found damaged that are damaged *now*; returns how many.

    Under the write lock (no save can heal or republish meanwhile), each chunk's current file is
    checked again against its current row, bytes included (:func:`snapstore.chunks.chunkfile.chunk_damage`): a
    chunk whose row is gone (evicted) is left alone, and so is one whose file is intact now — a
    save healed it, or the snapshot was deleted and saved again (whatever inode its file got), or
    the first read was the one at fault. A file that cannot be read now confirms nothing either.
    """
    now = time.time()

    def run(c: Conn) -> int:
        n = 0
        for cid in dict.fromkeys(damage):
            row = c.chunk(cid)
            if row is None or row.quarantined is not None:
                continue
            try:
                if chunk_damage(blob_path(cid), row.raw_len, row.checksum) is None:
                    continue  # intact now: nothing to condemn
            except (OSError, CorruptionError):
                continue  # unreadable now, or no valid path: a later restore finds it again
            n += c.quarantine_chunk(cid, now)
        return n

    return db.write(run)
