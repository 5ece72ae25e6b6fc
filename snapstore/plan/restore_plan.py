"""Restore plans: walk a snapshot's chain and check everything before a byte is written.

The plan is built inside one read transaction: chain complete and contiguous from row 0,
segment sizes = rows × row bytes, chunk sizes add up, every chunk row present, destination
dtype/shape/size right. Only a plan that passes all of this is streamed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from snapstore._errors import CorruptChunkError, DestinationError, SnapshotUnavailableError
from snapstore._layout import Fixed, Layout, PartSpec, Rows
from snapstore.catalog.db import ChunkRow, PartRow, SnapRow
from snapstore.parts.buffers import Sink, as_sink
from snapstore.plan.prefix import ClippedSink, granularity, granularity_fits

__all__ = ["CheckedPlan", "PartReads", "PlanItem", "PlanSource", "RestorePlan", "bind", "build_plan", "check_plan",
           "needs_quarantined", "parts_fit"]


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


class PlanItem(NamedTuple):
    """Write chunk ``chunk`` to ``sink`` at byte ``offset``, less its first ``skip`` bytes (``rows_from``).
    A tuple: a small restore makes a dozen per call, and a frozen dataclass's were a sixtieth of it."""

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
    # the catalog stamp (nonce, generation) its rows were read under, when it was planned through the
    # memo (catalog.chain_cache): the chunk files it opens may be kept open under it (chunks.open_files)
    stamp: tuple[bytes, int] | None = None

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


@dataclass(frozen=True)
class PartReads:
    """One part of a checked plan: what :func:`bind` needs to write it — the destination size
    (``rows``), whether a prefix clips it, and its chunks as ``(offset, chunk, skip)``."""

    name: str
    spec: PartSpec
    rows: int
    clip: bool
    reads: tuple[tuple[int, ChunkRow, int], ...]


@dataclass(frozen=True)
class CheckedPlan:
    """The catalog half of a restore plan, checked, without destinations: the same for every
    restore of the snapshot with the same layout, components, ``rows_from`` and ``rows_to``, so a
    store may keep it with the rows it was checked from (catalog/chain_cache.py)."""

    snapshot_id: int
    n_tokens: int
    chain: tuple[int, ...]
    rows: dict[str, int]
    missing_components: frozenset[str]
    part_bytes: dict[str, int]
    held: frozenset[str]
    parts: tuple[PartReads, ...]
    chunks: tuple[ChunkRow, ...]  # every chunk a restore reads, in order


def build_plan(c: PlanSource, sid: int, chain: list[SnapRow], layout: Layout, into: Mapping[str, Any] | None,
               components: set[str], rows_from: int = 0, rows_to: int | None = None,
               chunks: list[ChunkRow] | None = None) -> RestorePlan:
    """Validate the chain and the destinations and list every chunk to write, in order:
    :func:`check_plan` then :func:`bind`.

    ``into=None`` describes instead (``Store.describe``): the same checks of the chain and its
    chunks, no destinations, no items; ``rows`` and ``part_bytes`` say what a restore would write.
    ``rows_from``: rows below it (the engine holds them) are not written; a chunk wholly below is
    not read at all, one that straddles it is read and checked whole and written from that row.
    ``rows_to``: a block-granular prefix match (``plan.prefix``) — only rows ``[0, rows_to)`` of
    every stream are restored; chunks wholly above are not read, one that straddles is clipped.
    ``chunks`` (with ``into=None``): gets the chunk rows a restore would read (``Store.estimate_restore``).
    """
    return bind(check_plan(c, sid, chain, layout, components, rows_from, rows_to), into, chunks)


def bind(checked: CheckedPlan, into: Mapping[str, Any] | None, chunks: list[ChunkRow] | None = None) -> RestorePlan:
    """The plan of ``checked`` into the destinations ``into`` (None: a description), each checked
    (present, writable, large enough, of the part's dtype and shape) before anything is written."""
    plan = RestorePlan(checked.snapshot_id, checked.n_tokens, list(checked.chain), dict(checked.rows),
                       set(checked.missing_components), part_bytes=dict(checked.part_bytes), held=checked.held)
    if chunks is not None:
        chunks.extend(checked.chunks)
    if into is None:
        return plan
    for part in checked.parts:
        if part.name not in into:
            raise DestinationError(f"no destination for part {part.name!r}; pass it in `into` "
                                   "(or leave its component out of `components`)")
        sink = as_sink(part.name, into[part.name], part.spec, part.rows)
        if part.clip:
            sink = ClippedSink(sink, part.rows * part.spec.row_bytes)  # type: ignore[union-attr]
        plan.items.extend(PlanItem(sink, off, ch, skip) for off, ch, skip in part.reads)
    return plan


