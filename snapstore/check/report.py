"""The values ``snapstore inspect`` reports, each with ``to_dict()`` (its JSON, docs/cli.md format 1).

Built by :mod:`snapstore.check.inspect` from the catalog; the CLI only wraps a ``to_dict()`` in the
``format``/``command`` envelope or renders it as text. A snapshot's own description is the
:class:`~snapstore.SnapshotInfo` that ``Store.snapshots()`` lists; :class:`SnapshotEntry` adds only
what inspect knows beyond it (children, parts, chunks, stored bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from snapstore._results import SnapshotInfo

__all__ = ["ChainLink", "ChunkEntry", "IdentityEntry", "NameEntry", "NamespaceEntry", "PartEntry", "SnapshotEntry",
           "SnapshotReport", "StoreReport", "Totals"]


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One chunk a part references (``id`` as 64 hex digits, ``codec`` by name)."""

    id: str
    raw_len: int
    stored_len: int
    codec: str
    refs: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {"id": self.id, "raw_len": self.raw_len, "stored_len": self.stored_len, "codec": self.codec,
                "refs": self.refs}


@dataclass(frozen=True, slots=True)
class PartEntry:
    """One part of a snapshot. ``chunks`` (None where the chunk row is missing) only in detail reports."""

    name: str
    kind: str  # "rows" or "fixed"
    dtype: str
    shape: list[int]
    component: str | None
    row_start: int
    row_end: int
    nbytes: int
    chunk_count: int
    chunks: list[ChunkEntry | None] | None = None  # None: not listed (the store overview)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (``inspect ID``'s part objects)."""
        d: dict[str, Any] = {
            "name": self.name, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
            "component": self.component, "row_start": self.row_start, "row_end": self.row_end,
            "nbytes": self.nbytes, "chunk_count": self.chunk_count}
        if self.chunks is not None:
            d["chunks"] = [None if ch is None else ch.to_dict() for ch in self.chunks]
            d["missing_chunk_rows"] = sum(1 for ch in self.chunks if ch is None)
        return d


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """One snapshot as inspect shows it: its :class:`SnapshotInfo` plus tree, parts and stored bytes."""

    info: SnapshotInfo
    children: list[int]
    base_tokens: int
    parts: list[PartEntry]
    stored_bytes: int  # on-disk bytes of the chunks its parts reference, each once
    exclusive_bytes: int  # of those, the chunks no other snapshot references
    referenced_bytes: int  # raw bytes its parts reference, per reference (summed into the totals; not in the JSON)
    names: list[str] = field(default_factory=list)  # the live names that pin it (Store.name), any namespace

    def to_dict(self, detail: bool = False) -> dict[str, Any]:
        """The JSON ``SNAPSHOT`` object; ``detail``: ``parts`` as objects (``inspect ID``), else names."""
        i = self.info
        return {
            "id": i.snapshot_id, "identity": i.identity or None, "namespace": i.namespace,
            "parent_id": i.parent_id, "children": list(self.children), "depth": i.depth,
            "n_tokens": i.n_tokens, "base_tokens": self.base_tokens, "rows": dict(i.rows),
            "components": list(i.components),
            "parts": [p.to_dict() for p in self.parts] if detail else [p.name for p in self.parts],
            "logical_bytes": i.logical_bytes, "segment_bytes": i.segment_bytes,
            "stored_bytes": self.stored_bytes, "exclusive_bytes": self.exclusive_bytes,
            # "pinned" is kept for scripts and means has_children (issue 46 item 14): what pins is a name
            "pinned": i.pinned, "has_children": bool(self.children), "names": list(self.names),
            "pending": i.pending, "matchable": i.matchable, "quarantined": i.quarantined,
            "imported_from": i.imported_from,
            "session": i.session, "created": i.created, "last_used": i.last_used, "hits": i.hits,
        }


@dataclass(frozen=True, slots=True)
class NamespaceEntry:
    """One namespace of an identity: how many snapshots, and the roots of its trees."""

    namespace: str | None  # None: the default namespace
    snapshots: int
    roots: list[int]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {"namespace": self.namespace, "snapshots": self.snapshots, "roots": list(self.roots)}


@dataclass(frozen=True, slots=True)
class NameEntry:
    """One name of a snapshot (``Store.name``): where it lives, what it pins, until when."""

    namespace: str | None  # None: the default namespace
    name: str
    snapshot_id: int
    created: float
    expires: float | None  # None: never

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {"namespace": self.namespace, "name": self.name, "snapshot_id": self.snapshot_id,
                "created": self.created, "expires": self.expires}


@dataclass(frozen=True, slots=True)
class IdentityEntry:
    """One identity row: its key, its canonical fields parsed, and its namespaces."""

    key: str
    fields: dict[str, Any]
    created: float
    last_open: float
    snapshots: int
    namespaces: list[NamespaceEntry]
    names: list[NameEntry] = field(default_factory=list)  # Store.name's names, by namespace and name

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {"key": self.key, "fields": dict(self.fields), "created": self.created,
                "last_open": self.last_open, "snapshots": self.snapshots,
                "namespaces": [n.to_dict() for n in self.namespaces], "names": [n.to_dict() for n in self.names]}


@dataclass(frozen=True, slots=True)
class Totals:
    """The store's totals (docs/cli.md: entries, referenced vs stored, the two ratios)."""

    identities: int
    snapshots: int
    entries: int
    pending: int
    chunks: int
    logical_bytes: int
    referenced_bytes: int
    stored_bytes: int
    dedup_ratio: float
    logical_ratio: float

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {"identities": self.identities, "snapshots": self.snapshots, "entries": self.entries,
                "pending": self.pending, "chunks": self.chunks, "logical_bytes": self.logical_bytes,
                "referenced_bytes": self.referenced_bytes, "stored_bytes": self.stored_bytes,
                "dedup_ratio": self.dedup_ratio, "logical_ratio": self.logical_ratio}


@dataclass(frozen=True, slots=True)
class StoreReport:
    """``snapstore inspect``: every identity, every snapshot, the totals."""

    dir: str
    identities: list[IdentityEntry]
    snapshots: list[SnapshotEntry]
    totals: Totals

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (the CLI adds ``format`` and ``command``)."""
        return {"dir": self.dir, "identities": [i.to_dict() for i in self.identities],
                "snapshots": [s.to_dict() for s in self.snapshots], "totals": self.totals.to_dict()}


@dataclass(frozen=True, slots=True)
class ChainLink:
    """One snapshot of a chain, root first."""

    id: int
    n_tokens: int
    base_tokens: int
    pending: bool
    matchable: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {"id": self.id, "n_tokens": self.n_tokens, "base_tokens": self.base_tokens,
                "pending": self.pending, "matchable": self.matchable}


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """``snapstore inspect ID``: one snapshot with its parts' chunks and its chain from the root."""

    dir: str
    snapshot: SnapshotEntry
    chain: list[ChainLink]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (the CLI adds ``format`` and ``command``)."""
        return {"dir": self.dir,
                "snapshot": {**self.snapshot.to_dict(detail=True), "chain": [x.to_dict() for x in self.chain]}}
