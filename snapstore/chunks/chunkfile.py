"""Chunk files: a fixed 64-byte self-describing header, then the (optionally compressed) payload.

See docs/format.md. The chunk id is the BLAKE3-256 of the *raw* bytes, so changing the codec
never changes ids; the header carries an XXH3-128 of the raw bytes (fast enough to check on
every restore) and an XXH3-64 of itself.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import blake3
import numpy as np
import xxhash
import zstandard

from snapstore._errors import CorruptionError

__all__ = [
    "CODECS",
    "CODEC_RAW",
    "CODEC_ZSTD",
    "CODEC_ZSTD_SHUFFLE2",
    "HEADER_SIZE",
    "ChunkHeader",
    "chunk_id",
    "scope_key",
    "checksum",
    "checksum_stream",
    "chunk_damage",
    "compress_stream",
    "decode_fd",
    "decode_payload",
    "encode_payload",
    "header_at",
    "header_matches",
    "is_hex_id",
    "open_chunk",
    "parse_header",
    "recheck",
]

MAGIC = b"SNAPCHK\x00"
FORMAT_VERSION = 1
HEADER_SIZE = 64
CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2 = 0, 1, 2
CODECS = {"raw": CODEC_RAW, "zstd": CODEC_ZSTD, "zstd-shuffle2": CODEC_ZSTD_SHUFFLE2}
CODEC_NAMES = {v: k for k, v in CODECS.items()}
MAX_RAW = 1 << 32  # no chunk is larger than 4 GiB; a header claiming more is corrupt
_HEAD = struct.Struct("<8sHBBIQQ16s")  # magic, version, codec, flags, header size, raw, payload, xxh3-128
_HEX = frozenset("0123456789abcdef")


def scope_key(identity_key: str, namespace: str, dtype: str | None = None,
              shape: Sequence[int] | None = None) -> bytes:
    """The 32-byte BLAKE3 key of one identity + namespace (+ a part's dtype and shape): chunk ids
    never collide across scopes, so no dedup (and no timing signal from dedup) crosses an identity,
    a tenant, or a part layout. Without dtype/shape: the v1 scope of stores written before v2."""
    if dtype is None:
        return blake3.blake3(f"snapstore scope v1\0{identity_key}\0{namespace}".encode()).digest()
    dims = json.dumps([int(d) for d in (shape or ())])
    return blake3.blake3(f"snapstore scope v2\0{identity_key}\0{namespace}\0{dtype}\0{dims}".encode()).digest()


def chunk_id(raw: bytes | memoryview, key: bytes) -> bytes:
    """Content address of raw bytes: keyed BLAKE3-256 (the key is the scope's)."""
    return blake3.blake3(raw, key=key).digest()


def checksum(raw: bytes | memoryview) -> bytes:
    """XXH3-128 of raw bytes (big-endian digest), checked on every restore."""
    return xxhash.xxh3_128_digest(raw)


_COPY_PIECE = 256 << 10  # a piece stays in the L2 cache between its copy and its two hashes


def copy_addressed(src: memoryview, out: memoryview, key: bytes) -> tuple[bytes, bytes]:
    """Copy ``src`` into ``out`` and return the copy's (:func:`chunk_id`, :func:`checksum`).

    One pass over memory instead of three: each piece is hashed from the copy while it is still in
    cache (~25% less CPU per chunk than a copy and two whole-buffer hashes, measured on this VM).
    The hashes read ``out``, never ``src``: a source changed meanwhile spoils only this copy."""
    assert len(src) == len(out)
    a_src, a_out = np.frombuffer(src, dtype=np.uint8), np.frombuffer(out, dtype=np.uint8)
    address, csum = blake3.blake3(key=key), xxhash.xxh3_128()
    for o in range(0, len(out), _COPY_PIECE):
        np.copyto(a_out[o:o + _COPY_PIECE], a_src[o:o + _COPY_PIECE])  # numpy, blake3, xxhash: no GIL
        piece = out[o:o + _COPY_PIECE]
        address.update(piece)
        csum.update(piece)
    return address.digest(), csum.digest()


def checksum_stream() -> xxhash.xxh3_128:
    """An incremental :func:`checksum`: ``update()`` piece by piece, ``digest()`` at the end."""
    return xxhash.xxh3_128()


def is_hex_id(name: str) -> bool:
    """True for a 64-char lowercase hex string: the only names chunk paths are built from."""
    return len(name) == 64 and set(name) <= _HEX


@dataclass(frozen=True)
class ChunkHeader:
    """The parsed header of a chunk file."""

    codec: int
    raw_len: int
    payload_len: int
    checksum: bytes

    def pack(self) -> bytes:
        """Serialize to exactly HEADER_SIZE bytes."""
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, self.codec, 0, HEADER_SIZE, self.raw_len,
                          self.payload_len, self.checksum)
        return head + xxhash.xxh3_64_digest(head) + bytes(8)


def parse_header(data: bytes) -> ChunkHeader:
    """Parse and check a header; CorruptionError says what is wrong with it."""
    if len(data) < HEADER_SIZE:
        raise CorruptionError(f"chunk header truncated ({len(data)} of {HEADER_SIZE} bytes)")
    head = bytes(data[:48])
    magic, version, codec, flags, hsize, raw_len, payload_len, csum = _HEAD.unpack(head)
    if magic != MAGIC:
        raise CorruptionError("not a snapstore chunk file (bad magic)")
    if xxhash.xxh3_64_digest(head) != bytes(data[48:56]):
        raise CorruptionError("chunk header checksum mismatch")
    if bytes(data[56:64]) != bytes(8):
        raise CorruptionError("chunk header reserved bytes are not zero")
    if version != FORMAT_VERSION or hsize != HEADER_SIZE:
        raise CorruptionError(f"chunk format version {version} (header {hsize} bytes) is not supported")
    if codec not in CODEC_NAMES or flags != 0:
        raise CorruptionError(f"unknown chunk codec {codec} / flags {flags}")
    if raw_len > MAX_RAW or payload_len > MAX_RAW + 1024:
        raise CorruptionError(f"chunk claims {raw_len} raw / {payload_len} payload bytes (over the 4 GiB limit)")
    if codec == CODEC_RAW and payload_len != raw_len:
        raise CorruptionError("raw chunk whose payload length differs from its raw length")
    return ChunkHeader(codec, raw_len, payload_len, csum)


def _shuffle2(raw: memoryview) -> bytes:
    a = np.frombuffer(raw, dtype=np.uint8)
    even = len(a) & ~1
    return bytes(a[:even].reshape(-1, 2).T.tobytes() + a[even:].tobytes())


def _unshuffle2(data: bytes | memoryview, out: memoryview) -> None:
    a = np.frombuffer(data, dtype=np.uint8)
    even = len(a) & ~1
    dst = np.frombuffer(out, dtype=np.uint8)
    dst[:even].reshape(-1, 2)[:] = a[:even].reshape(2, -1).T
    dst[even:] = a[even:]




def encode_payload(raw: memoryview, codec: int) -> tuple[int, bytes | memoryview]:
    """Compress raw bytes with a codec; falls back to raw when compression does not pay."""
    if codec == CODEC_RAW:
        return CODEC_RAW, raw
    data = _shuffle2(raw) if codec == CODEC_ZSTD_SHUFFLE2 else raw
    packed = zstandard.ZstdCompressor(level=1).compress(data)
    if len(packed) >= len(raw):
        return CODEC_RAW, raw
    return codec, packed


def decode_payload(header: ChunkHeader, payload: bytes | memoryview, out: memoryview) -> None:
    """Decode a payload into ``out`` (exactly raw_len bytes); CorruptionError if it does not decode."""
    if len(out) != header.raw_len:
        raise CorruptionError("destination slice does not match the chunk's raw length")
    if header.codec == CODEC_RAW:
        if len(payload) != header.raw_len:
            raise CorruptionError("raw chunk payload has the wrong length")
        out[:] = payload
        return
    try:
        data = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_len)
    except zstandard.ZstdError as e:
        raise CorruptionError(f"chunk payload does not decompress: {e}") from None
    if len(data) != header.raw_len:
        raise CorruptionError("chunk payload decompresses to the wrong length")
    if header.codec == CODEC_ZSTD_SHUFFLE2:
        _unshuffle2(data, out)
    else:
        out[:] = data


