"""The local tier: this store's chunk files, as one place a chunk's bytes live (the
:class:`snapstore.tiers.interface.Tier` interface, with the RAM tier beside it).

A restore streams these files itself (:mod:`snapstore.restore.stream`: kept descriptors, reader threads,
O_DIRECT runs); this is the tier's face for the rest — whether a chunk's file is there, one chunk read
whole and checked against the catalog (the RAM tier's admission reads through it), the files whose rows
are gone removed, the bytes held. A chunk file is written only by a save or a fetch, durable before the
catalog row that names it commits (invariant 4), so writing is not part of this face.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable

from snapstore._errors import CorruptionError
from snapstore.catalog.rows import ChunkRow
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    checksum,
    checksum_stream,
    decode_fd,
    header_matches,
    open_chunk,
    parse_header,
    read_exact,
)
from snapstore.chunks.repo import Repo

__all__ = ["FileTier"]

_PIECE = 4 << 20  # a raw chunk is read and checked in pieces, ``pause()`` called between them


class FileTier:
    """The chunk files of one store directory (``blobs/``), read and removed through its :class:`Repo`."""

    name = "disk"

    def __init__(self, repo: Repo) -> None:
        self.repo = repo

    def has(self, cid: bytes) -> bool:
        """Whether a regular file is at the chunk's path (nothing read: a restore checks its header)."""
        try:
            return stat.S_ISREG(os.lstat(self.repo.blob_path(cid)).st_mode)
        except (OSError, CorruptionError):
            return False

    def read_into(self, chunk: ChunkRow, out: memoryview, pause: Callable[[], bool] | None = None) -> bool:
        """``chunk``'s raw bytes into ``out[:chunk.raw_len]``, decoded and checked against the catalog's
        checksum; False when its file is gone, is not a regular file (opened without blocking), or does not
        hold those bytes. ``pause()`` runs between pieces of a raw chunk (it may block); False from it
        abandons the read (False)."""
        n, csum = chunk.raw_len, chunk.checksum
        try:
            fd, st = open_chunk(self.repo.blob_path(chunk.id))
        except (OSError, CorruptionError):
            return False  # evicted meanwhile, or not a regular file
        try:
            head = parse_header(os.pread(fd, HEADER_SIZE, 0))
            if not header_matches(head, n, csum, st.st_size):
                return False
            out = out[:n]
            if head.codec != CODEC_RAW:  # compressed: decoded whole (rare; zstd is not the default)
                decode_fd(head, fd, out)
                return checksum(out) == csum
            h = checksum_stream()
            for off in range(0, n, _PIECE):
                if off and pause is not None and not pause():
                    return False
                piece = out[off:off + _PIECE]
                read_exact(fd, piece, HEADER_SIZE + off)
                h.update(piece)
            return h.digest() == csum
        except (OSError, CorruptionError):
            return False
        finally:
            os.close(fd)

    def delete(self, cids: Iterable[bytes]) -> int:
        """Remove the files of ``cids`` whose catalog rows are gone (rows first, files after:
        :meth:`Repo.sweep`, the one way files leave a store); the bytes freed."""
        return self.repo.sweep(cids)

    def measure(self) -> int:
        """The bytes of chunk files the catalog holds (stored, after compression: what the disk budget counts)."""
        return self.repo.db.read(lambda t: t.stored_bytes())
