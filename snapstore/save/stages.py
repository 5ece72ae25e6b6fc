"""Save, as stages mirroring restore (``plan.restore_plan`` validates, ``restore.stream`` streams).

validate the parts → resolve the parent (and, with check_rows, the rows it vouches for) → plan
the save (pieces, segments, logical and upper-bound bytes, capacity pre-check) → the chunker
publishes chunk files (durable) → :meth:`Saver.commit`: one metadata transaction that checks
the published headers against the catalog, inserts the snapshot, supersedes, evicts to the
budget or skips. Its outcomes besides success are the named :class:`Retry` and :class:`Skip`.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from snapstore._errors import CorruptionError, InvalidInputError, LayoutError
from snapstore._layout import Fixed, Layout, Rows
from snapstore._numbers import integer
from snapstore._refs import snapshot_id
from snapstore._tokens import TokenIndex, encode_tokens
from snapstore.catalog.queries import PartKind, SnapRow, SnapState, Txn
from snapstore.chunks.chunkfile import HEADER_SIZE, checksum, header_at, header_matches, scope_key
from snapstore.lifecycle.access import Retry
from snapstore.lifecycle.capacity import Capacity
from snapstore.lifecycle.eviction import evict_until
from snapstore.lifecycle.rules import new_outside_use, supersede
from snapstore.parts.buffers import Source, as_source
from snapstore.plan.fit import saved_layout_key
from snapstore.plan.prefix import (
    ContentSegment,
    content_key_of,
    content_tag,
    granularity,
    granularity_fits,
    record_prefixes,
)
from snapstore.plan.restore_plan import needs_quarantined
from snapstore.save.chunker import Chunker, ChunkRef, Piece
from snapstore.save.delta import RowsAbove

__all__ = ["MAX_ATTEMPTS", "WHOLE_AFTER", "SavePlan", "Saver", "Skip", "count_of",
           "validate_parts"]

# docs/format.md "Saving" cites these: a save redone after a lost race (a chunk file evicted under
# it, its parent dropped, its identity row dropped by another process) is tried at most
# MAX_ATTEMPTS times; with parent="auto" it is stored whole from attempt WHOLE_AFTER + 1 on.
MAX_ATTEMPTS = 8
WHOLE_AFTER = 3


class Skip(Exception):
    """The save does not fit the budget even after eviction: skipped with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def count_of(value: Any, what: str) -> int:
    """A row count: an integer (numpy ints too; snapstore._numbers), never a float, a bool or a string."""
    return integer(value, what)


def validate_parts(layout: Layout, parts: Mapping[str, Any], rows: Any, n: int
                   ) -> tuple[dict[str, Source], dict[str, int]]:
    """Stage 1: the parts against the layout, and the row count of each saved stream."""
    if not isinstance(parts, Mapping):
        raise LayoutError("parts must be a mapping of part name to buffer")
    specs = layout.parts
    unknown = sorted(set(parts) - set(specs))
    if unknown:
        raise LayoutError(f"parts not in the layout: {unknown}; layout parts are {sorted(specs)}")
    present_components = {specs[name].component for name in parts}
    missing = sorted(name for name, s in specs.items() if name not in parts and (
        s.component is None or s.component in present_components))
    if missing:
        raise LayoutError(f"parts missing from save(): {missing} (a component is saved whole or not at all)")
    per = layout.tokens_per_row or 1  # block-granular layouts: one row per `per` tokens
    full = n // per
    streams = [name for name in parts if isinstance(specs[name], Rows)]
    valid = {name: layout.valid_rows(name, n) for name in streams}  # a stream with a lag holds fewer
    if rows is None:
        row_counts = dict(valid)
    elif isinstance(rows, Mapping):
        # a stream of a component this call leaves out may be named (an engine passes one rows
        # mapping whether or not it saves the draft component): it is not saved, so not counted
        extra = sorted(set(rows) - set(layout.rows))
        if extra:
            raise LayoutError(f"rows given for parts that are not row streams of the layout: {extra}; its row "
                              f"streams are {sorted(layout.rows)}")
        row_counts = {name: count_of(rows.get(name, valid[name]), f"rows[{name!r}]") for name in streams}
    elif isinstance(rows, numbers.Integral) and not isinstance(rows, bool):
        # one count for every stream, as rows of the streams in step with the tokens: a lagging one has fewer
        k = count_of(rows, "rows")
        row_counts = {name: max(0, k - layout.rows[name].lag) if k >= 0 else k for name in streams}
    else:
        raise InvalidInputError(f"rows must be None, an int or a mapping of stream to int, got {rows!r}")
    for name, r in row_counts.items():
        if r < 0:
            raise InvalidInputError(f"rows[{name!r}] must be >= 0, got {r}")
        if r > full:
            raise InvalidInputError(f"rows[{name!r}] = {r} but only {n} tokens are saved: a stream holds at "
                                    f"most one row per {'token' if per == 1 else f'{per} tokens'}")
        if r > valid[name]:  # rows past the valid ones cannot be told from data: never stored as state
            raise InvalidInputError(f"rows[{name!r}] = {r} but the layout says stream {name!r} lags the tokens by "
                                    f"{layout.rows[name].lag} (Rows(lag=...)): after {n} tokens it holds {valid[name]} "
                                    "valid rows, and a row past them cannot be told from data; pass at most "
                                    f"{valid[name]} (or leave rows= out: the lag is applied)")
    sources = {name: as_source(name, obj, specs[name], row_counts.get(name, 0)) for name, obj in parts.items()}
    return sources, row_counts