def header_matches(head: ChunkHeader, raw_len: int, csum: bytes, file_size: int | None = None) -> bool:
    """The one header check: does ``head`` describe the chunk a catalog row (or a save's ref) names —
    its raw length and checksum and, given the file's size, a payload that fills the file exactly?"""
    return (head.raw_len == raw_len and head.checksum == csum
            and (file_size is None or file_size == HEADER_SIZE + head.payload_len))


def open_chunk(path: str) -> tuple[int, os.stat_result]:
    """Open the chunk file at ``path`` for reading: the one open of every chunk read (restore, RAM
    tier, header checks, verify, publish). Never through a symlink and never blocking: a FIFO,
    socket, device or directory at a chunk path is damage (CorruptionError), not a hang. Returns
    the descriptor (reads block as usual again) and its fstat; FileNotFoundError when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptionError("the chunk path is a symbolic link, not a regular file") from None
        if e.errno == errno.ENXIO:
            raise CorruptionError("the chunk path is a socket, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
                    stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(st.st_mode), "special")
            raise CorruptionError(f"the chunk path is {kind}, not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # a regular file: reads block as usual (O_NONBLOCK off)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def header_at(path: str) -> tuple[ChunkHeader, int]:
    """Parse the header of the chunk file at ``path`` (:func:`open_chunk`); (header, file size)."""
    fd, st = open_chunk(path)
    try:
        return parse_header(os.pread(fd, HEADER_SIZE, 0)), st.st_size
    finally:
        os.close(fd)


def recheck(fd: int, head: ChunkHeader) -> str | None:
    """Read the chunk open as ``fd`` (its header ``head`` already checked) again into private memory
    and check it: None when its bytes match the header's checksum, else what is wrong. Raw chunks
    are checked piece by piece; OSError propagates (a failed read confirms nothing)."""
    try:
        if head.codec != CODEC_RAW:  # compressed: decoded whole (rare; zstd is not the default)
            out = np.empty(head.raw_len, dtype=np.uint8).data
            decode_fd(head, fd, out)
            return None if checksum(out) == head.checksum else "checksum mismatch"
        h = checksum_stream()
        buf = memoryview(bytearray(max(1, min(head.raw_len, _PIECE))))
        for off in range(0, head.raw_len, len(buf)):
            piece = buf[:min(len(buf), head.raw_len - off)]
            read_exact(fd, piece, HEADER_SIZE + off)
            h.update(piece)
        return None if h.digest() == head.checksum else "checksum mismatch"
    except CorruptionError as e:
        return str(e)


def chunk_damage(path: str, raw_len: int, csum: bytes) -> str | None:
    """What is wrong with the chunk file at ``path`` *now*, against its catalog row (``raw_len``
    bytes, checksum ``csum``): missing, not a regular file, a header that disagrees, bytes that fail
    their checksum; None when it is intact. OSError when it cannot be read (nothing confirmed)."""
    try:
        fd, st = open_chunk(path)
    except FileNotFoundError:
        return "missing chunk file"
    except CorruptionError as e:
        return str(e)
    try:
        head = parse_header(os.pread(fd, HEADER_SIZE, 0))
        if not header_matches(head, raw_len, csum, st.st_size):
            return "header disagrees with the catalog"
        return recheck(fd, head)
    except CorruptionError as e:
        return str(e)
    finally:
        os.close(fd)


def read_exact(fd: int, out: memoryview | list[memoryview], offset: int) -> None:
    """pread until ``out`` is full — one view, or several filled in order (one vectored preadv for
    scattered paged blocks); CorruptionError on a short file."""
    if isinstance(out, memoryview):  # the common case: a cached chunk, whole in the first call
        n = os.preadv(fd, [out], offset) if len(out) else 0
        if n == len(out):
            return
        bufs, offset = [out[n:]], offset + n  # a short read: the rest below (0 again: truncated)
    else:
        bufs = [b for b in out if len(b)]  # nothing to read: done
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise CorruptionError("chunk file is shorter than its header says (truncated)")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


# -- streaming codecs: constant memory beside the chunk itself ----------------------------------
# Save compresses a chunk in pieces of _PIECE raw bytes straight into its temp file, and restore
# decodes a payload straight from its file into the destination slice, so neither holds a second
# chunk-sized buffer (the one-shot encode_payload/decode_payload above hold 2-3: the shuffled copy,
# the compressed or decompressed bytes, the payload read into memory).
_PIECE = 1 << 20


def _shuffled_pieces(raw: memoryview) -> Iterator[memoryview]:
    """The bytes of shuffle2(raw), a reused piece buffer at a time (even bytes, odd bytes, tail)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    even = len(a) & ~1
    half = even // 2
    buf = np.empty(min(_PIECE, max(half, 1)), dtype=np.uint8)
    for first in (0, 1):
        for s in range(0, half, len(buf)):
            k = min(len(buf), half - s)
            buf[:k] = a[first + 2 * s:first + 2 * (s + k):2]
            yield buf.data[:k]
    if even < len(a):
        yield raw[even:]


