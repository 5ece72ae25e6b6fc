"""Upload to the shared tier: publish a committed local chain as chunk objects, then manifests.

Per chain link, root first: skip if its manifest exists; else write a lease, then every chunk with
a conditional PUT (``If-None-Match: *``: concurrent writers never overwrite, a 412 means "already
there"), then the manifest, also conditional, then drop the lease. A chunk that was already in the
bucket may be an old orphan that a concurrent ``gc --remote`` is deleting: it is checked again once
the gc delete window has passed since the lease was written (the fence), so a manifest never
references a missing chunk. Local chunk files are re-checked against their catalog rows before
they leave the node: local damage is never spread to the fleet.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from snapstore._errors import CorruptionError, RemoteError
from snapstore._identity import Identity
from snapstore.catalog.db import Conn, SnapRow
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    HEADER_SIZE,
    checksum,
    decode_payload,
    header_matches,
    open_chunk,
    parse_header,
)
from snapstore.chunks.repo import Repo
from snapstore.remote.keys import LEASE_TTL, chunk_key, gc_window, lease_key, manifest_key, pause_point
from snapstore.remote.manifest import ChunkEntry, Manifest, PartEntry, encode
from snapstore.remote.s3client import S3Client

__all__ = ["Publisher"]

_Chain = list[tuple[SnapRow, list[tuple[Any, list[Any]]]]]


class _Gone(Exception):
    """A local chunk file or snapshot went away (evicted) during an upload."""


class Publisher:
    """Publishes one store's committed snapshots (their whole chains) to the bucket."""

    def __init__(self, client: S3Client, repo: Repo, identity: Identity, writer: str,
                 scope: Callable[[str], str], count: Callable[[str, int], None], pool: ThreadPoolExecutor):
        self.client = client
        self._repo = repo
        self._identity = identity
        self._writer = writer
        self._scope = scope
        self._count = count
        self._pool = pool

    def _local_chain(self, sid: int) -> _Chain | None:
        def run(c: Conn) -> _Chain | None:
            snap = c.snapshot(sid)
            if snap is None or snap.state != 1:
                return None
            if snap.imported_from is not None:
                return []  # imported under an identity override: a manifest could not carry the mark (never shared)
            out = []
            for link in c.chain(sid):
                parts = [(p, c.part_chunks(link.id, p.name)) for p in c.parts(link.id)]
                out.append((link, parts))
            return out

        return self._repo.db.read(run)

    def publish(self, sid: int) -> None:
        """Publish a committed snapshot's chain: one lease, every missing chunk, the fence, then the
        manifests the bucket lacks, root first (a manifest only after its chunks and its parent)."""
        chain = self._local_chain(sid)
        if chain is None:
            self._count("remote_upload_gone", 1)
            return
        if not chain:
            self._count("remote_upload_override", 1)  # docs/api.md "Export and import": never published
            return
        ns = chain[-1][0].namespace
        scope = self._scope(ns)
        try:
            manifests: list[Manifest] = []
            parent: str | None = None
            for link, parts in chain:
                manifests.append(self._manifest_of(ns, link, parts, parent))
                parent = manifests[-1].name
            present = list(self._pool.map(lambda m: self.client.head(manifest_key(scope, m.name)) is not None,
                                          manifests))
            todo = [m for m, there in zip(manifests, present) if not there]
            if todo:
                self._publish_links(scope, todo)
        except _Gone:
            self._count("remote_upload_gone", 1)
            return
        self._count("remote_uploads", 1)

    def _manifest_of(self, ns: str, link: SnapRow, parts: list[tuple[Any, list[Any]]], parent: str | None) -> Manifest:
        entries = []
        for p, chunks in parts:
            if any(ch is None for ch in chunks):
                raise _Gone()
            entries.append(PartEntry(p.name, p.kind, p.dtype, tuple(p.shape), p.component, p.row_start, p.row_end,
                                     p.nbytes, tuple(ChunkEntry(ch.id, ch.raw_len, ch.stored_len, ch.codec,
                                                                bytes(ch.checksum)) for ch in chunks),
                                     p.tokens_per_row))
        return Manifest(
            identity_key=self._identity.key, identity=self._identity.canonical, namespace=ns,
            n_tokens=link.n_tokens, base_tokens=link.base_tokens, token_width=link.token_width,
            tokens=bytes(link.tokens), anchor=bytes(link.anchor), prefix_key=bytes(link.prefix_key),
            content_key=bytes(link.content_key), parent=parent, matchable=bool(link.matchable),
            logical_bytes=link.logical_bytes, created=time.time(), writer=self._writer, parts=tuple(entries))

    def _publish_links(self, scope: str, todo: list[Manifest]) -> None:
        entries = {ch.id: ch for m in todo for p in m.parts for ch in p.chunks}
        lease = lease_key(self._writer, secrets.token_hex(8))
        body = json.dumps({"writer": self._writer, "scope": scope, "manifests": [m.name for m in todo],
                           "chunks": sorted(c.hex() for c in entries)}, sort_keys=True).encode()
        self.client.put(lease, body)
        t0 = time.monotonic()
        window = gc_window()
        info = self.client.head(lease)  # the server's clock at t0
        young_after = (info.modified - window) if info is not None else float("inf")
        try:
            def one(e: ChunkEntry) -> bytes | None:
                key = chunk_key(scope, e.id)
                there = self.client.head(key)
                if there is not None:
                    # an old one may be an orphan a gc is deleting; one written less than a window before
                    # our lease is younger than any gc's minimum age until that gc's deletes are over
                    return e.id if there.modified < young_after else None
                if self.client.put_new(key, self._read_local(e)):  # False: a concurrent writer, just now
                    self._count("remote_chunks_put", 1)
                return None

            old = [cid for cid in self._pool.map(one, list(entries.values())) if cid is not None]
            pause_point("after_heads")
            if time.monotonic() - t0 > LEASE_TTL / 2:
                old = list(entries)  # the lease may have expired for a gc: check everything
            if old:
                # the fence: any gc that listed the leases before ours existed has stopped deleting by now
                pause = t0 + 2 * window - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                for cid in old:
                    if self.client.head(chunk_key(scope, cid)) is None:  # a gc removed it meanwhile
                        if self.client.put_new(chunk_key(scope, cid), self._read_local(entries[cid])):
                            self._count("remote_chunks_put", 1)
                        self._count("remote_fence_republished", 1)
            pause_point("before_manifest")
            for m in todo:  # root first: a manifest's parent is in the bucket before it
                if self.client.put_new(manifest_key(scope, m.name), encode(m)):
                    self._count("remote_manifests_put", 1)
        finally:
            try:
                self.client.delete([lease])
            except RemoteError:
                pass  # an expired lease protects nothing; gc removes it

    def _read_local(self, e: ChunkEntry) -> bytes:
        """The local chunk file's bytes, checked against its catalog row (never publish damage)."""
        try:
            fd, _ = open_chunk(self._repo.blob_path(e.id))
        except (OSError, CorruptionError):
            raise _Gone() from None
        try:
            data = bytearray(os.fstat(fd).st_size)
            view = memoryview(data)
            done = 0
            while done < len(data):
                n = os.readv(fd, [view[done:]])
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        try:
            head = parse_header(bytes(view[:HEADER_SIZE]))
        except CorruptionError:
            raise _Gone() from None
        if done != len(data) or not header_matches(head, e.raw_len, e.checksum, len(data)):
            raise _Gone()
        if head.codec == CODEC_RAW:
            raw: memoryview = view[HEADER_SIZE:]
        else:
            raw = memoryview(bytearray(head.raw_len))
            decode_payload(head, view[HEADER_SIZE:], raw)
        if checksum(raw) != e.checksum:
            self._count("remote_local_damage", 1)
            raise _Gone()  # local damage: verify quarantines it; never spread it to the fleet
        return bytes(data)
