"""What a store holds, described once: snapshot infos (``Store.snapshots()``), stats, and the reports
``snapstore inspect`` renders (:mod:`snapstore.check.report`; the CLI only parses and renders).

Every snapshot description, the library's and inspect's, is built by :func:`snapshot_info`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from snapstore._errors import InvalidInputError, NotFoundError, StoreFormatError
from snapstore._identity import Identity
from snapstore._results import SnapshotInfo, Stats
from snapstore.catalog.queries import ChunkRow, PartKind, PartRow, SnapRow, SnapState, Txn
from snapstore.catalog.rows import identity_fields
from snapstore.check.report import (
    ChainLink,
    ChunkEntry,
    IdentityEntry,
    NameEntry,
    NamespaceEntry,
    PartEntry,
    SnapshotEntry,
    SnapshotReport,
    StoreReport,
    Totals,
)
from snapstore.chunks.chunkfile import CODEC_NAMES
from snapstore.plan.restore_plan import needs_quarantined

__all__ = ["FORMAT", "inspect_snapshot", "inspect_store", "resolve_identity", "snapshot_entry", "snapshot_identity",
           "snapshot_info", "snapshot_infos", "stats_of"]

FORMAT = 1  # the version of the JSON reports (docs/cli.md)


def stats_of(c: Txn, disk_budget: int, ram_used: int) -> Stats:
    """Stats from the catalog (shared by Store.stats and the CLI)."""
    quarantined = c.quarantined_count()
    counters = c.counters()
    stored, logical, entries, allsnaps = c.totals()
    pending, nchunks, raw = c.census()
    return Stats(
        entries=entries, snapshots=allsnaps, pending=pending,
        inserts=counters.get("inserts", 0), hits=counters.get("hits", 0), misses=counters.get("misses", 0),
        hit_tokens=counters.get("hit_tokens", 0), restores=counters.get("restores", 0),
        evictions=counters.get("evictions", 0), supersedes=counters.get("supersedes", 0),
        expired=counters.get("expired", 0), abandoned=counters.get("abandoned", 0),
        stale_dropped=counters.get("stale_dropped", 0),
        skipped={k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("skipped:")},
        stored_bytes=stored, logical_bytes=logical,
        dedup_ratio=(raw / stored) if stored else 1.0,
        ram_hits=counters.get("ram_hits", 0), ram_bytes=ram_used, disk_budget=disk_budget, chunks=nchunks,
        quarantined=quarantined, healed=counters.get("healed", 0), detached=counters.get("detached", 0),
        remote={k[7:]: v for k, v in sorted(counters.items()) if k.startswith("remote_")},
        recompute_skipped=counters.get("recompute_skipped", 0),
        restore_saved_s=counters.get("restore_saved_us", 0) / 1e6,
        restore_rates={r.tier: r.w / r.sv for r in sorted(c.restore_rates()) if r.sv > 0})


def snapshot_info(t: Txn, s: SnapRow, identity: str, pinned: bool, parts: list[PartRow] | None = None,
                  broken: dict[int, bool] | None = None) -> SnapshotInfo:
    """The one description of a snapshot (Store.snapshots() lists these; inspect extends them).

    ``matchable`` is what match() would do: committed, not superseded, and not waiting for a save
    to heal a quarantined chunk it (or its chain) reads (``quarantined``). ``broken``:
    Txn.quarantined_users() when the caller lists many (read here otherwise)."""
    parts = t.parts(s.id) if parts is None else parts
    broken = t.quarantined_users() if broken is None else broken  # one probe; empty in a healthy store
    quarantined = bool(broken) and needs_quarantined(t.chain(s.id), broken, leaf=True)
    return SnapshotInfo(
        snapshot_id=s.id, identity=identity, namespace=s.namespace or None, parent_id=s.parent_id,
        n_tokens=s.n_tokens, depth=s.depth, session=s.session, pending=s.state == SnapState.PENDING,
        matchable=bool(s.matchable) and not quarantined and s.imported_from is None, pinned=pinned,
        created=s.created, last_used=s.last_used,
        hits=s.hits,
        logical_bytes=s.logical_bytes, segment_bytes=sum(p.nbytes for p in parts),
        rows={p.name: p.row_end for p in parts if p.kind == PartKind.ROWS},
        components=sorted({p.component for p in parts if p.component is not None}), quarantined=quarantined,
        imported_from=s.imported_from)


def snapshot_infos(t: Txn, identity_key: str) -> list[SnapshotInfo]:
    """Every snapshot of the identity *key* (all namespaces), oldest first."""
    iid = t.identity_id(identity_key)  # by key, in this transaction: never a reused id
    if iid is None:
        return []
    broken = t.quarantined_users()
    return [snapshot_info(t, s, identity_key, t.has_children(s.id), broken=broken) for s in t.snapshots(iid)]


def snapshot_entry(c: Txn, s: SnapRow, keys: dict[int, str], kids: dict[int, list[int]],
                   with_chunks: bool = False, broken: dict[int, bool] | None = None,
                   names: list[str] | None = None) -> SnapshotEntry:
    """inspect's entry for one snapshot: its :func:`snapshot_info` plus parts, chunks and bytes;
    ``names``: the live names that pin it."""
    parts = c.parts(s.id)
    counts: dict[bytes, int] = {}
    rows_by_chunk: dict[bytes, ChunkRow] = {}
    referenced = 0
    part_list: list[PartEntry] = []
    for p in parts:
        chunks = c.part_chunks(s.id, p.name)
        for ch in chunks:
            if ch is not None:
                counts[ch.id] = counts.get(ch.id, 0) + 1
                rows_by_chunk[ch.id] = ch
                referenced += ch.raw_len
        listed = [None if ch is None else ChunkEntry(
            id=ch.id.hex(), raw_len=ch.raw_len, stored_len=ch.stored_len,
            codec=CODEC_NAMES.get(ch.codec, str(ch.codec)), refs=ch.refs) for ch in chunks] if with_chunks else None
        part_list.append(PartEntry(
            name=p.name, kind="rows" if p.kind == PartKind.ROWS else "fixed", dtype=p.dtype, shape=list(p.shape),
            component=p.component, row_start=p.row_start, row_end=p.row_end, nbytes=p.nbytes,
            chunk_count=len(chunks), chunks=listed))
    # exclusive: every reference to the chunk is this snapshot's own (dropping it frees the chunk)
    return SnapshotEntry(
        info=snapshot_info(c, s, keys.get(s.identity_id) or "", bool(kids.get(s.id)), parts, broken),
        children=sorted(kids.get(s.id, [])), base_tokens=s.base_tokens, parts=part_list,
        stored_bytes=sum(ch.stored_len for ch in rows_by_chunk.values()),
        exclusive_bytes=sum(ch.stored_len for cid, ch in rows_by_chunk.items() if ch.refs <= counts[cid]),
        referenced_bytes=referenced, names=list(names or []))


def _identity_fields(ident_id: int, canonical: str) -> dict[str, Any]:
    try:
        return identity_fields(canonical, f"catalog row identities({ident_id}) column canonical")
    except StoreFormatError as e:
        return {"unparsable": str(e)}  # inspect shows the damage and goes on (verify reports it too)


def inspect_store(c: Txn, root: str) -> StoreReport:
    """``snapstore inspect``'s report of the whole store: identities, snapshots, totals."""
    idents = c.identities()
    keys = {i: key for i, key, *_ in idents}
    snaps = c.snapshots()
    kids: dict[int, list[int]] = {}
    for s in snaps:
        if s.parent_id is not None:
            kids.setdefault(s.parent_id, []).append(s.id)
    ids = {s.id for s in snaps}
    broken = c.quarantined_users()
    names: dict[int, list[NameEntry]] = {}
    pins: dict[int, list[str]] = {}  # per snapshot: the live names that pin it
    now = time.time()
    for iid, ns, name, sid, created, expires in c.all_names():  # expired ones too, until removed: shown as such
        names.setdefault(iid, []).append(NameEntry(ns or None, name, sid, created, expires))
        if expires is None or expires > now:
            pins.setdefault(sid, []).append(name)
    entries = [snapshot_entry(c, s, keys, kids, broken=broken, names=pins.get(s.id)) for s in snaps]
    identities = []
    for ident_id, key, canonical, created, last_open in idents:
        mine = [s for s in snaps if s.identity_id == ident_id]
        roots: dict[str, list[int]] = {}  # per namespace: snapshots whose parent is not in the store
        for s in mine:
            bucket = roots.setdefault(s.namespace, [])
            if s.parent_id is None or s.parent_id not in ids:
                bucket.append(s.id)
        identities.append(IdentityEntry(
            key=key, fields=_identity_fields(ident_id, canonical), created=created, last_open=last_open,
            snapshots=len(mine),
            namespaces=[NamespaceEntry(namespace=ns or None, snapshots=sum(1 for s in mine if s.namespace == ns),
                                       roots=sorted(r)) for ns, r in sorted(roots.items())],
            names=names.get(ident_id, [])))
    st = stats_of(c, 0, 0)
    totals = Totals(
        identities=len(idents), snapshots=st.snapshots, entries=st.entries, pending=st.pending, chunks=st.chunks,
        logical_bytes=st.logical_bytes, referenced_bytes=sum(e.referenced_bytes for e in entries),
        stored_bytes=st.stored_bytes, dedup_ratio=round(st.dedup_ratio, 4),
        logical_ratio=round(st.logical_bytes / st.stored_bytes, 4) if st.stored_bytes else 1.0)
    return StoreReport(dir=os.path.abspath(root), identities=identities, snapshots=entries, totals=totals)