def compress_stream(raw: memoryview, codec: int) -> Iterator[tuple[int, bytes]]:
    """zstd-compress raw bytes (shuffle2 first for that codec) in constant memory.

    Yields (raw bytes consumed so far, output piece); every piece is block-flushed, so the output
    so far can be compared with the input so far (the caller stops once compression does not pay).
    """
    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=len(raw))
    pieces: Iterator[memoryview]
    if codec == CODEC_ZSTD_SHUFFLE2:
        pieces = _shuffled_pieces(raw)
    else:
        pieces = (raw[s:s + _PIECE] for s in range(0, len(raw), _PIECE))
    done = 0
    for piece in pieces:
        done += len(piece)
        out = cobj.compress(piece)
        # the last piece ends the frame in its own last block (no empty trailing block whose damage
        # would go unnoticed); the others are block-flushed so output so far tracks input so far
        yield done, out + (cobj.flush() if done == len(raw) else cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    if done < len(raw) or not raw:
        yield len(raw), cobj.flush()


class _PayloadReader:
    """A file-like view of ``length`` bytes of ``fd`` from ``offset`` (pread: no shared file offset)."""

    def __init__(self, fd: int, offset: int, length: int):
        self._fd, self._off, self._left = fd, offset, length

    def read(self, n: int = -1) -> bytes:
        n = self._left if n < 0 else min(n, self._left)
        if n <= 0:
            return b""
        data = os.pread(self._fd, n, self._off)
        if not data:
            raise CorruptionError("chunk file is shorter than its header says (truncated)")
        self._off += len(data)
        self._left -= len(data)
        return data


def _fill(reader: zstandard.ZstdDecompressionReader, out: memoryview) -> None:
    while out:
        n = reader.readinto(out)
        if n == 0:
            raise CorruptionError("chunk payload decompresses to fewer bytes than its raw length")
        out = out[n:]


def decode_fd(header: ChunkHeader, fd: int, out: memoryview) -> None:
    """Decode the payload of the chunk file open as ``fd`` into ``out`` (exactly raw_len bytes),
    reading and decompressing piece by piece; CorruptionError if it does not decode."""
    if len(out) != header.raw_len:
        raise CorruptionError("destination slice does not match the chunk's raw length")
    if header.codec == CODEC_RAW:
        read_exact(fd, out, HEADER_SIZE)
        return
    src = _PayloadReader(fd, HEADER_SIZE, header.payload_len)
    try:
        with zstandard.ZstdDecompressor().stream_reader(src, read_size=_PIECE, read_across_frames=False,  # type: ignore[arg-type]
                                                        closefd=False) as reader:
            if header.codec == CODEC_ZSTD_SHUFFLE2:
                _unshuffle_from(reader, out)
            else:
                _fill(reader, out)
            if reader.read(1):
                raise CorruptionError("chunk payload decompresses to more bytes than its raw length")
    except zstandard.ZstdError as e:
        raise CorruptionError(f"chunk payload does not decompress: {e}") from None


def _unshuffle_from(reader: zstandard.ZstdDecompressionReader, out: memoryview) -> None:
    """Read shuffle2(raw) from ``reader`` a piece at a time and scatter it back into ``out``."""
    dst = np.frombuffer(out, dtype=np.uint8)
    n = len(dst)
    even = n & ~1
    half = even // 2
    buf = np.empty(min(_PIECE, max(n, 1)), dtype=np.uint8)
    pos = 0
    while pos < n:
        k = min(len(buf), n - pos)
        _fill(reader, buf.data[:k])
        end = pos + k
        for lo, hi, base, step, first in ((0, half, 0, 2, 0), (half, even, half, 2, 1), (even, n, even, 1, 0)):
            a, b = max(pos, lo), min(end, hi)
            if a < b:
                if step == 2:
                    dst[first + 2 * (a - base):first + 2 * (b - base):2] = buf[a - pos:b - pos]
                else:
                    dst[a:b] = buf[a - pos:b - pos]
        pos = end
