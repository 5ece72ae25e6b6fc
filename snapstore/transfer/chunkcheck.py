"""Check one chunk file's bytes, piece by piece, against what an export file's chunk table says.

The bytes are a chunk file exactly as a store keeps it (docs/format.md "Chunk files"): its header
must parse and agree with the table entry (raw length, codec, XXH3-128), its size must be header
plus payload, and the raw bytes (decoded, for a compressed chunk) must hash to the checksum. The
check also computes the chunk's content address under a given scope key (keyed BLAKE3-256 of the
raw bytes): the exporter checks it against the address the chunk has in its store; an importer
uses it as the chunk's address in the importing store (another identity gives another address).

A compressed chunk's payload is held until its end (at most one chunk: chunks are bounded by the
store's chunk size); a raw chunk is checked piece by piece.
"""

from __future__ import annotations

import blake3

from snapstore._errors import CorruptionError
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    ChunkHeader,
    checksum_stream,
    decode_payload,
    header_matches,
    parse_header,
)

__all__ = ["BadChunk", "ChunkVerify"]


class BadChunk(Exception):
    """The bytes fail a check; ``str()`` says which (the caller names the chunk and the file)."""


class ChunkVerify:
    """Feed a chunk file's bytes in order with :meth:`feed`, then :meth:`finish` for its address."""

    def __init__(self, raw_len: int, stored_len: int, codec: int, checksum: bytes, key: bytes) -> None:
        self._want = (raw_len, stored_len, codec, checksum)
        self._head = bytearray()
        self.head: ChunkHeader | None = None
        self._payload: bytearray | None = None
        self._seen = 0
        self._sum = checksum_stream()
        self._id = blake3.blake3(key=key)

    def feed(self, piece: memoryview) -> None:
        raw_len, stored_len, codec, csum = self._want
        self._seen += len(piece)
        if self._seen > stored_len:
            raise BadChunk(f"longer than its {stored_len} bytes")
        if self.head is None:
            need = HEADER_SIZE - len(self._head)
            self._head += piece[:need]
            piece = piece[need:]
            if len(self._head) < HEADER_SIZE:
                return
            try:
                self.head = parse_header(bytes(self._head))
            except CorruptionError as e:
                raise BadChunk(f"its chunk header does not parse ({e})") from None
            if not header_matches(self.head, raw_len, csum) or self.head.codec != codec:
                raise BadChunk("its chunk header does not match the chunk table")
            if stored_len != HEADER_SIZE + self.head.payload_len:
                raise BadChunk("its size does not match its chunk header")
            if self.head.codec != CODEC_RAW:
                self._payload = bytearray()
        if self._payload is not None:
            self._payload += piece
            return
        self._sum.update(piece)
        self._id.update(piece)

    def finish(self) -> bytes:
        """Length and checksum checked; the address of the raw bytes under the scope key."""
        if self.head is None or self._seen != self._want[1]:
            raise BadChunk(f"shorter than its {self._want[1]} bytes")
        if self._payload is not None:
            raw = memoryview(bytearray(self.head.raw_len))
            try:
                decode_payload(self.head, memoryview(self._payload), raw)
            except CorruptionError as e:
                raise BadChunk(str(e)) from None
            self._payload = None
            self._sum.update(raw)
            self._id.update(raw)
        if self._sum.digest() != self._want[3]:
            raise BadChunk("its content does not match its XXH3-128 checksum")
        return self._id.digest()
