"""Maintenance of the shared tier: verify, gc (orphans, broken chains, the byte budget), stats, inspect.

These list the whole prefix (never on an engine's hot path) and read the manifests through a
bounded pool (``scan_width()`` at once, the listing order and findings unchanged). Ages are measured on the server's
clock (a probe object's LastModified), so a node with a skewed clock cannot make gc delete early.

gc --remote, in this order: list the leases, then the manifests, the last-use markers and the
chunks. A manifest is kept when it parses, its parent is kept and every chunk it references is
present; others (and their descendants) are removed once older than the grace. Over the byte
budget, least-recently-used leaf manifests (last use = the newer of the manifest and its use
marker) are removed until the chunks the kept manifests reference fit. A chunk object is removed
when no kept manifest and no live lease references it and it is older than the grace (at least
twice the gc delete window, plus a second for LastModified's resolution). Deletes stop
``gc_window()`` seconds after the leases were listed unless the leases are listed again: together
with the uploaders' fence this keeps a chunk that a live upload relies on (see remote.tier).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3

from snapstore._errors import CorruptionError
from snapstore.chunks.chunkfile import CODEC_RAW, HEADER_SIZE, checksum_stream, decode_payload, parse_header, scope_key
from snapstore.remote.keys import LEASE_TTL, chunk_key, gc_window, manifest_key, use_key
from snapstore.remote.s3client import S3Client
from snapstore.remote.scan import Scan, find_damage, list_leases, scan_bucket

__all__ = ["RemoteGcReport", "RemoteVerifyReport", "gc_remote", "inspect_remote", "stats_remote", "verify_remote"]


def _check_chunk(client: S3Client, scope: str, cid: str, keys: set[bytes]) -> str | None:
    """Re-read one chunk object: None if it is intact, else what is wrong. ``keys``: the address keys
    its referencing parts allow (v2: identity, namespace, the part's dtype and shape; v1: the scope)."""
    got = client.stream(chunk_key(scope, bytes.fromhex(cid)))
    if got is None:
        return "missing"
    _size, pieces = got
    data = bytearray()
    for piece in pieces:
        data += piece
    try:
        head = parse_header(bytes(data[:HEADER_SIZE]))
    except CorruptionError as e:
        return str(e)
    if len(data) != HEADER_SIZE + head.payload_len:
        return "size does not match its header"
    raw: Any = memoryview(data)[HEADER_SIZE:]
    if head.codec != CODEC_RAW:
        out = memoryview(bytearray(head.raw_len))
        try:
            decode_payload(head, raw, out)
        except CorruptionError as e:
            return str(e)
        raw = out
    h = checksum_stream()
    h.update(raw)
    if h.digest() != head.checksum:
        return "checksum mismatch"
    if not any(blake3.blake3(raw, key=k).hexdigest() == cid for k in keys | {bytes.fromhex(scope)}):
        return "content does not match its address"
    return None


@dataclass
class RemoteVerifyReport:
    """What verify --remote found; ``ok`` when nothing is damaged (orphans are gc's, not damage)."""

    url: str
    deep: bool
    manifests: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    damaged_manifests: list[dict[str, str]] = field(default_factory=list)
    missing_chunks: list[str] = field(default_factory=list)
    corrupt_chunks: list[dict[str, str]] = field(default_factory=list)
    orphan_chunks: int = 0
    live_leases: int = 0
    repaired: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every manifest is restorable and every referenced chunk intact."""
        return not self.damaged_manifests and not self.missing_chunks and not self.corrupt_chunks

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (stable keys, docs/cli.md)."""
        return {**asdict(self), "ok": self.ok}


def verify_remote(client: S3Client, *, deep: bool = False, repair: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> RemoteVerifyReport:
    """Check the shared tier: manifests parse and chain, chunks present (``deep``: re-hashed)."""
    s = scan_bucket(client)
    bad, missing = find_damage(s)
    referenced = {(scope, ch.id.hex()) for (scope, _n), (m, _i, _w) in s.manifests.items() if m is not None
                  for p in m.parts for ch in p.chunks}
    rep = RemoteVerifyReport(client.url, deep, manifests=len(s.manifests), chunks=len(s.chunks),
                             chunk_bytes=sum(i.size for i in s.chunks.values()),
                             missing_chunks=sorted(f"{k[0][:12]}/{k[1]}" for k in missing),
                             orphan_chunks=len(set(s.chunks) - referenced),
                             live_leases=sum(1 for info, _ in s.leases if s.server_now - info.modified < LEASE_TTL))
    corrupt: set[tuple[str, str]] = set()
    if deep:
        keys: dict[tuple[str, str], set[bytes]] = {}
        for (scope, _n), (m, _i, _w) in s.manifests.items():
            if m is not None:
                for p in m.parts:
                    k = scope_key(m.identity_key, m.namespace, p.dtype, p.shape)
                    for ch in p.chunks:
                        keys.setdefault((scope, ch.id.hex()), set()).add(k)
        todo = sorted(referenced & set(s.chunks))
        for i, (scope, cid) in enumerate(todo):
            why = _check_chunk(client, scope, cid, keys.get((scope, cid), set()))
            if why is not None:
                corrupt.add((scope, cid))
                rep.corrupt_chunks.append({"chunk": f"{scope[:12]}/{cid}", "reason": why})
            if progress is not None:
                progress(i + 1, len(todo))
        for key, (m, _i, _w) in s.manifests.items():
            if m is not None and key not in bad and any((key[0], ch.id.hex()) in corrupt for ch in
                                                        (c for p in m.parts for c in p.chunks)):
                bad[key] = "references a corrupt chunk"
        if corrupt:
            bad.update(_descendants(s, bad))
    rep.damaged_manifests = [{"manifest": f"{k[0][:12]}/{k[1]}", "reason": why} for k, why in sorted(bad.items())]
    if repair and (bad or corrupt):
        for scope, name in sorted(bad):
            client.delete([manifest_key(scope, name), use_key(scope, name)])
            rep.repaired.append(f"manifest {scope[:12]}/{name}")
        for scope, cid in sorted(corrupt):
            client.delete([chunk_key(scope, bytes.fromhex(cid))])
            rep.repaired.append(f"chunk {scope[:12]}/{cid}")
    return rep


def _descendants(s: Scan, bad: dict[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    out = dict(bad)
    changed = True
    while changed:
        changed = False
        for key, (m, _i, _w) in s.manifests.items():
            if key not in out and m is not None and m.parent is not None and (key[0], m.parent) in out:
                out[key] = f"ancestor {m.parent} is damaged"
                changed = True
    return out


@dataclass
class RemoteGcReport:
    """What gc --remote removed (or, with dry_run, would remove)."""

    url: str
    dry_run: bool
    grace: float
    budget_bytes: int | None
    evicted_manifests: list[str] = field(default_factory=list)
    broken_manifests: list[str] = field(default_factory=list)
    chunks_removed: int = 0
    leases_removed: int = 0
    bytes_freed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    kept_for_leases: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (stable keys, docs/cli.md)."""
        return asdict(self)


def gc_remote(client: S3Client, *, grace: float = 3600.0, budget_bytes: int | None = None,
              lease_ttl: float = LEASE_TTL, dry_run: bool = False) -> RemoteGcReport:
    """Remove broken manifests, LRU leaves over the budget, unreferenced old chunks, stale leases."""
    window = gc_window()
    t_leases = time.monotonic()
    s = scan_bucket(client)
    t_scan = time.monotonic()
    min_age = max(grace, 2 * window) + 1.0  # + LastModified's one-second resolution
    rep = RemoteGcReport(client.url, dry_run, grace, budget_bytes,
                         bytes_before=sum(i.size for i in s.chunks.values()))
    protected: set[tuple[str, str]] = set()
    stale: list[str] = []
    for info, lease_refs in s.leases:
        if s.server_now - info.modified < lease_ttl:
            protected |= lease_refs
        else:
            stale.append(info.key)
    bad, _missing = find_damage(s)
    doomed = [k for k in bad if s.server_now - s.manifests[k][1].modified > min_age]
    keep = {k: m for k, (m, _i, _w) in s.manifests.items() if m is not None and k not in bad}
    # the budget: LRU leaves of the kept manifests until the chunks they reference fit
    refs: dict[tuple[str, str], int] = {}
    for (scope, _n), m in keep.items():
        for cid in {ch.id.hex() for p in m.parts for ch in p.chunks}:
            refs[(scope, cid)] = refs.get((scope, cid), 0) + 1
    used = sum(s.chunks[k].size for k in refs if k in s.chunks)
    evicted: list[tuple[str, str]] = []
    if budget_bytes is not None and used > budget_bytes:
        children: dict[tuple[str, str], int] = {}
        for (scope, _n), m in keep.items():
            if m.parent is not None:
                children[(scope, m.parent)] = children.get((scope, m.parent), 0) + 1

        def last_use(k: tuple[str, str]) -> float:
            return max(s.manifests[k][1].modified, s.uses.get(k, 0.0))

        while used > budget_bytes:
            leaves = [k for k in keep if not children.get(k)]
            if not leaves:
                break
            victim = min(leaves, key=lambda k: (last_use(k), k))
            m = keep.pop(victim)
            evicted.append(victim)
            if m.parent is not None:
                children[(victim[0], m.parent)] -= 1
            for cid in {ch.id.hex() for p in m.parts for ch in p.chunks}:
                k = (victim[0], cid)
                refs[k] -= 1
                if refs[k] == 0:
                    del refs[k]
                    used -= s.chunks[k].size if k in s.chunks else 0
    live = set(refs) | protected
    candidates = [k for k, info in s.chunks.items() if k not in live and s.server_now - info.modified > min_age]
    rep.kept_for_leases = sum(1 for k in s.chunks if k in protected and k not in refs)
    rep.evicted_manifests = [f"{k[0][:12]}/{k[1]}" for k in evicted]
    rep.broken_manifests = [f"{k[0][:12]}/{k[1]}" for k in doomed]
    if not dry_run:
        for scope, name in [*doomed, *evicted]:
            client.delete([manifest_key(scope, name), use_key(scope, name)])
    for k in candidates:
        if not dry_run:
            if time.monotonic() - t_leases > window:  # past the delete window: look at the leases again
                t_leases = time.monotonic()
                now = s.server_now + (t_leases - t_scan)
                for info, lrefs in list_leases(client):
                    if now - info.modified < lease_ttl:
                        protected |= lrefs
            if k in protected:
                rep.kept_for_leases += 1
                continue
            client.delete([chunk_key(k[0], bytes.fromhex(k[1]))])
        rep.chunks_removed += 1
        rep.bytes_freed += s.chunks[k].size
    if not dry_run:
        client.delete(stale)
    rep.leases_removed = len(stale)
    rep.bytes_after = rep.bytes_before - rep.bytes_freed
    return rep


def stats_remote(client: S3Client) -> dict[str, Any]:
    """Totals of the shared tier (one listing; manifests are not read)."""
    s = scan_bucket(client, with_manifests=False)
    scopes = {k[0] for k in s.manifests} | {k[0] for k in s.chunks}
    return {"url": client.url, "scopes": len(scopes), "manifests": len(s.manifests), "chunks": len(s.chunks),
            "chunk_bytes": sum(i.size for i in s.chunks.values()), "leases": len(s.leases),
            "use_markers": len(s.uses)}


def inspect_remote(client: S3Client) -> dict[str, Any]:
    """Every scope of the shared tier: its identity, namespace and chains (parents, tokens, bytes, last use)."""
    s = scan_bucket(client)
    by_scope: dict[str, list[dict[str, Any]]] = {}
    idents: dict[str, tuple[str, str, str]] = {}
    for (scope, name), (m, info, why) in sorted(s.manifests.items()):
        entry: dict[str, Any] = {"manifest": name, "modified": info.modified,
                                 "last_used": max(info.modified, s.uses.get((scope, name), 0.0))}
        if m is None:
            entry["damaged"] = why
        else:
            idents[scope] = (m.identity_key, m.identity, m.namespace)
            entry.update(n_tokens=m.n_tokens, base_tokens=m.base_tokens, parent=m.parent, matchable=m.matchable,
                         logical_bytes=m.logical_bytes, chunks=len(m.chunk_ids),
                         stored_bytes=sum(ch.stored_len for p in m.parts for ch in p.chunks), writer=m.writer)
        by_scope.setdefault(scope, []).append(entry)
    scopes = []
    for scope, entries in by_scope.items():
        key, canonical, ns = idents.get(scope, ("?", "{}", ""))
        scopes.append({"scope": scope, "identity": key, "identity_fields": json.loads(canonical),
                       "namespace": ns or None,
                       "manifests": sorted(entries, key=lambda e: (e.get("n_tokens", 0), e["manifest"]))})
    return {"url": client.url, "scopes": scopes, "chunks": len(s.chunks),
            "chunk_bytes": sum(i.size for i in s.chunks.values()), "leases": len(s.leases)}
