"""Restore plans: walk a snapshot's chain and check everything before a byte is written.

The plan is built inside one read transaction: chain complete and contiguous from row 0,
segment sizes = rows × row bytes, chunk sizes add up, every chunk row present, destination
dtype/shape/size right. Only a plan that passes all of this is streamed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from snapstore._errors import CorruptChunkError, DestinationError, SnapshotUnavailableError
from snapstore._layout import Fixed, Layout, PartSpec, Rows
from snapstore.catalog.db import ChunkRow, PartRow, SnapRow
from snapstore.parts.buffers import Sink, as_sink
from snapstore.plan.prefix import ClippedSink, granularity, granularity_fits

__all__ = ["PlanItem", "PlanSource", "RestorePlan", "build_plan", "needs_quarantined", "parts_fit"]


def needs_quarantined(chain: list[SnapRow], broken: dict[int, bool], *, leaf: bool) -> bool:
    """Does restoring the chain's leaf (``leaf``), or a delta over it, read a quarantined chunk?

    ``broken`` is Txn.quarantined_users: a snapshot whose row segments use one breaks every
    descendant; one whose fixed parts do breaks only itself (a delta over it never reads them).
    """
    if not broken:
        return False
    if leaf and chain and chain[-1].id in broken:
        return True
    return any(broken.get(link.id, False) for link in chain)


class PlanSource(Protocol):
    """What a plan reads: the local catalog (a Conn), or a shared-tier chain's manifests (remote.stream)."""

    def parts(self, sid: int) -> list[PartRow]: ...

    def part_chunks(self, sid: int, name: str) -> list[ChunkRow | None]: ...


@dataclass(frozen=True)
class PlanItem:
    """Write chunk ``chunk`` to ``sink`` at byte ``offset``, less its first ``skip`` bytes (``rows_from``)."""

    sink: Sink
    offset: int
    chunk: ChunkRow
    skip: int = 0


@dataclass
class RestorePlan:
    """Everything a restore will write, validated."""

    snapshot_id: int
    n_tokens: int
    chain: list[int]
    rows: dict[str, int]
    missing_components: set[str]
    items: list[PlanItem] = field(default_factory=list)
    part_bytes: dict[str, int] = field(default_factory=dict)  # bytes each part restores
    held: frozenset[str] = frozenset()  # the components the snapshot itself holds (describe's ``components``)

    @property
    def nbytes(self) -> int:
        """Bytes the restore writes."""
        return sum(i.chunk.raw_len - i.skip for i in self.items)


def _spec_matches(p: PartRow, spec: PartSpec) -> bool:
    if isinstance(spec, Fixed):
        return p.kind == 0 and p.dtype == spec.dtype and tuple(p.shape) == spec.shape
    return p.kind == 1 and p.dtype == spec.dtype and tuple(p.shape) == spec.row_shape


def parts_fit(parts: Iterable[PartRow], layout: Layout) -> bool:
    """Would :func:`build_plan` accept a snapshot whose own parts are ``parts`` into ``layout``, every
    component asked for? Each part the layout names is present with its dtype, shape and row
    granularity, or belongs to an optional component (then it restores as missing); parts the
    layout does not name are not read. match() serves only snapshots that fit (:mod:`snapstore.plan.fit`).
    A delta's ancestors hold the same row specs (a save takes a parent only if they agree)."""
    have = {p.name: p for p in parts}
    for name, spec in layout.parts.items():
        p = have.get(name)
        if p is None:
            if spec.component is None:
                return False
            continue
        if not _spec_matches(p, spec) or not granularity_fits(p, layout):
            return False
    return True


def _chunks(c: PlanSource, sid: int, part: PartRow) -> list[ChunkRow]:
    chunks = c.part_chunks(sid, part.name)
    if any(ch is None for ch in chunks):
        raise SnapshotUnavailableError(
            f"snapshot {sid} part {part.name!r} references a chunk that is gone; nothing was written",
            snapshot_id=sid)
    out = [ch for ch in chunks if ch is not None]
    for ch in out:
        if ch.quarantined is not None:
            raise CorruptChunkError(
                f"snapshot {sid} part {part.name!r}: chunk {ch.id.hex()} is quarantined (a restore found it "
                "damaged; the next save of the same state republishes it); nothing was written", snapshot_id=sid)
    if sum(ch.raw_len for ch in out) != part.nbytes:
        raise SnapshotUnavailableError(
            f"snapshot {sid} part {part.name!r}: chunks hold {sum(ch.raw_len for ch in out)} bytes, "
            f"the part records {part.nbytes}; run `snapstore verify`", snapshot_id=sid)
    return out


