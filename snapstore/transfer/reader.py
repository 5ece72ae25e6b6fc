"""Reading an export file in order (:mod:`snapstore.transfer.format` is the layout): the header at once,
then each chunk frame in pieces, then the trailer, every checksum checked as it is reached.

Kept apart from the format's packing and parsing so that the one streaming reader (bounded memory:
the header and one piece at a time) is the only place that walks a file; the importer uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import blake3

from snapstore._errors import ExportFileError
from snapstore.transfer.format import (
    _END,
    _FRAME,
    END_MAGIC,
    FLAG_MARKED,
    FRAME_HEAD,
    FRAME_MAGIC,
    FRAME_TAIL,
    PIECE,
    PREAMBLE,
    TRAILER,
    ChunkEntry,
    decode_header,
    parse_preamble,
)

__all__ = ["ExportReader"]


class ExportReader:
    """Reads an export file in order, checking as it goes: :attr:`header` at once, then
    :meth:`frames` (each frame's bytes in pieces, its checksum checked once they are read), then
    :meth:`finish` (the trailer, the whole-file checksum, the end of the file). Holds the header
    and one piece at a time."""

    def __init__(self, f: BinaryIO, path: str = "the export file") -> None:
        self._f = f
        self.path = path
        self._whole = blake3.blake3()
        pre = parse_preamble(self._read(PREAMBLE, "the preamble"))
        data = self._read(pre.header_len, "the header")
        if blake3.blake3(data).digest() != pre.header_digest:
            raise ExportFileError("the header is altered (its BLAKE3 does not match the preamble's)")
        self.header = decode_header(data)
        if bool(pre.flags & FLAG_MARKED) != (self.header.imported_from is not None):
            raise ExportFileError("the preamble's flags and the header disagree on whether the state was imported "
                                  "under an identity override")

    def _read(self, n: int, what: str) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise ExportFileError(f"truncated: {what} has {len(data)} of {n} bytes")
        self._whole.update(data)
        return data

    def frames(self) -> Iterator[tuple[int, ChunkEntry, Iterator[memoryview]]]:
        """``(index, entry, pieces)`` per frame in table order; ``pieces`` yields the chunk file's
        bytes. The frame's checksum is checked when the next frame is asked for (or at :meth:`finish`):
        the caller consumes ``pieces`` and writes nothing it cannot take back before that."""
        for i, e in enumerate(self.header.chunks):
            head = self._read(FRAME_HEAD, f"chunk frame {i}'s head")
            magic, idx = _FRAME.unpack(head)
            if magic != FRAME_MAGIC or idx != i:
                raise ExportFileError(f"chunk frame {i}'s head is altered (magic or index {idx} wrong)")
            h = blake3.blake3(head)
            pieces = self._pieces(i, e.stored_len, h)
            yield i, e, pieces
            for _rest in pieces:  # what the caller left unread still counts toward the checksums
                pass
            tail = self._read(FRAME_TAIL, f"chunk frame {i}'s checksum")
            if h.digest() != tail:
                raise ExportFileError(f"chunk frame {i} is altered (its BLAKE3 does not match)")

    def _pieces(self, i: int, n: int, h: blake3.blake3) -> Iterator[memoryview]:
        left = n
        while left:
            piece = self._read(min(PIECE, left), f"chunk frame {i}")  # ExportFileError when cut short
            h.update(piece)
            left -= len(piece)
            yield memoryview(piece)

    def finish(self) -> None:
        """The trailer: frame count, the whole file's BLAKE3, and nothing after it."""
        digest = self._whole.digest()  # of every byte before the trailer
        data = self._f.read(TRAILER)
        if len(data) != TRAILER:
            raise ExportFileError(f"truncated: the trailer has {len(data)} of {TRAILER} bytes")
        magic, frames, whole = _END.unpack(data)
        if magic != END_MAGIC:
            raise ExportFileError("the trailer is altered (its magic is wrong), or frames are missing")
        if frames != len(self.header.chunks):
            raise ExportFileError(f"the trailer counts {frames} frames, the header {len(self.header.chunks)}")
        if whole != digest:
            raise ExportFileError("the file is altered (the trailer's BLAKE3 of the whole file does not match)")
        if self._f.read(1):
            raise ExportFileError("the file has bytes after its trailer")
