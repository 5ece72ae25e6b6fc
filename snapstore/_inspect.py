"""What a store holds, described once: snapshot infos (``Store.snapshots()``), stats, and the reports
``snapstore inspect`` renders (the CLI only parses and renders)."""

from __future__ import annotations

import json
import os
from typing import Any

from ._catalog import PartKind, PartRow, SnapRow, SnapState, Txn
from ._chunkfile import CODEC_NAMES
from ._errors import NotFoundError
from ._results import SnapshotInfo, Stats

__all__ = ["FORMAT", "inspect_all", "inspect_one", "snapshot_entry", "snapshot_info", "snapshot_infos", "stats_of"]

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
        quarantined=quarantined, healed=counters.get("healed", 0), detached=counters.get("detached", 0))


def snapshot_info(t: Txn, s: SnapRow, identity: str, pinned: bool, parts: list[PartRow] | None = None
                  ) -> SnapshotInfo:
    """The one description of a snapshot (Store.snapshots() lists these; inspect extends them)."""
    parts = t.parts(s.id) if parts is None else parts
    return SnapshotInfo(
        snapshot_id=s.id, identity=identity, namespace=s.namespace or None, parent_id=s.parent_id,
        n_tokens=s.n_tokens, depth=s.depth, session=s.session, pending=s.state == SnapState.PENDING,
        matchable=bool(s.matchable), pinned=pinned, created=s.created, last_used=s.last_used, hits=s.hits,
        logical_bytes=s.logical_bytes, segment_bytes=sum(p.nbytes for p in parts),
        rows={p.name: p.row_end for p in parts if p.kind == PartKind.ROWS},
        components=sorted({p.component for p in parts if p.component is not None}))


def snapshot_infos(t: Txn, identity_key: str) -> list[SnapshotInfo]:
    """Every snapshot of the identity *key* (all namespaces), oldest first."""
    iid = t.identity_id(identity_key)  # by key, in this transaction: never a reused id
    if iid is None:
        return []
    return [snapshot_info(t, s, identity_key, t.has_children(s.id)) for s in t.snapshots(iid)]


def snapshot_entry(c: Txn, s: SnapRow, keys: dict[int, str], kids: dict[int, list[int]],
                   with_chunks: bool = False) -> dict[str, Any]:
    """inspect's entry for one snapshot: its :func:`snapshot_info` plus parts, chunks and bytes."""
    parts = c.parts(s.id)
    counts: dict[bytes, int] = {}
    rows_by_chunk: dict[bytes, Any] = {}
    part_list: list[dict[str, Any]] = []
    for p in parts:
        chunks = c.part_chunks(s.id, p.name)
        entry: dict[str, Any] = {
            "name": p.name, "kind": "rows" if p.kind == PartKind.ROWS else "fixed", "dtype": p.dtype,
            "shape": list(p.shape),
            "component": p.component, "row_start": p.row_start, "row_end": p.row_end, "nbytes": p.nbytes,
            "chunk_count": len(chunks)}
        listed: list[dict[str, Any] | None] = []
        for ch in chunks:
            if ch is None:
                listed.append(None)
                continue
            counts[ch.id] = counts.get(ch.id, 0) + 1
            rows_by_chunk[ch.id] = ch
            listed.append({"id": ch.id.hex(), "raw_len": ch.raw_len, "stored_len": ch.stored_len,
                           "codec": CODEC_NAMES.get(ch.codec, str(ch.codec)), "refs": ch.refs})
        if with_chunks:
            entry["chunks"] = listed
            entry["missing_chunk_rows"] = sum(1 for x in listed if x is None)
        part_list.append(entry)
    stored = sum(ch.stored_len for ch in rows_by_chunk.values())
    exclusive = sum(ch.stored_len for cid, ch in rows_by_chunk.items() if ch.refs <= counts[cid])
    info = snapshot_info(c, s, keys.get(s.identity_id) or "", bool(kids.get(s.id)), parts)
    d: dict[str, Any] = {
        "id": s.id, "identity": keys.get(s.identity_id), "namespace": info.namespace,
        "parent_id": s.parent_id, "children": sorted(kids.get(s.id, [])), "depth": s.depth,
        "n_tokens": s.n_tokens, "base_tokens": s.base_tokens, "rows": info.rows, "components": info.components,
        "parts": [p.name for p in parts],
        "logical_bytes": s.logical_bytes, "segment_bytes": info.segment_bytes,
        "stored_bytes": stored, "exclusive_bytes": exclusive,
        "pinned": info.pinned, "pending": info.pending, "matchable": info.matchable,
        "session": s.session, "created": s.created, "last_used": s.last_used, "hits": s.hits,
    }
    if with_chunks:
        d["part_details"] = part_list
    return d


