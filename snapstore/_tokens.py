"""Token sequences: validation, compact storage, the chained block hashes of saves, and the
exact token check behind match().

A prompt is cut into blocks of ``BLOCK`` tokens. ``chain[i]`` hashes blocks 0..i-1 (so
``chain[0]`` is the hash of the empty prefix). A snapshot of ``n`` tokens records its *anchor*
``chain[n // BLOCK]``; its *prefix key* hashes the anchor and the < BLOCK tokens after it, so it
names the exact sequence (saves' parent checks, supersede, the shared tier's manifest names).
match() finds candidates by the cheaper find keys (:mod:`snapstore.catalog.find_keys`) and decides by comparing
tokens (:func:`spells_prefix`); it computes no BLAKE3 chain.

The chain costs ~2 us per block (BLAKE3 of 2 KiB; ~1 ms for a 128K-token prompt), and an engine
saves the same prompt again and again (each turn's save extends the last). So the chains of the
last few sequences are kept (their own copy of the tokens, never the caller's buffer): a new
sequence reuses the chain of the longest common prefix of a cached one with the same first block
and hashes only the blocks after it.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import blake3
import numpy as np
import numpy.typing as npt

from snapstore._errors import CorruptionError, InvalidInputError
from snapstore._forks import ProcessLock

__all__ = ["BLOCK", "Encoded", "Segment", "TokenIndex", "TokensLike", "as_token_array", "decode_tokens",
           "encode_tokens", "Link", "spells_chain", "spells_prefix", "spells_segment"]

# What the public API takes as tokens: a one-dimensional sequence of non-negative ints below 2**63
# (a list, a tuple, a numpy integer array, or an object numpy.asarray makes one of, such as a CPU
# torch tensor). The shape, dtype and range are checked at run time (as_token_array).
TokensLike: TypeAlias = npt.ArrayLike

BLOCK = 256
_SEED = blake3.blake3(b"snapstore tokens v1").digest(16)
_MAX_TOKEN = 2**63 - 1


def as_token_array(tokens: Any, *, what: str = "tokens", borrow: bool = False) -> np.ndarray:
    """Validate a sequence of non-negative ints and return it as a little-endian uint64 array.

    ``borrow``: the caller reads the tokens only during its call (match()), so an int64 array is
    used in place, reinterpreted as uint64 once checked non-negative, not copied (a fresh copy of
    a 128K-token prompt costs more in page faults than the rest of a match)."""
    if tokens is None or isinstance(tokens, (str, bytes, bytearray, int, float, np.generic)):
        raise InvalidInputError(f"{what} must be a sequence of non-negative ints (a list, a tuple or a "
                                f"one-dimensional integer array), got {type(tokens).__name__} {tokens!r:.60}")
    try:
        arr = _from_int_list(tokens)
        if arr is None:
            arr = np.asarray(tokens)
        if arr.dtype.kind == "f" and not isinstance(tokens, np.ndarray):
            # Python ints numpy could not put in one integer dtype (one >= 2**63 beside a small one, or a
            # negative one) came out as float64: look at them as the ints they are
            arr = np.asarray(tokens, dtype=object)
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidInputError(f"{what} must be a sequence of non-negative ints: {e}") from None
    if arr.ndim != 1:
        raise InvalidInputError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u8")
    if arr.dtype == object:
        try:
            ok = all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr)
        except TypeError:
            ok = False
        if not ok:
            raise InvalidInputError(f"{what} must contain only ints")
        bad = next((i for i, t in enumerate(arr) if int(t) < 0 or int(t) > _MAX_TOKEN), None)
        if bad is not None:
            raise _out_of_range(what, arr, bad)
        return np.array([int(t) for t in arr], dtype="<u8")
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must contain ints, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise _out_of_range(what, arr, int(np.argmax(arr < 0)))
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _MAX_TOKEN:
        raise _out_of_range(what, arr, int(np.argmax(arr > _MAX_TOKEN)))
    if borrow and arr.dtype == np.dtype("<i8"):
        return arr.view("<u8")  # the same bytes: every token is non-negative (checked above)
    return arr.astype("<u8", copy=False)


def _from_int_list(tokens: Any) -> np.ndarray | None:
    """A list of Python ints as int64, packed by ``struct`` (about 35 us at 3,000 tokens, against
    85 us through ``array.array`` and 100-180 us through ``np.asarray``: an engine's scheduler passes
    its prompt as a list on every lookup); None for anything else — a list of bools, floats or ints
    past int64 — which numpy's path judges as before."""
    if type(tokens) is not list or not tokens or type(tokens[0]) is not int:
        return None
    try:
        return np.frombuffer(struct.pack(f"<{len(tokens)}q", *tokens), dtype="<i8")
    # struct.error: a float, a str, an int outside int64; what an element's own __index__ raises
    # (a 0-d bool array's TypeError) comes out as is: numpy judges all of those
    except (struct.error, TypeError, ValueError, OverflowError):
        return None


