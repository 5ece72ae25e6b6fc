"""Fetch a shared-tier chain into the local tier: every missing chunk checked, then one transaction.

Every chunk of the chain the local tier lacks is streamed into ``tmp/`` (a few in parallel),
checked as it arrives (:class:`ChunkCheck`: size, header, XXH3-128, keyed BLAKE3 = its id),
fsynced and published as a local chunk file; then one transaction adds their rows and inserts the
chain (reusing local links of equal prefix and content) with its block-granular prefix index
(``row_prefixes``, for ``tokens_per_row`` layouts, as a local save records it), evicting local
LRU leaves to the budget. A tee restore (``remote.tee``) hands in the checked object bytes it
already holds (``given``): those are checked again (address included) and written, not fetched.
A chain that does not fit even then raises :class:`NoRoom` with nothing imported (the caller
streams instead).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from snapstore._errors import CorruptionError, RemoteError, RestoreError, SnapshotUnavailableError
from snapstore._identity import Identity
from snapstore._layout import Layout
from snapstore._tokens import decode_tokens
from snapstore.catalog.db import Conn
from snapstore.catalog.find_keys import find_keys, stored_key
from snapstore.chunks.chunkfile import HEADER_SIZE, header_at, header_matches, scope_key
from snapstore.chunks.publish import TEMP_PREFIX, fsync_dirs, link_new
from snapstore.chunks.repo import Repo
from snapstore.chunks.settle import held, settle
from snapstore.lifecycle.eviction import evict_until
from snapstore.plan.prefix import record_prefixes
from snapstore.remote.check import BadObject, ChunkCheck, corrupt
from snapstore.remote.find_chain import RemoteHit
from snapstore.remote.keys import chunk_key, pause_point
from snapstore.remote.manifest import ChunkEntry
from snapstore.remote.s3client import S3Client

__all__ = ["Fetcher", "NoRoom", "fetch_failed", "open_object"]


class NoRoom(Exception):
    """The chain does not fit the local budget even after evicting unpinned leaves; nothing was imported."""


class _Retry(Exception):
    pass


def fetch_failed(e: ChunkEntry, err: object, touched: bool = False) -> SnapshotUnavailableError:
    """The error a restore raises when the bucket fails mid-fetch."""
    outcome = "the destination was partly written: re-read the prompt" if touched else "nothing was written"
    return SnapshotUnavailableError(f"fetching chunk {e.id.hex()} from the shared tier failed ({err}); {outcome}",
                                    touched=touched)


def read_error(e: ChunkEntry, kind: str, why: str, count: Callable[[str, int], None],
               touched: bool) -> RestoreError:
    """The one error for a chunk a streamed or tee'd restore could not use: ``kind`` "corrupt" (counted),
    "remote" (the bucket failed) or "missing" (removed by gc or lost); says whether ``touched``."""
    if kind == "corrupt":
        return corrupt(e, why, count, touched)
    if kind == "remote":
        return fetch_failed(e, why, touched)
    outcome = "the destination was partly written: re-read the prompt" if touched else "nothing was written"
    return SnapshotUnavailableError(f"chunk {e.id.hex()} is missing from the shared tier (removed by gc or lost); "
                                    + outcome, touched=touched)


def open_object(client: S3Client, scope: str, e: ChunkEntry) -> tuple[int, Iterator[memoryview]]:
    """(size, piece iterator) of a chunk object; SnapshotUnavailableError when it fails or is missing."""
    pause_point("fetch")
    try:
        got = client.stream(chunk_key(scope, e.id))
    except RemoteError as err:
        raise fetch_failed(e, err) from None
    if got is None:
        raise SnapshotUnavailableError(f"chunk {e.id.hex()} is missing from the shared tier (removed by gc or "
                                       "lost); nothing was written")
    return got


class Fetcher:
    """Imports shared-tier chains into one store's local tier."""

    def __init__(self, client: S3Client, repo: Repo, identity: Identity, count: Callable[[str, int], None],
                 pool: ThreadPoolExecutor):
        self.client = client
        self._repo = repo
        self._identity = identity
        self._count = count
        self._pool = pool

    def missing(self, hit: RemoteHit) -> list[ChunkEntry]:
        """The chain's chunks the local tier does not hold: no row, a quarantined row, or a row whose
        file is lost or damaged (its header does not vouch for the row) — each fetched and settled
        (the row healed) as a save would, never trusted from the row alone (issue 46 item 6)."""
        needed = {ch.id: ch for mf in hit.chain for p in mf.parts for ch in p.chunks}
        path = self._repo.blob_path
        have = self._repo.db.read(lambda c: {cid for cid in needed if held(c, cid, path(cid)) is not None})
        return [e for cid, e in needed.items() if cid not in have]

    def materialize(self, hit: RemoteHit, fits: Callable[[Conn, list[bytes]], bool],
                    identity_id: Callable[[Conn], int], layout: Layout,
                    given: Mapping[bytes, Sequence[memoryview]] | None = None, protect: Set[int] = frozenset()) -> int:
        """Fetch the chain's missing chunks (each checked; ``given``: object bytes already read, by
        chunk id) and insert the chain locally; its leaf's id. ``protect``: local snapshots its room
        is never made by evicting (a batch's other requests)."""
        for _attempt in range(3):
            try:
                return self._once(hit, fits, identity_id, layout, given or {}, protect)
            except _Retry:
                given = None  # what was handed in went into files the catalog would not adopt: fetch
                continue
        raise SnapshotUnavailableError("the local tier kept evicting the fetched chunks; nothing was written")

    def _once(self, hit: RemoteHit, fits: Callable[[Conn, list[bytes]], bool],
              identity_id: Callable[[Conn], int], layout: Layout, given: Mapping[bytes, Sequence[memoryview]],
              protect: Set[int]) -> int:
        needed: dict[bytes, ChunkEntry] = {ch.id: ch for mf in hit.chain for p in mf.parts for ch in p.chunks}
        # a chunk's address is keyed by its part's dtype and shape (v2), or by the identity and
        # namespace alone for chunks a store wrote before v2: the fetch accepts either, never another
        keys = {ch.id: (scope_key(self._identity.key, hit.namespace, p.dtype, p.shape),
                        scope_key(self._identity.key, hit.namespace))
                for mf in hit.chain for p in mf.parts for ch in p.chunks}
        todo = self.missing(hit)
        # the files that did arrive before an error are orphans until a row references them: gc collects them
        results = list(self._pool.map(lambda e: self._fetch(hit.scope, keys[e.id], e, given.get(e.id)), todo))
        created = [cid for cid, new, _key in results if new]
        used = {cid: key for cid, _new, key in results}
        fsync_dirs({os.path.dirname(self._repo.blob_path(e.id)) for e in todo})
        now = time.time()
        ns = hit.namespace
        # each link's tokens from 0 (the prefix index names a snapshot's tokens [0, n) exactly), and their
        # find keys, computed once for every link: the catalog decodes no blob to derive them (as an import)
        toks = np.concatenate([decode_tokens(m.tokens, m.token_width, m.n_tokens - m.base_tokens)
                               for m in hit.chain])
        found = find_keys(toks)

        def txn(c: Conn) -> int:
            for cid, e in needed.items():
                if c.chunk(cid) is not None:
                    continue
                try:
                    head, size = header_at(self._repo.blob_path(cid))
                except (OSError, CorruptionError):
                    raise _Retry() from None
                if not header_matches(head, e.raw_len, e.checksum, size):  # a cut file is fetched again
                    raise _Retry()
                c.add_chunk(cid, e.raw_len, size, head.codec, e.checksum, used.get(cid, keys[cid][0]), now)
            iid = identity_id(c)
            parent_id: int | None = None
            depth = -1
            ids: list[int] = []
            for mf in hit.chain:
                same = c.same_content(iid, ns, mf.prefix_key, mf.content_key)
                if same is not None and same.parent_id == parent_id:
                    parent_id, depth = same.id, same.depth
                    ids.append(same.id)
                    c.touch(same.id, now, False)
                    continue
                depth += 1
                sid = c.insert_snapshot(
                    identity_id=iid, namespace=ns, parent_id=parent_id, depth=depth, n_tokens=mf.n_tokens,
                    base_tokens=mf.base_tokens, token_width=mf.token_width, tokens=mf.tokens, anchor=mf.anchor,
                    prefix_key=mf.prefix_key, content_key=mf.content_key, session=None, state=1, owner=None,
                    now=now, logical_bytes=mf.logical_bytes, find_key=stored_key(found, mf.n_tokens))
                if not mf.matchable:
                    c.set_unmatchable(sid)
                for p in mf.parts:
                    c.insert_part(sid, p.name, p.kind, p.dtype, p.shape, p.component, p.row_start,
                                  p.row_end, p.nbytes, [ch.id for ch in p.chunks], p.tokens_per_row)
                record_prefixes(c, layout, sid, toks[:mf.n_tokens])  # as the link's save did on its node
                parent_id = sid
                ids.append(sid)
            ok, _ = evict_until(c, lambda fr: fits(c, fr), set(ids) | set(protect))
            if not ok:
                raise NoRoom()
            c.add_counter("remote_imports", 1)
            return ids[-1]

        pause_point("import_commit")  # test hook: every chunk file is durable, the chain not yet inserted
        try:
            return self._repo.write(txn)  # evicted leaves' chunk files go after the commit (Repo.write)
        except NoRoom:
            self._repo.sweep(created)
            raise

    def _fetch(self, scope: str, keys: tuple[bytes, bytes], e: ChunkEntry,
               given: Sequence[memoryview] | None = None) -> tuple[bytes, bool, bytes]:
        """Stream one chunk object (or ``given``, its pieces already read) into a local chunk file,
        checking it; (id, created, its scope key)."""
        if given is not None:
            size, pieces = sum(len(p) for p in given), iter(given)
        else:
            size, pieces = open_object(self.client, scope, e)
        try:
            check = ChunkCheck(e, keys, size)
        except BadObject as bad:
            raise corrupt(e, bad.why, self._count) from None
        tmp = os.path.join(self._repo.tmp, TEMP_PREFIX + secrets.token_hex(12))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        ok = False
        try:
            try:
                for piece in pieces:
                    check.feed(piece)
                    _write_all(fd, piece)
                check.finish(lambda: _read_payload(tmp))
            except RemoteError as err:
                raise fetch_failed(e, err) from None
            except BadObject as bad:
                raise corrupt(e, bad.why, self._count) from None
            os.fsync(fd)
            ok = True
        finally:
            os.close(fd)
            if not ok:
                _unlink(tmp)
        assert check.head is not None
        path = self._repo.blob_path(e.id)
        # the address may be taken (another writer, an orphan, a damaged file): whether that file may
        # be replaced is the catalog's call under the write lock, as for every chunk a save publishes
        # a new address is linked; a taken one (a row whose file is lost or damaged, a quarantined row,
        # an orphan) is settled under the write lock, which heals the row as it places this file
        state = self._repo.db.read(lambda c: c.chunk_state(e.id))
        new = state == 0 and link_new(tmp, path)
        if not new:
            settle(self._repo.db, e.id, tmp, path, e.stored_len, check.head.codec)
        if given is None:  # bytes a tee restore handed in were counted when it read them
            self._count("remote_fetched_chunks", 1)
            self._count("remote_fetched_bytes", e.stored_len)
        return e.id, new, check.scope_key


def _write_all(fd: int, data: memoryview) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _read_payload(path: str) -> bytes:
    """The raw payload of a written (raw-codec) chunk file: its bytes after the header."""
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        return f.read()