def build_plan(c: PlanSource, sid: int, chain: list[SnapRow], layout: Layout, into: Mapping[str, Any] | None,
               components: set[str], rows_from: int = 0, rows_to: int | None = None,
               chunks: list[ChunkRow] | None = None) -> RestorePlan:
    """Validate the chain and the destinations and list every chunk to write, in order.

    ``into=None`` describes instead (``Store.describe``): the same checks of the chain and its
    chunks, no destinations, no items; ``rows`` and ``part_bytes`` say what a restore would write.
    ``rows_from``: rows below it (the engine holds them) are not written; a chunk wholly below is
    not read at all, one that straddles it is read and checked whole and written from that row.
    ``rows_to``: a block-granular prefix match (``plan.prefix``) — only rows ``[0, rows_to)`` of
    every stream are restored; chunks wholly above are not read, one that straddles is clipped.
    ``chunks`` (with ``into=None``): gets the chunk rows a restore would read (``Store.estimate_restore``).
    """
    leaf = chain[-1]
    prev_n = 0
    for i, link in enumerate(chain):
        if i == 0 and link.parent_id is not None:
            raise SnapshotUnavailableError(
                f"snapshot {sid}: ancestor {link.parent_id} is missing (broken chain); nothing was written",
                snapshot_id=sid)
        if link.base_tokens != prev_n or link.n_tokens < link.base_tokens:
            raise SnapshotUnavailableError(
                f"snapshot {sid}: chain is not contiguous at snapshot {link.id} "
                f"(starts at token {link.base_tokens}, parent ends at {prev_n})", snapshot_id=sid)
        prev_n = link.n_tokens
    parts_by_link = [{p.name: p for p in c.parts(link.id)} for link in chain]
    n_tokens = leaf.n_tokens if rows_to is None else rows_to * (layout.tokens_per_row or 1)
    plan = RestorePlan(sid, n_tokens, [s.id for s in chain], {}, set(),
                       held=frozenset(p.component for p in parts_by_link[-1].values() if p.component is not None))
    for name, spec in layout.parts.items():
        if spec.component is not None and spec.component not in components:
            continue  # a component the caller did not ask for
        present = [links.get(name) for links in parts_by_link]
        leaf_part = present[-1]
        absent = leaf_part is None or (isinstance(spec, Rows) and any(p is None for p in present))
        if absent:
            if spec.component is not None:
                plan.missing_components.add(spec.component)
                continue
            if not leaf.matchable and leaf.state == 1 and isinstance(spec, Fixed):
                raise SnapshotUnavailableError(
                    f"snapshot {sid} was superseded by a longer snapshot of its session {leaf.session!r}: it is "
                    f"kept only as a chain link (rows, no fixed parts such as {name!r}); restore the newer "
                    "snapshot (match() the prompt again); nothing was written", snapshot_id=sid)
            raise SnapshotUnavailableError(
                f"snapshot {sid} has no part {name!r} (saved with another layout?); nothing was written",
                snapshot_id=sid)
        if into is not None and name not in into:
            raise DestinationError(f"no destination for part {name!r}; pass it in `into` "
                                   "(or leave its component out of `components`)")
        for p in present:
            if p is not None and not _spec_matches(p, spec):
                raise DestinationError(
                    f"part {name!r} was saved as {p.dtype} {list(p.shape)}, the layout says "
                    f"{spec.dtype} {list(spec.shape if isinstance(spec, Fixed) else spec.row_shape)}")
            if p is not None and not granularity_fits(p, layout):
                raise DestinationError(
                    f"part {name!r} was saved at {p.tokens_per_row} tokens per row, the layout reads "
                    f"{granularity(layout)} tokens per row (Layout.tokens_per_row; 1 without it): open the store "
                    "with the layout that saved it, or put the block size in the Identity's extra; "
                    "nothing was written")
        if isinstance(spec, Fixed):
            assert leaf_part is not None
            if leaf_part.nbytes != spec.nbytes:
                raise SnapshotUnavailableError(f"snapshot {sid} part {name!r} has a wrong size", snapshot_id=sid)
            plan.part_bytes[name] = spec.nbytes
            if into is None:
                got = _chunks(c, leaf.id, leaf_part)
                if chunks is not None:
                    chunks.extend(got)
                continue
            sink = as_sink(name, into[name], spec, 0)
            off = 0
            for ch in _chunks(c, leaf.id, leaf_part):
                plan.items.append(PlanItem(sink, off, ch))
                off += ch.raw_len
            continue
        rows = 0
        segments: list[tuple[int, PartRow]] = []
        for link, p in zip(chain, present):
            assert p is not None
            if p.row_start != rows or p.row_end < p.row_start:
                raise SnapshotUnavailableError(
                    f"snapshot {sid} part {name!r}: rows not contiguous at snapshot {link.id} "
                    f"(segment starts at {p.row_start}, expected {rows})", snapshot_id=sid)
            if p.nbytes != (p.row_end - p.row_start) * spec.row_bytes:
                raise SnapshotUnavailableError(
                    f"snapshot {sid} part {name!r}: segment of snapshot {link.id} has {p.nbytes} bytes "
                    f"for {p.row_end - p.row_start} rows", snapshot_id=sid)
            rows = p.row_end
            segments.append((link.id, p))
        if rows_to is not None:
            if rows < rows_to:
                raise SnapshotUnavailableError(f"snapshot {sid} part {name!r} holds {rows} rows, the match "
                                               f"needs {rows_to}; nothing was written", snapshot_id=sid)
            rows = rows_to
        plan.rows[name] = rows
        plan.part_bytes[name] = (rows - min(rows_from, rows)) * spec.row_bytes
        if into is None:
            keep, end = min(rows_from, rows) * spec.row_bytes, rows * spec.row_bytes
            for link_id, p in segments:
                off = p.row_start * spec.row_bytes
                for ch in _chunks(c, link_id, p):  # every chunk row present and sized: what a restore checks
                    if chunks is not None and off + ch.raw_len > keep and off < end:
                        chunks.append(ch)  # the ones a restore would read (as the items below)
                    off += ch.raw_len
            continue
        sink = as_sink(name, into[name], spec, rows)
        if rows_to is not None:
            sink = ClippedSink(sink, rows * spec.row_bytes)
        keep_from = min(rows_from, rows) * spec.row_bytes
        for link_id, p in segments:
            off = p.row_start * spec.row_bytes
            for ch in _chunks(c, link_id, p):
                if off + ch.raw_len > keep_from and off < sink.nbytes:
                    plan.items.append(PlanItem(sink, off, ch, max(0, keep_from - off)))
                off += ch.raw_len
    return plan