def _out_of_range(what: str, arr: np.ndarray, i: int) -> InvalidInputError:
    """The error for token ``i``, outside [0, 2**63): which one and its value."""
    return InvalidInputError(f"{what} must be ints in [0, 2**63); {what}[{i}] = {int(arr[i])} is out of range")


def encode_tokens(arr: np.ndarray) -> tuple[bytes, int]:
    """Compact storage of a token segment: int32 LE when every token fits, else int64 LE."""
    if arr.size == 0 or int(arr.max()) < 2**31:
        return arr.astype("<i4").tobytes(), 4
    return arr.astype("<i8").tobytes(), 8


def decode_tokens(blob: bytes, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`encode_tokens` for a stored blob; CorruptionError if it does not fit."""
    if width not in (4, 8) or not isinstance(blob, (bytes, memoryview)) or len(blob) != width * count:
        raise CorruptionError(f"stored token blob of {len(blob)} bytes does not hold {count} tokens of "
                              f"width {width}; run `snapstore verify`")
    arr = np.frombuffer(blob, dtype="<i4" if width == 4 else "<i8")
    if arr.size and int(arr.min()) < 0:
        raise CorruptionError("stored token blob holds negative tokens; run `snapstore verify`")
    return arr.astype("<u8")


_SCRATCH_MAX = 8 << 20  # bytes of encoded prompt a thread keeps between matches (2M tokens at int32)
_scratch = threading.local()  # w4 / w8: a buffer no live Encoded holds


class Encoded:
    """A prompt in each stored token width, encoded once however many candidates it is compared with.

    Encoded into a buffer the thread keeps between matches (up to ``_SCRATCH_MAX``): a fresh 512 KiB
    for a 128K-token prompt costs its page faults on every match, several times the encode itself
    on a loaded machine. An Encoded takes the buffer out while it lives (a second one meanwhile
    gets a new buffer: nothing can overwrite a prompt being compared) and gives it back when dropped."""

    __slots__ = ("_by_width", "_narrow", "arr")

    def __init__(self, arr: np.ndarray):
        self.arr = arr
        self._by_width: dict[int, bytearray] = {}
        self._narrow: int | None = None  # see narrow(): found once, however many candidates ask

    def width(self, width: int) -> bytearray:
        """The prompt as int32 or int64 LE bytes (valid tokens are < 2**63: the same numbers), possibly
        followed by stale bytes: compare only inside ``len(arr) * width``."""
        mine = self._by_width.get(width)
        if mine is None:
            need = len(self.arr) * width
            mine = _scratch.__dict__.pop(f"w{width}", None)
            if mine is None or len(mine) < need:
                mine = bytearray(need)
            view = np.frombuffer(mine, dtype="<i4" if width == 4 else "<i8", count=len(self.arr))
            np.copyto(view, self.arr, casting="unsafe")
            self._by_width[width] = mine
        return mine

    def narrow(self) -> int:
        """How many leading tokens of the prompt an int32 blob can hold: all, unless one is >= 2**31,
        which no int32 blob holds (the cast wraps it)."""
        if self._narrow is None:
            wide = bool(len(self.arr)) and int(self.arr.max()) >= 2**31
            self._narrow = int(np.argmax(self.arr >= 2**31)) if wide else len(self.arr)
        return self._narrow

    def fits(self, width: int, pos: int, n: int) -> bool:
        """Can a blob of ``width`` hold the prompt's tokens ``[pos, n)``?"""
        if width == 8 or n <= pos:
            return True
        return self.narrow() == len(self.arr) or int(self.arr[pos:n].max()) < 2**31

    def __del__(self) -> None:
        for width, buf in self._by_width.items():
            if len(buf) <= _SCRATCH_MAX:
                _scratch.__dict__.setdefault(f"w{width}", buf)


Segment: TypeAlias = tuple[bytes, int, int, int]  # a stored token segment: (blob, width, base_tokens, n_tokens)


def _malformed(nbytes: int, width: int, count: int) -> CorruptionError:
    return CorruptionError(f"stored token blob of {nbytes} bytes does not hold {count} tokens of width {width}; "
                           "run `snapstore verify`")


def _check_blob(blob: bytes, width: int, base: int, n: int) -> None:
    if width not in (4, 8) or not isinstance(blob, (bytes, memoryview)) or len(blob) != width * (n - base):
        raise _malformed(len(blob), width, n - base)


def spells_segment(seg: Segment, arr: np.ndarray, encoded: Encoded | None = None) -> bool:
    """Does one stored segment hold exactly ``arr[base:n]``? (A blob that cannot hold its tokens
    raises CorruptionError.) A root's segment (base 0) decides a match alone."""
    blob, width, base, n = seg
    _check_blob(blob, width, base, n)
    return _holds(encoded if encoded is not None and encoded.arr is arr else Encoded(arr), blob, width, base, n)


def _holds(enc: Encoded, blob: bytes, width: int, base: int, n: int) -> bool:
    """Does a blob of checked shape hold exactly the prompt's tokens ``[base, n)``? One memcmp."""
    if n > len(enc.arr) or n < base:
        return False
    return enc.fits(width, base, n) and enc.width(width).startswith(blob, base * width)


def spells_prefix(segments: Sequence[Segment], arr: np.ndarray, encoded: Encoded | None = None) -> bool:
    """Do stored token segments ``(blob, width, base_tokens, n_tokens)``, root first, spell exactly
    ``arr[:n]`` (``n`` the last segment's end)? match()'s final check of a candidate, token by token.

    The comparison of decoding every segment and comparing the concatenation, without the decodes
    or copies: the prompt is encoded once in the stored width (``encoded``, shared by a match's
    candidates) and each blob compared in place (``bytearray.startswith`` at its offset: one memcmp),
    the leaf's own segment first (a sibling or a find-key collision differs there, usually). A blob
    that cannot hold its tokens raises CorruptionError, as decoding it would.
    """
    if not segments or segments[-1][3] > len(arr):
        return False
    pos = 0
    for blob, width, base, n in segments:
        _check_blob(blob, width, base, n)
        if base != pos or n < pos:
            return False
        pos = n
    enc = encoded if encoded is not None and encoded.arr is arr else Encoded(arr)
    return all(spells_segment(seg, arr, enc) for seg in reversed(segments))


# A link of a candidate's chain as :meth:`snapstore.catalog.queries.Txn.chain_links` streams it: (level, width,
# base_tokens, n_tokens, blob bytes, same: compared in SQL, or None where blob is given for the
# caller to compare, blob or None).
Link: TypeAlias = tuple[int, int, int, int, int, bool | None, Any]


def spells_chain(own: Segment, links: Iterable[Link], arr: np.ndarray, encoded: Encoded | None = None) -> bool:
    """Does a candidate spell exactly ``arr[:n]``, given its own segment ``own`` (``n`` its end,
    already found to hold ``arr[base:n]`` by :func:`spells_segment`) and its ancestors' links as
    :meth:`snapstore.catalog.queries.Txn.chain_links` streams them, parent (level 1) first? The answer of
    :func:`spells_prefix` on the whole chain, each link checked as it arrives, none held.

    A link compared in SQL counts only where the prompt's tokens fit its width (an int32 compare of
    a token >= 2**31 would see it wrapped). After the first mismatching link none is compared, but
    every link's shape is still checked: a blob that cannot hold its tokens anywhere in the chain
    raises CorruptionError, as the whole-chain check does. (A mismatch below the own segment is
    rare: the find key and the own tokens matched.)"""
    enc = encoded if encoded is not None and encoded.arr is arr else Encoded(arr)
    pos, want, ok = own[2], 1, True
    for lvl, width, base, n, nbytes, same, blob in links:
        if same is None:
            _check_blob(blob, width, base, n)
        elif width not in (4, 8) or nbytes != width * (n - base):
            raise _malformed(nbytes, width, n - base)
        if ok:  # each link ends where the one above it starts, down to token 0
            ok = lvl == want and n == pos and base <= n and (
                _holds(enc, blob, width, base, n) if same is None else same and enc.fits(width, base, n))
            pos, want = base, want + 1
    return ok and pos == 0


_CACHE_ENTRIES = 8  # sequences whose chains are kept (a 128K-token one: 1 MiB of tokens + 8 KiB)
_cache: OrderedDict[bytes, tuple[np.ndarray, list[bytes]]] = OrderedDict()  # first block -> (tokens, chain)
_cache_lock = ProcessLock()  # fresh in a forked child (._forks)


def _reusable(tokens: np.ndarray) -> tuple[bytes, list[bytes]]:
    """(cache key, the cached chain prefix that holds for ``tokens``: at least [_SEED])."""
    key = tokens[:BLOCK].tobytes()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
    if hit is None or len(tokens) < BLOCK:
        return key, [_SEED]
    cached, chain = hit
    m = min(len(cached), len(tokens)) // BLOCK * BLOCK
    diff = np.flatnonzero(cached[:m] != tokens[:m])
    same = int(diff[0]) if diff.size else m
    return key, chain[:same // BLOCK + 1]


def _chain_of(tokens: np.ndarray) -> list[bytes]:
    """The chain of ``tokens`` (a fresh list), reusing and refreshing the cache."""
    key, chain = _reusable(tokens)
    raw = np.ascontiguousarray(tokens, dtype="<u8").data.cast("B")
    step = BLOCK * 8
    h = chain[-1]
    reused = len(chain)
    for off in range((len(chain) - 1) * step, (len(tokens) // BLOCK) * step, step):
        h = blake3.blake3(h + raw[off:off + step]).digest(16)
        chain.append(h)
    if len(tokens) >= BLOCK and len(chain) > reused:  # a prefix of the cached one: keep the longer
        own = np.array(tokens[:len(chain[1:]) * BLOCK], dtype="<u8")  # a copy: the caller may reuse its buffer
        with _cache_lock:
            _cache[key] = (own, chain)
            _cache.move_to_end(key)
            while len(_cache) > _CACHE_ENTRIES:
                _cache.popitem(last=False)
    return chain


class TokenIndex:
    """Chained block hashes of one token sequence, computed once per save or match."""

    __slots__ = ("chain", "tokens")

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens
        self.chain = list(_chain_of(np.asarray(tokens, dtype="<u8")))

    def anchor(self, n: int) -> bytes:
        """The anchor of the prefix of length ``n``."""
        return self.chain[n // BLOCK]

    def prefix_key(self, n: int) -> bytes:
        """A hash naming exactly ``tokens[:n]``."""
        start = (n // BLOCK) * BLOCK
        tail = np.ascontiguousarray(self.tokens[start:n], dtype="<u8").tobytes()
        return blake3.blake3(self.chain[n // BLOCK] + tail + n.to_bytes(8, "little")).digest(16)

    def __len__(self) -> int:
        return len(self.tokens)