def inspect_snapshot(c: Txn, root: str, sid: int) -> SnapshotReport:
    """``snapstore inspect ID``'s report: one snapshot with its parts, chunks and chain."""
    s = c.snapshot(sid)
    if s is None:
        raise NotFoundError(f"no snapshot {sid} in {root} (evicted, superseded, abandoned or never saved)")
    keys = {i: key for i, key, *_ in c.identities()}
    now = time.time()
    pins = [nm for _i, _ns, nm, target, _c, exp in c.all_names() if target == sid and (exp is None or exp > now)]
    entry = snapshot_entry(c, s, keys, {sid: c.children(sid)}, with_chunks=True, names=pins)
    chain = [ChainLink(id=x.id, n_tokens=x.n_tokens, base_tokens=x.base_tokens, pending=x.state == SnapState.PENDING,
                       matchable=bool(x.matchable)) for x in c.chain(sid)]
    return SnapshotReport(dir=os.path.abspath(root), snapshot=entry, chain=chain)


def snapshot_identity(c: Txn, root: str, sid: int) -> Identity:
    """The Identity snapshot ``sid`` was saved under, whichever it is (``Store.identity_of``);
    NotFoundError when the store has no such snapshot, StoreFormatError for a damaged identity row."""
    s = c.snapshot(sid)
    if s is None:
        raise NotFoundError(f"no snapshot {sid} in {root} (evicted, superseded, abandoned or never saved)")
    for ident_id, _key, canonical, *_ in c.identities():
        if ident_id == s.identity_id:
            where = f"catalog row identities({ident_id}) column canonical"
            return Identity.from_dict(identity_fields(canonical, where))
    raise NotFoundError(f"snapshot {sid} in {root} has no identity row (run `snapstore verify`)")


def resolve_identity(c: Txn, key: str) -> str:
    """The identity key *key* names: itself, or the one key it is a prefix of (at least 6 characters)."""
    keys = [k for _i, k, *_ in c.identities()]
    if key in keys:
        return key
    hits = [k for k in keys if k.startswith(key)] if len(key) >= 6 else []
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(keys) or "none"
    raise InvalidInputError(f"no identity {key!r} in the store (known: {known})" if not hits else
                            f"identity prefix {key!r} is ambiguous: {', '.join(hits)}")
