"""How a restore reports a chunk it could not use: one copy for the buffered and the direct paths.

A chunk whose bytes do not check out is recorded in ``damage`` (its file's device and inode, for
``_restore.quarantine``), dropped from the RAM tier, and raised as CorruptChunkError; a read the
operating system failed is a RestoreError. Both say whether the destination was written.
"""

from __future__ import annotations

import os

from ._errors import CorruptChunkError, RestoreError
from ._plan import RestorePlan
from ._ramtier import RamTier

__all__ = ["Damage", "corrupt", "outcome", "read_failed"]

# (chunk id, (st_dev, st_ino) of the damaged file, or None when the file was missing)
Damage = list[tuple[bytes, "tuple[int, int] | None"]]


def outcome(touched: bool) -> str:
    """The end of every restore error message: what the destination holds now."""
    return "the destination was partly written: re-read the prompt" if touched else "nothing was written"


def corrupt(plan: RestorePlan, cid: bytes, fd: int, reason: str, touched: bool, damage: Damage,
            ram: RamTier | None) -> CorruptChunkError:
    """The error for chunk ``cid`` (open as ``fd``) found damaged, its damage recorded."""
    if ram is not None:
        ram.discard(cid)
    try:
        st = os.fstat(fd)
        damage.append((cid, (st.st_dev, st.st_ino)))
    except OSError:
        pass
    return CorruptChunkError(f"snapshot {plan.snapshot_id}: chunk {cid.hex()} is corrupt ({reason}); "
                             + outcome(touched), touched=touched, snapshot_id=plan.snapshot_id)


def read_failed(plan: RestorePlan, cid: bytes, e: OSError, touched: bool) -> RestoreError:
    """The error for a read of chunk ``cid`` that the operating system failed."""
    return RestoreError(f"snapshot {plan.snapshot_id}: reading chunk {cid.hex()} failed ({e.strerror}); "
                        + outcome(touched), touched=touched, snapshot_id=plan.snapshot_id)
