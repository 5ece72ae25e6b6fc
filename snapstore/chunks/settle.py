"""Settling a freshly written chunk file whose address is taken: keep the healthy file the catalog
vouches for, or put the new one in its place and heal the row (one decision, under the write lock)."""

from __future__ import annotations

from snapstore._errors import CorruptionError
from snapstore.catalog.db import ChunkRow, Conn, Database
from snapstore.chunks.chunkfile import header_at, header_matches
from snapstore.chunks.publish import discard, replace_into

__all__ = ["held", "settle", "vouched"]


def vouched(path: str, row: ChunkRow) -> bool:
    """Does the file at ``path`` look like what the catalog row says (header and size)?"""
    try:
        head, size = header_at(path)
    except (OSError, CorruptionError):
        return False
    return header_matches(head, row.raw_len, row.checksum) and head.codec == row.codec and size == row.stored_len


def held(c: Conn, cid: bytes, path: str) -> ChunkRow | None:
    """The chunk's row when this store really holds it: a healthy (unquarantined) row whose file at
    ``path`` its header vouches for; None for no row, a quarantined row or a lost or damaged file
    (what an import or a fetch must then write: :func:`settle` heals the row as it places the file)."""
    row = c.chunk(cid)
    return row if row is not None and row.quarantined is None and vouched(path, row) else None


def settle(db: Database, cid: bytes, tmp: str, path: str, stored_len: int, codec: int) -> int | None:
    """The address of a freshly written chunk is taken (or has a row): decide under the write lock.

    A healthy row whose file matches it: the file is kept, the temp discarded, and the row's
    stored length returned (the caller deduplicates onto it; a committed row's file is never
    replaced). Otherwise — no row (an orphan of a crashed or concurrent writer), a quarantined
    row, or a file that does not match its row — the temp replaces the file, and a row is made to
    describe the new file (and leaves quarantine) in the same transaction: returns None.
    """
    placed = [False]

    def run(c: Conn) -> int | None:
        row = c.chunk(cid)
        if not placed[0]:
            if row is not None and row.quarantined is None and vouched(path, row):
                return int(row.stored_len)
            replace_into(tmp, path)
            placed[0] = True
        if row is not None:
            c.heal_chunk(cid, stored_len, codec)
        return None

    kept = db.write(run)
    if kept is not None:
        discard(tmp)
    return kept
