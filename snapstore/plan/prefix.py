"""Prefixes at block granularity: match any common prefix of a prompt with a stored snapshot.

A paged serving engine (vLLM) reuses any block-aligned prefix of what it has computed, not only
the lengths that were saved: a prompt C that shares 5 blocks with a stored 9-block prompt A can
take those 5 blocks of A. That is sound only for layouts whose every part is a row stream —
rows below a point never change after it (invariant 2), so rows ``[0, k)`` of A *are* the state
after A's first ``k`` rows — and never for fixed parts (a recurrent state is valid only at the
exact point it was captured). So it is opt-in per layout: ``Layout(rows=..., tokens_per_row=g)``
declares one row per ``g`` tokens in every stream and no fixed parts.

The index (table ``row_prefixes``, migration 0005): a save records, for each multiple ``n`` of the
layout's *step* among the rows it adds, a key naming the snapshot's tokens ``[0, n)`` exactly —
a chain of BLAKE3 hashes over steps, seeded with the step. Presence is monotone in ``n`` (a
snapshot's ancestors index the rows below its own, and cannot be evicted while it lives), so
``match()`` finds the longest indexed prefix of a prompt by binary search: a handful of index
probes, no scan. The found snapshot's tokens are then compared exactly (no hash is trusted), its
chain is checked for quarantined chunks, and the match names it with ``n_tokens = k``, shorter
than the snapshot. A restore of such a match writes rows ``[0, k // g)`` only (:func:`rows_limit`,
:class:`ClippedSink`).

Granularity (migration 0007): every row segment a save writes records the tokens per row of its
layout (``parts.tokens_per_row``; 1 without ``tokens_per_row``), and the one rule
:func:`granularity_fits` refuses a segment of another granularity wherever a saved part meets the
reading layout — a restore plan (DestinationError, before a byte is written) and a save's parent.
The dtype and row shape need not say the block size, so without it a store of the same identity at
8 tokens per row would read rows saved at 16 as its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import blake3
import numpy as np

from snapstore._errors import InvalidInputError
from snapstore._layout import Layout
from snapstore.catalog.queries import PartRow, SnapRow, Txn
from snapstore.parts.buffers import Sink

__all__ = ["ClippedSink", "ContentSegment", "PrefixHit", "content_key_of", "content_tag", "find_prefix", "granularity",
           "granularity_fits", "index_keys",
           "prefix_chain", "prefix_step", "record_prefixes", "rows_bound", "rows_limit"]

_MIN_STEP = 16  # tokens: finer steps would index a 128K-token prompt under >8K keys
_HOLDERS = 8  # snapshots tried at the longest indexed prefix (most recently used first)
_DEPTHS = 8  # prefix lengths tried downwards when no holder is usable (quarantined, excluded)


def granularity(layout: Layout) -> int:
    """Tokens per row of every stream of ``layout``: its ``tokens_per_row``, else 1 (one row per token).

    What a save records with each row segment (``parts.tokens_per_row``, schema v7)."""
    return layout.tokens_per_row or 1


def granularity_fits(p: PartRow, layout: Layout) -> bool:
    """Whether row segment ``p`` holds rows of ``layout``'s granularity: the one copy of the rule, used
    where a saved part is checked against the reading layout (restore plans, a save's parent).

    A segment saved before schema v7 recorded none (None) and is read as the layout says, as before."""
    return p.kind != 1 or p.tokens_per_row is None or p.tokens_per_row == granularity(layout)


def content_tag(layout: Layout) -> bytes:
    """What a snapshot's content key adds for its granularity: the same bytes in rows of another size are
    other state. Empty at one row per token, so content keys saved before v7 stay the same."""
    g = granularity(layout)
    return b"" if g == 1 else b"|tokens_per_row:%d" % g


class ContentSegment(NamedTuple):
    """One part of a chain link as its content key names it: the spec, the rows and the chunk ids."""

    name: str
    kind: int  # 0 fixed, 1 rows
    dtype: str
    shape: tuple[int, ...]  # a fixed part's shape, a stream's row shape
    row_start: int
    row_end: int
    chunk_ids: list[bytes]


def content_key_of(parent_key: bytes | None, tag: bytes, segments: Iterable[ContentSegment]) -> bytes:
    """What a whole chain holds, independent of snapshot ids: the same state saved again (through
    an equal chain) has the same key however its links are numbered. ``parent_key``: the parent
    link's content key (None for a root); ``tag``: :func:`content_tag` of the saving layout. The
    one definition, used by a save and by an import (which recomputes it, never trusting a file)."""
    h = blake3.blake3(b"content v2")
    h.update(parent_key if parent_key is not None else bytes(16))
    h.update(tag)  # rows of another granularity are other state (schema v7)
    for seg in sorted(segments, key=lambda s: s.name):
        h.update(f"|{seg.name}:{seg.kind}:{seg.dtype}:{list(seg.shape)}:{seg.row_start}:{seg.row_end}:".encode())
        for cid in seg.chunk_ids:
            h.update(cid)
    return h.digest(16)


def prefix_step(layout: Layout) -> int | None:
    """The index step in tokens of a layout that allows block-granular prefixes, else None.

    The step is the row granularity ``g`` (a multiple of it when ``g`` < 16 tokens)."""
    g = layout.tokens_per_row
    if g is None:
        return None
    return g * -(-_MIN_STEP // g)


def prefix_chain(tokens: np.ndarray, step: int, upto: int) -> list[bytes]:
    """``out[i]`` names tokens ``[0, (i + 1) * step)``, for every whole step below ``upto``."""
    raw = np.ascontiguousarray(tokens[:upto], dtype="<u8").data.cast("B")
    h = blake3.blake3(b"snapstore row prefixes v1 %d" % step).digest(16)
    out: list[bytes] = []
    width = step * 8
    for off in range(0, (upto // step) * width, width):
        h = blake3.blake3(h + raw[off:off + width]).digest(16)
        out.append(h)
    return out


def _covered(parts: Iterable[PartRow], g: int) -> tuple[int, int]:
    """Tokens ``(lo, hi]`` a snapshot's chain newly holds rows for in every stream: the parent's chain
    holds all streams up to the *lowest* segment start (streams may hold different row counts,
    ``rows={...}``; the highest would leave the steps between unindexed, a hole that stops the
    binary search short), its own chain up to the lowest segment end."""
    segs = [p for p in parts if p.kind == 1]
    if not segs:
        return 0, 0
    return min(p.row_start for p in segs) * g, min(p.row_end for p in segs) * g


def index_keys(layout: Layout, tokens: np.ndarray, parts: Iterable[PartRow]) -> list[tuple[int, bytes]]:
    """The (n_tokens, key) rows a new snapshot adds to the index: the steps its own rows cover."""
    step = prefix_step(layout)
    g = layout.tokens_per_row
    if step is None or g is None:
        return []
    lo, hi = _covered(parts, g)
    hi = min(hi, len(tokens))
    if hi <= lo:
        return []
    chain = prefix_chain(tokens, step, hi)
    first = lo // step + 1  # the first multiple of step above lo
    return [((i + 1) * step, chain[i]) for i in range(first - 1, len(chain))]


def record_prefixes(t: Txn, layout: Layout, sid: int, tokens: np.ndarray) -> None:
    """Index the prefixes new snapshot ``sid`` adds (in its save's transaction); nothing — not even
    a read of its parts — for a layout without ``tokens_per_row``, which every save of it would pay."""
    if prefix_step(layout) is not None:
        t.insert_row_prefixes(sid, index_keys(layout, tokens, t.parts(sid)))


@dataclass(frozen=True)
class PrefixHit:
    """Snapshot ``snap`` holds rows for the prompt's first ``n_tokens`` tokens."""

    snap: SnapRow
    n_tokens: int


def find_prefix(c: Txn, layout: Layout, identity_key: str, ns: str, tokens: np.ndarray, longer_than: int,
                usable: Callable[[SnapRow, int], bool],
                chain_of: Callable[[int], list[bytes]] | None = None) -> PrefixHit | None:
    """The longest prefix of ``tokens`` longer than ``longer_than`` that a committed snapshot of
    this identity and namespace holds rows for, or None.

    Binary search over the index (presence is monotone in the prefix length), then up to
    ``_HOLDERS`` holders at that length (then at up to ``_DEPTHS`` shorter ones) are checked with
    ``usable(snapshot, k)``: the caller compares tokens exactly, checks exclusions, quarantine, TTL.
    ``chain_of(step)``: the prompt's :func:`prefix_chain` at ``step`` (memoized by a caller matching
    one prompt several times), else computed here.
    """
    step = prefix_step(layout)
    if step is None or longer_than // step >= len(tokens) // step:
        return None  # no whole step beyond the exact match: nothing to hash (a full hit's usual case)
    chain = chain_of(step) if chain_of is not None else prefix_chain(tokens, step, len(tokens))
    lo, hi = longer_than // step, len(chain)  # answer in (lo, hi]; depth d names (d * step) tokens

    def holders(depths: list[int]) -> dict[int, list[int]]:
        return c.row_prefix_holders(identity_key, ns, [(chain[d - 1], d * step) for d in depths], _HOLDERS)

    while lo < hi:  # the largest d with a holder
        mid = (lo + hi + 1) // 2
        if c.row_prefix_held(identity_key, ns, chain[mid - 1], mid * step):
            lo = mid
        else:
            hi = mid - 1
    # the holders of every depth tried, in one statement (the deepest is usually usable; when its
    # holders are excluded — restore or recompute matching past them — the next ones are at hand)
    depths = list(range(lo, max(longer_than // step, lo - _DEPTHS), -1))
    held = holders(depths) if depths else {}
    for d in depths:
        for sid in held.get(d * step, ()):
            snap = c.snapshot(sid)
            if snap is not None and d * step > longer_than and usable(snap, d * step):
                return PrefixHit(snap, d * step)
    return None


def rows_limit(layout: Layout, snap: SnapRow, n_tokens: int | None) -> int | None:
    """Rows to restore for a match of ``n_tokens`` naming ``snap``: None for the whole snapshot,
    else ``n_tokens // g`` — only for a layout that allows block-granular prefixes."""
    if n_tokens is None or n_tokens >= snap.n_tokens:
        return None
    g = layout.tokens_per_row
    if g is None:
        return None  # exact boundaries: a Match names its whole snapshot (the behaviour before prefixes)
    if n_tokens <= 0 or n_tokens % g:
        raise InvalidInputError(f"a match of {n_tokens} tokens into snapshot {snap.id} is not a whole number "
                                f"of rows of {g} tokens")
    return n_tokens // g


def rows_bound(layout: Layout, snap: SnapRow, rows_to: int | None) -> int:
    """The most rows ``rows_from`` may skip in a restore of ``snap``: the rows it restores (a prefix
    match's ``rows_to``, else one per ``g`` of the snapshot's tokens), not its tokens."""
    return rows_to if rows_to is not None else snap.n_tokens // granularity(layout)


class ClippedSink(Sink):
    """A destination that keeps only bytes below ``limit``: the chunk that straddles a prefix's
    end is read and checked whole, and only its bytes inside the prefix are written."""

    def __init__(self, inner: Sink, limit: int):
        super().__init__(inner.name, min(inner.nbytes, limit), inner.mv, inner.arr, inner.writer)
        self.limit = limit

    def view(self, start: int, end: int) -> memoryview | None:
        return super().view(start, end) if end <= self.limit else None

    def segments(self, start: int, end: int) -> list[memoryview] | None:
        return super().segments(start, end) if end <= self.limit else None

    def buffer(self, start: int, n: int) -> memoryview | None:
        return super().buffer(start, n) if start + n <= self.limit else None

    def write(self, start: int, data: memoryview) -> None:
        keep = max(0, min(len(data), self.limit - start))
        if keep:
            super().write(start, data[:keep])
