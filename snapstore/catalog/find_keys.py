"""Find keys: the cheap integer match() finds its candidates by (schema v8, ``snapshots.find_key``).

``find_keys(tokens)[b]`` names the first ``b`` blocks of ``tokens`` (``BLOCK`` tokens each): key 0
is ``FIND_SEED``; key ``b + 1`` is XXH3-64 of block ``b`` (its tokens as uint64 LE, 2 KiB) seeded
with key ``b``. A snapshot of ``n`` tokens stores key ``n // BLOCK``, as SQLite's signed 64-bit
integer. One XXH3 call a block (~0.3 us) against the BLAKE3 anchor chain's ~2 us, which stays
for what must not collide: prefix keys, saves' parent checks and the shared tier's manifest names.

Nothing trusts a find key: 64 bits of a non-cryptographic hash can collide, by chance or on
purpose. match() compares every candidate it finds token by token and checks that the key
matched at the candidate's own block, so a collision costs one candidate read, never a wrong match.
The chain is resumable (key ``b + 1`` needs only key ``b`` and block ``b``): a new snapshot's key
is derived from its parent's key and the blocks its own tokens complete (:func:`extend`).
"""

from __future__ import annotations

import numpy as np
import xxhash

from snapstore._tokens import BLOCK

__all__ = ["FIND_SEED", "extend", "find_keys", "signed", "stored_key"]

FIND_SEED = 0x736E617073746F72  # b"snapstor": the key of the empty prefix (unsigned)


def signed(key: int) -> int:
    """An unsigned 64-bit key as SQLite stores it (two's complement)."""
    return key - (1 << 64) if key >= 1 << 63 else key


def _chained(key: int, tokens: np.ndarray) -> list[int]:
    """The keys after each whole block of ``tokens`` from unsigned ``key`` (``key`` first).

    One XXH3 call per block row of a 2-D view, the seed passed by position: the loop is the cost
    (~0.3 us a call against ~0.02 us of hashing), and slicing a memoryview per block with a keyword
    seed cost ~25% more (docs/benchmarks.md, "match() fifth pass")."""
    whole = len(tokens) // BLOCK
    blocks = np.ascontiguousarray(tokens[:whole * BLOCK], dtype="<u8").reshape(whole, BLOCK)
    f = xxhash.xxh3_64_intdigest
    out = [key]
    append = out.append
    for block in blocks:
        key = f(block, key)  # type: ignore[arg-type]  # an ndarray row is a buffer; .data would cost ~60%
        append(key)
    return out


def extend(key: int, tokens: np.ndarray) -> int:
    """The key after the whole blocks of ``tokens`` (which start at a block boundary), from ``key``
    (signed or not); a trailing partial block is ignored. Returned signed."""
    return signed(_chained(key & 0xFFFFFFFFFFFFFFFF, tokens)[-1])


def find_keys(tokens: np.ndarray) -> np.ndarray:
    """Keys ``0 .. len(tokens) // BLOCK`` of a prompt (int64, signed as stored): what match() looks up."""
    return np.array(_chained(FIND_SEED, tokens), dtype=np.uint64).view(np.int64)


def stored_key(keys: np.ndarray, n: int) -> int:
    """The find key a snapshot of ``n`` tokens stores, from its tokens' :func:`find_keys` (key ``n // BLOCK``):
    what a save, an import and a shared-tier fetch hand ``insert_snapshot`` (``find_key=``)."""
    return int(keys[n // BLOCK])