def _identity_fields(canonical: str) -> dict[str, Any]:
    try:
        fields = json.loads(canonical)
    except ValueError:
        return {"unparsable": canonical}
    return fields if isinstance(fields, dict) else {"value": fields}


def inspect_all(c: Txn, root: str) -> dict[str, Any]:
    """``snapstore inspect``'s report of the whole store: identities, snapshots, totals."""
    idents = c.identities()
    keys = {i: key for i, key, *_ in idents}
    snaps = c.snapshots()
    kids: dict[int, list[int]] = {}
    for s in snaps:
        if s.parent_id is not None:
            kids.setdefault(s.parent_id, []).append(s.id)
    ids = {s.id for s in snaps}
    entries = [snapshot_entry(c, s, keys, kids) for s in snaps]
    identities = []
    for ident_id, key, canonical, created, last_open in idents:
        mine = [s for s in snaps if s.identity_id == ident_id]
        namespaces: dict[str, list[int]] = {}
        for s in mine:
            bucket = namespaces.setdefault(s.namespace, [])
            if s.parent_id is None or s.parent_id not in ids:
                bucket.append(s.id)
        identities.append({
            "key": key, "fields": _identity_fields(canonical), "created": created, "last_open": last_open,
            "snapshots": len(mine),
            "namespaces": [{"namespace": ns or None, "snapshots": sum(1 for s in mine if s.namespace == ns),
                            "roots": sorted(r)} for ns, r in sorted(namespaces.items())]})
    st = stats_of(c, 0, 0)
    referenced = sum(ch.raw_len for s in snaps for p in c.parts(s.id)
                     for ch in c.part_chunks(s.id, p.name) if ch is not None)
    totals = {
        "identities": len(idents), "snapshots": st.snapshots, "entries": st.entries, "pending": st.pending,
        "chunks": st.chunks, "logical_bytes": st.logical_bytes, "referenced_bytes": referenced,
        "stored_bytes": st.stored_bytes, "dedup_ratio": round(st.dedup_ratio, 4),
        "logical_ratio": round(st.logical_bytes / st.stored_bytes, 4) if st.stored_bytes else 1.0,
    }
    return {"format": FORMAT, "command": "inspect", "dir": os.path.abspath(root), "identities": identities,
            "snapshots": entries, "totals": totals}


def inspect_one(c: Txn, root: str, sid: int) -> dict[str, Any]:
    """``snapstore inspect ID``'s report: one snapshot with its parts, chunks and chain."""
    s = c.snapshot(sid)
    if s is None:
        raise NotFoundError(f"no snapshot {sid} in {root} (evicted, superseded, abandoned or never saved)")
    keys = {i: key for i, key, *_ in c.identities()}
    kids = {sid: c.children(sid)}
    entry = snapshot_entry(c, s, keys, kids, with_chunks=True)
    entry["parts"] = entry.pop("part_details")
    entry["chain"] = [{"id": x.id, "n_tokens": x.n_tokens, "base_tokens": x.base_tokens,
                       "pending": x.state == SnapState.PENDING,
                       "matchable": bool(x.matchable)} for x in c.chain(sid)]
    return {"format": FORMAT, "command": "inspect", "dir": os.path.abspath(root), "snapshot": entry}