@dataclass(frozen=True)
class SavePlan:
    """Stage 3: what one save attempt writes — its parent, the pieces, the segments, the bytes."""

    parent: SnapRow | None
    pieces: list[Piece]
    segments: list[tuple[str, int, int]]  # part name, row_start, row_end (0, 0 for a fixed part)
    logical_bytes: int
    upper_bytes: int  # at most this many bytes land on disk (payloads plus a header per chunk)


@dataclass(frozen=True)
class Committed:
    """What :meth:`Saver.commit` did: the snapshot id, its parent, new bytes, and whether it existed."""

    snapshot_id: int
    parent_id: int | None
    new_bytes: int
    existed: bool


class Saver:
    """The save stages of one store (its layout, identity, owner, chunker and capacity)."""

    def __init__(self, *, layout: Layout, identity_key: str, owner: str, chunk_bytes: int, chunker: Chunker,
                 capacity: Capacity, blob_path: Callable[[bytes], str], renew: Callable[[Txn], None],
                 own: Callable[[Txn, SnapRow | None, str | None], SnapRow]) -> None:
        self.layout = layout
        self.identity_key = identity_key
        self.owner = owner
        self.chunk_bytes = chunk_bytes
        self.chunker = chunker
        self.capacity = capacity
        self._blob_path = blob_path
        self._renew = renew
        self._own = own  # the store's one ownership check (snapstore.lifecycle.access.Access.own)

    # -- stage 2: the parent -------------------------------------------------------------------
    def resolve_parent(self, t: Txn, parent: Any, index: TokenIndex, keys: np.ndarray, ns: str,
                       row_counts: dict[str, int], commit: bool) -> tuple[SnapRow | None, dict[str, int]]:
        """The parent this save is a delta over ("auto", None or an id) and its rows per stream
        (``keys``: the tokens' find keys, computed once per save)."""
        n = len(index)

        def parent_rows(p: SnapRow) -> dict[str, int] | None:
            stored = {q.name: q for q in t.parts(p.id) if q.kind == PartKind.ROWS}
            out: dict[str, int] = {}
            for name, r in row_counts.items():
                q = stored.get(name)
                if q is None or q.row_end > r or q.dtype != self.layout.rows[name].dtype or \
                        tuple(q.shape) != self.layout.rows[name].row_shape or not granularity_fits(q, self.layout):
                    return None
                if q.row_end > self.layout.valid_rows(name, p.n_tokens):
                    return None  # rows past its lag (saved before the layout declared it): no base for a delta
                out[name] = q.row_end
            return out

        if parent is None:
            return None, {}
        if isinstance(parent, str):
            if parent != "auto":
                raise InvalidInputError(f"parent must be 'auto', None or a snapshot id, got {parent!r}")
            broken = t.quarantined_users()
            # candidates by find key; the BLAKE3 prefix key below decides
            for sid, cn, key, _own, _lk in list(t.match_candidates(self.identity_key, ns, keys, n - 1, 0.0)):
                if key != index.prefix_key(cn):
                    continue
                if broken and needs_quarantined(t.chain(sid), broken, leaf=False):
                    continue  # a delta over it could not restore until its chunk is healed
                cand = t.snapshot(sid)
                pr = parent_rows(cand) if cand is not None else None
                if cand is not None and pr is not None:
                    return cand, pr
            return None, {}
        sid = snapshot_id(parent)
        snap = self._own(t, t.snapshot(sid), ns)
        if snap.state == SnapState.PENDING and snap.owner != self.owner:
            raise InvalidInputError(f"parent {sid} is a pending capture of another process")
        if snap.state == SnapState.PENDING and commit:
            raise InvalidInputError(f"parent {sid} is pending: parents commit before children; save this one "
                                    "with commit=False (commit() then commits the chain) or commit the parent first")
        if snap.n_tokens > n or snap.prefix_key != index.prefix_key(snap.n_tokens):
            raise InvalidInputError(f"parent {sid} is not a prefix of these tokens")
        pr = parent_rows(snap)
        if pr is None:
            raise LayoutError(f"parent {sid} lacks a row stream being saved, has more rows than this save (or than "
                              "its own tokens less the stream's Rows(lag=)), or holds rows of another dtype, row "
                              "shape or tokens_per_row")
        return snap, pr

    def rows_vouched(self, t: Txn, parent: SnapRow, prows: dict[str, int], sources: dict[str, Source]) -> bool:
        """check_rows: do the caller's rows below the parent boundary equal the parent chain's?"""
        for link in t.chain(parent.id):
            for part in t.parts(link.id):
                if part.kind != PartKind.ROWS or part.name not in prows or \
                        isinstance(sources[part.name].reader, RowsAbove):
                    continue  # a wait=False save's delta copy holds no rows below the parent (save.delta)
                off = part.row_start * self.layout.rows[part.name].row_bytes
                src = sources[part.name]
                for ch in t.part_chunks(link.id, part.name):
                    if ch is None:
                        return False
                    buf = memoryview(bytearray(ch.raw_len))
                    src.copy_into(off, buf)
                    if checksum(buf) != ch.checksum:
                        return False
                    off += ch.raw_len
        return True

    # -- stage 3: the plan ---------------------------------------------------------------------
    def plan(self, sources: dict[str, Source], row_counts: dict[str, int], parent: SnapRow | None,
             prows: dict[str, int], ns: str) -> SavePlan:
        """The pieces the chunker publishes and the segments the snapshot's parts will hold."""
        specs = self.layout.parts
        pieces: list[Piece] = []
        segments: list[tuple[str, int, int]] = []
        for name, src in sources.items():
            spec = specs[name]
            # the chunk scope covers the part's dtype and (row) shape: bytes saved under another
            # layout never deduplicate onto chunks, or a snapshot, that this layout cannot restore
            if isinstance(spec, Fixed):
                pieces.append(Piece(src, 0, spec.nbytes, scope_key(self.identity_key, ns, spec.dtype, spec.shape)))
                segments.append((name, 0, 0))
            else:
                r0, r1 = prows.get(name, 0), row_counts[name]
                pieces.append(Piece(src, r0 * spec.row_bytes, r1 * spec.row_bytes,
                                    scope_key(self.identity_key, ns, spec.dtype, spec.row_shape)))
                segments.append((name, r0, r1))
        logical = sum(s.nbytes if isinstance(s, Fixed) else row_counts[k] * s.row_bytes
                      for k, s in specs.items() if k in sources)
        upper = sum(p.end - p.start for p in pieces) + HEADER_SIZE * sum(
            max(1, -(-(p.end - p.start) // self.chunk_bytes)) for p in pieces)
        return SavePlan(parent, pieces, segments, logical, upper)

    def content_key(self, plan: SavePlan, refs: list[list[ChunkRef]]) -> bytes:
        """What the whole chain holds, independent of snapshot ids: the same state saved again
        (through an equal chain) has the same key however its links are numbered."""
        specs = self.layout.parts
        par = plan.parent
        segs = []
        for (name, r0, r1), rs in zip(plan.segments, refs):
            spec = specs[name]
            kind, shape = (0, spec.shape) if isinstance(spec, Fixed) else (1, spec.row_shape)
            segs.append(ContentSegment(name, kind, spec.dtype, tuple(shape), r0, r1, [r.id for r in rs]))
        return content_key_of(par.content_key if par else None, content_tag(self.layout), segs)

    # -- stage 5: the commit -------------------------------------------------------------------
    def commit(self, t: Txn, *, iid: int, plan: SavePlan, refs: list[list[ChunkRef]], arr: np.ndarray,
               index: TokenIndex, find_key: int, session: str | None, commit: bool, ns: str) -> Committed:
        """The save's metadata transaction: Retry / Skip, or the snapshot inserted (or found). Its token
        segment is encoded here, once; the catalog gets the find key with it (``find_key``: of ``arr``)."""
        par = plan.parent
        n = len(arr)
        now = time.time()
        keys = {r.id: p.key for p, rs in zip(plan.pieces, refs) for r in rs}
        inherited: str | None = None  # a child of an import under an identity override is one too (schema v11)
        if par is not None:
            p = t.snapshot(par.id)
            if p is None or (p.state == SnapState.PENDING and (p.owner != self.owner or commit)):
                raise Retry(parent_gone=True)
            inherited = p.imported_from
        if not t.quarantined_ids().isdisjoint(keys):
            raise Retry()  # a chunk found damaged since this save looked: the retry republishes it
        if not commit:
            self._renew(t)  # a capture is never younger than its owner's lease
        content_key = self.content_key(plan, refs)
        if commit:
            # only a snapshot of the same override mark: a native save is stored as native (issue 46)
            same = t.same_content(iid, ns, index.prefix_key(n), content_key, inherited)
            if same is not None:
                t.touch(same.id, now, False)
                if new_outside_use(same, session):
                    t.mark_shared(same.id)  # another session now holds it as its own: not superseded away
                if session is not None and same.session == session:
                    supersede(t, same, index)
                return Committed(same.id, same.parent_id, 0, True)
        new_bytes = self._check_headers(t, refs, keys, now)
        tokens_blob, width = encode_tokens(arr[par.n_tokens if par else 0:])
        sid = t.insert_snapshot(
            identity_id=iid, namespace=ns, parent_id=par.id if par else None,
            depth=(par.depth + 1) if par else 0, n_tokens=n, base_tokens=par.n_tokens if par else 0,
            token_width=width, tokens=tokens_blob, find_key=find_key, anchor=index.anchor(n),
            prefix_key=index.prefix_key(n), content_key=content_key, session=session,
            state=SnapState.COMMITTED if commit else SnapState.PENDING,
            owner=None if commit else self.owner, now=now, logical_bytes=plan.logical_bytes,
            layout_key=saved_layout_key(self.layout, [name for name, _r0, _r1 in plan.segments]),
            imported_from=inherited)
        specs = self.layout.parts
        for (name, r0, r1), rs in zip(plan.segments, refs):
            spec = specs[name]
            if isinstance(spec, Fixed):
                t.insert_part(sid, name, PartKind.FIXED, spec.dtype, spec.shape, spec.component, 0, 0,
                              spec.nbytes, [r.id for r in rs])
            else:
                t.insert_part(sid, name, PartKind.ROWS, spec.dtype, spec.row_shape, spec.component, r0, r1,
                              (r1 - r0) * spec.row_bytes, [r.id for r in rs], granularity(self.layout))
        record_prefixes(t, self.layout, sid, arr)  # block-granular prefixes (tokens_per_row layouts only)
        if commit:
            new = t.snapshot(sid)
            assert new is not None
            supersede(t, new, index)
        protect = {sid} | ({s.id for s in t.chain(par.id)} if par else set())
        ok, _ = evict_until(t, lambda _freed: self.capacity.excess(t) is None, protect)
        if not ok:
            raise Skip(self.capacity.excess(t) or "disk_reserve")
        t.add_counter("inserts", 1)
        t.add_counter("logical_in", plan.logical_bytes)
        return Committed(sid, par.id if par else None, new_bytes, False)

    def _check_headers(self, t: Txn, refs: list[list[ChunkRef]], keys: dict[bytes, bytes], now: float) -> int:
        """The one header check of a save: every new chunk's file, as published, against its ref.

        Returns the bytes of the chunk rows added; Retry if a file is gone or damaged (the retry
        republishes it).
        """
        missing: set[bytes] = set()
        new_bytes = 0
        for rs in refs:
            for r in rs:
                if t.chunk(r.id) is not None:
                    continue
                path = self._blob_path(r.id)
                try:
                    head, size = header_at(path)
                except (OSError, CorruptionError):
                    missing.add(r.id)
                    continue
                if not header_matches(head, r.raw_len, r.checksum, size):
                    missing.add(r.id)  # a damaged (or cut) file sits at the address: republish it
                    continue
                if t.add_chunk(r.id, r.raw_len, size, head.codec, r.checksum, keys[r.id], now):
                    new_bytes += size
        if missing:
            raise Retry()
        return new_bytes
