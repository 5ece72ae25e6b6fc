"""Check a chunk object from the bucket as its bytes arrive, before anything relies on it.

Every chunk read from the shared tier is checked against its manifest entry: object size, header
(``raw_len``, checksum), XXH3-128 of the raw bytes and, when it is to become a local chunk file
(content addressing: a later save deduplicates against it), the keyed BLAKE3 address too. One
class for the fetch into the local tier and for the streaming restore, so both check alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import blake3

from snapstore._errors import CorruptChunkError, CorruptionError
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    ChunkHeader,
    checksum_stream,
    chunk_id,
    decode_payload,
    header_matches,
    parse_header,
)
from snapstore.remote.manifest import ChunkEntry

__all__ = ["BadObject", "ChunkCheck", "corrupt"]


class BadObject(Exception):
    """A chunk object failed a check; ``why`` says which (the caller counts it and raises :func:`corrupt`)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def corrupt(e: ChunkEntry, why: str, count: Callable[[str, int], None], touched: bool = False) -> CorruptChunkError:
    """Count a corrupt chunk object; the error a restore raises for it."""
    count("remote_corrupt_chunks", 1)
    outcome = ("the destination was partly written: re-read the prompt" if touched
               else "it was not used and nothing was written")
    return CorruptChunkError(f"chunk {e.id.hex()} in the shared tier is corrupt ({why}); {outcome} "
                             "(`snapstore verify --remote --deep`)", touched=touched)


class ChunkCheck:
    """Feed the object's pieces in order, then :meth:`finish`; every failure raises :class:`BadObject`.

    ``address_keys``: (v2 scope key, v1 scope key) to check the BLAKE3 address with, or None to
    check only size, header and XXH3-128 (a streamed restore: nothing is published under the id).
    """

    def __init__(self, e: ChunkEntry, address_keys: tuple[bytes, bytes] | None, size: int):
        self.e = e
        self._keys = address_keys
        if size != e.stored_len:
            self.fail(f"object is {size} bytes, the manifest says {e.stored_len}")
        self.head: ChunkHeader | None = None
        self.scope_key = address_keys[0] if address_keys is not None else b""
        self._head_buf = bytearray()
        self._payload: bytearray | None = None  # a compressed payload, decoded at the end
        self._seen = 0
        self._sum = checksum_stream()
        self._id = blake3.blake3(key=address_keys[0], max_threads=1) if address_keys is not None else None

    def fail(self, why: str) -> NoReturn:
        """Raise for this chunk."""
        raise BadObject(why)

    def feed(self, piece: memoryview) -> memoryview | None:
        """Check one piece; the raw bytes it carries (its part after the header, raw codec) or None."""
        self._seen += len(piece)
        if self._seen > self.e.stored_len:
            self.fail("object is longer than the manifest says")
        if self.head is None:
            need = HEADER_SIZE - len(self._head_buf)
            self._head_buf += piece[:need]
            piece = piece[need:]
            if len(self._head_buf) < HEADER_SIZE:
                return None
            try:
                self.head = parse_header(bytes(self._head_buf))
            except CorruptionError as err:
                self.fail(str(err))
            if not header_matches(self.head, self.e.raw_len, self.e.checksum):
                self.fail("header does not match the manifest")
            if self.e.stored_len != HEADER_SIZE + self.head.payload_len or (
                    self.head.codec == CODEC_RAW and self.head.payload_len != self.head.raw_len):
                self.fail("its size does not match its header")  # so no piece can overrun its place
            if self.head.codec != CODEC_RAW:
                self._payload = bytearray()
        if self._payload is not None:
            self._payload += piece
            return None
        self._sum.update(piece)
        if self._id is not None:
            self._id.update(piece)
        return piece

    def finish(self, raw_again: Callable[[], bytes | memoryview] | None = None) -> memoryview | None:
        """After the last piece: length, checksum, address. Returns the decoded raw bytes of a
        compressed chunk (None for a raw one, whose bytes :meth:`feed` handed out).

        ``raw_again``: the raw bytes once more (from where the caller put them), needed only when
        the address is not the v2 one and the v1 address must be tried.
        """
        if self.head is None or self._seen != self.e.stored_len:
            self.fail("object is shorter than the manifest says")
        raw: memoryview | None = None
        if self._payload is not None:
            raw = memoryview(bytearray(self.head.raw_len))
            try:
                decode_payload(self.head, memoryview(self._payload), raw)
            except CorruptionError as err:
                self.fail(str(err))
            self._sum.update(raw)
            if self._id is not None:
                self._id.update(raw)
        if self._sum.digest() != self.e.checksum:
            self.fail("content does not match its checksum")
        if self._id is not None and self._keys is not None and self._id.digest() != self.e.id:
            # not the v2 address: a chunk written before v2 has the identity's v1 one
            again = raw if raw is not None else (raw_again() if raw_again is not None else None)
            if again is None or chunk_id(again, self._keys[1]) != self.e.id:
                self.fail("content does not match its address")
            self.scope_key = self._keys[1]
        return raw