def check_plan(c: PlanSource, sid: int, chain: list[SnapRow], layout: Layout, components: set[str],
               rows_from: int = 0, rows_to: int | None = None) -> CheckedPlan:
    """Every check of :func:`build_plan` that does not depend on the destinations: the chain
    complete and contiguous, each part present with the layout's dtype, shape and granularity,
    segments contiguous and sized, every chunk row present, unquarantined and adding up."""
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
    held = frozenset(p.component for p in parts_by_link[-1].values() if p.component is not None)
    rows_of: dict[str, int] = {}
    missing: set[str] = set()
    part_bytes: dict[str, int] = {}
    parts: list[PartReads] = []
    read: list[ChunkRow] = []
    for name, spec in layout.parts.items():
        if spec.component is not None and spec.component not in components:
            continue  # a component the caller did not ask for
        present = [links.get(name) for links in parts_by_link]
        leaf_part = present[-1]
        absent = leaf_part is None or (isinstance(spec, Rows) and any(p is None for p in present))
        if absent:
            if spec.component is not None:
                missing.add(spec.component)
                continue
            if not leaf.matchable and leaf.state == 1 and isinstance(spec, Fixed):
                raise SnapshotUnavailableError(
                    f"snapshot {sid} was superseded by a longer snapshot of its session {leaf.session!r}: it is "
                    f"kept only as a chain link (rows, no fixed parts such as {name!r}); restore the newer "
                    "snapshot (match() the prompt again); nothing was written", snapshot_id=sid)
            raise SnapshotUnavailableError(
                f"snapshot {sid} has no part {name!r} (saved with another layout?); nothing was written",
                snapshot_id=sid)
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
            part_bytes[name] = spec.nbytes
            got = _chunks(c, leaf.id, leaf_part)
            offsets = [0]
            for ch in got[:-1]:
                offsets.append(offsets[-1] + ch.raw_len)
            parts.append(PartReads(name, spec, 0, False, tuple((o, ch, 0) for o, ch in zip(offsets, got))))
            read.extend(got)
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
        clip = rows_to is not None
        if rows_to is not None:
            if rows < rows_to:
                raise SnapshotUnavailableError(f"snapshot {sid} part {name!r} holds {rows} rows, the match "
                                               f"needs {rows_to}; nothing was written", snapshot_id=sid)
            rows = rows_to
        elif spec.lag:
            # a link that stored rows past the ones its tokens give a lagging stream (saved before the
            # layout declared the lag) holds a stale row there, which cannot be told from data: rows
            # from the first such point on are never served (issue 46 item 4)
            valid = min([layout.valid_rows(name, link.n_tokens) for link, p in zip(chain, present)
                         if p is not None and p.row_end > layout.valid_rows(name, link.n_tokens)], default=rows)
            if valid < rows:
                rows, clip = valid, True
        rows_of[name] = rows
        held_rows = min(max(0, rows_from - spec.lag), rows)  # rows_from counts rows in step with the tokens
        part_bytes[name] = (rows - held_rows) * spec.row_bytes
        keep, end = held_rows * spec.row_bytes, rows * spec.row_bytes
        reads: list[tuple[int, ChunkRow, int]] = []
        for link_id, p in segments:
            off = p.row_start * spec.row_bytes
            for ch in _chunks(c, link_id, p):  # every chunk row present and sized, read or not
                if off + ch.raw_len > keep and off < end:  # the ones a restore reads
                    reads.append((off, ch, max(0, keep - off)))
                    read.append(ch)
                off += ch.raw_len
        parts.append(PartReads(name, spec, rows, clip, tuple(reads)))
    return CheckedPlan(sid, n_tokens, tuple(s.id for s in chain), rows_of, frozenset(missing), part_bytes, held,
                       tuple(parts), tuple(read))
