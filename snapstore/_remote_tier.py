"""The shared tier: publish chains to S3-compatible object storage, find them from a prompt, fetch them.

Object layout below ``s3://BUCKET/PREFIX/`` (docs/format.md "Shared tier"), ``S`` = the scope
(BLAKE3 key of identity + namespace, 64 hex), so nothing crosses an identity or a tenant::

    snapstore-v1/c/S/<chunk id>                          chunk: the local chunk file's bytes
    snapstore-v1/m/S/<anchor>/<n:012d>-<prefix>-<content> manifest of one chain link
    snapstore-v1/u/S/<manifest name>                     last use of a manifest (LRU for the budget)
    snapstore-v1/l/<writer>-<nonce>                      lease: chunks a live upload may reference

Publish (per chain link, root first): skip if its manifest exists; else write a lease, then every
chunk with a conditional PUT (``If-None-Match: *``: concurrent writers never overwrite, a 412 means
"already there"), then the manifest, also conditional, then drop the lease. A chunk that was
already in the bucket may be an old orphan that a concurrent ``gc --remote`` is deleting: it is
checked again once the gc delete window has passed since the lease was written (the fence), so a
manifest never references a missing chunk. Lookup: for each block anchor of the prompt, deepest
first and a few in parallel, one LIST of that anchor's key prefix returns only manifests whose
first blocks equal the prompt's; the candidate's chain is fetched and its tokens compared exactly.
Fetch: every chunk of the chain the local tier lacks is streamed into ``tmp/``, checked (size,
header, XXH3-128, keyed BLAKE3 = its id), published as a local chunk file, and the chain is
inserted into the local catalog in one transaction, within the local budget.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

import blake3
import numpy as np

from ._chunker import settle
from ._chunkfile import CODEC_RAW, HEADER_SIZE, checksum, chunk_id, decode_payload, header_at, parse_header, scope_key
from ._config import env_int
from ._db import Conn, SnapRow
from ._errors import (
    ConfigError,
    CorruptChunkError,
    CorruptionError,
    RemoteError,
    SnapshotUnavailableError,
)
from ._identity import Identity
from ._lifecycle import evict_until
from ._manifest import ChunkEntry, Manifest, PartEntry, decode, encode, parse_name
from ._publish import TEMP_PREFIX, fsync_dirs, link_new
from ._repo import Repo
from ._results import Match
from ._s3client import S3Client
from ._tokens import BLOCK, TokenIndex, decode_tokens
from ._uploader import FlushResult, Uploader

__all__ = ["LAYOUT", "RemoteHit", "RemoteMatch", "RemoteTier", "chunk_key", "gc_window", "manifest_key",
           "open_remote", "use_key"]

LAYOUT = "snapstore-v1"
LEASE_TTL = 3600.0  # a lease older than this (by the server's clock) protects nothing
_PROBE_BATCH = 8  # anchors listed in parallel per round of a lookup
_CACHE = 4096  # decoded manifests kept (they are immutable)


def gc_window() -> float:
    """Seconds a ``gc --remote`` may go on deleting after it listed the leases (``SNAPSTORE_REMOTE_GC_WINDOW_S``).

    An upload that relies on a chunk that was already in the bucket waits twice this long after
    writing its lease and then checks the chunk again (see the module docstring).
    """
    raw = os.environ.get("SNAPSTORE_REMOTE_GC_WINDOW_S", "").strip()
    try:
        value = float(raw) if raw else 2.0
    except ValueError:
        raise ConfigError(f"$SNAPSTORE_REMOTE_GC_WINDOW_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError("$SNAPSTORE_REMOTE_GC_WINDOW_S must be > 0")
    return value


def chunk_key(scope: str, cid: bytes) -> str:
    """The object key of a chunk in a scope."""
    return f"{LAYOUT}/c/{scope}/{cid.hex()}"


def manifest_key(scope: str, name: str) -> str:
    """The object key of a manifest in a scope."""
    return f"{LAYOUT}/m/{scope}/{name}"


def use_key(scope: str, name: str) -> str:
    """The object key of a manifest's last-use marker."""
    return f"{LAYOUT}/u/{scope}/{name}"


@dataclass(frozen=True)
class RemoteHit:
    """A chain found in the shared tier: its manifests root first, checked against the prompt."""

    scope: str
    namespace: str
    chain: tuple[Manifest, ...]


@dataclass(frozen=True, slots=True)
class RemoteMatch(Match):
    """A Match served by the shared tier: ``snapshot_id`` is 0 until restore() fetches it."""

    remote: RemoteHit | None = None


class _NoRoom(Exception):
    pass


class _Gone(Exception):
    """A local chunk file or snapshot went away (evicted) during an upload."""


class _Retry(Exception):
    pass


class RemoteTier:
    """One Store's view of the shared tier: upload queue, lookup, fetch into the local tier."""

    def __init__(self, client: S3Client, repo: Repo, identity: Identity, owner: str,
                 count: Callable[[str, int], None], *, wait: bool, queue: int):
        self.client = client
        self._repo = repo
        self._identity = identity
        self._owner = owner
        self._count = count
        self.wait = wait
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapstore-remote")
        self._cache: OrderedDict[str, Manifest] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._writer = f"{owner.split(':')[0][:40]}-{secrets.token_hex(6)}"
        self._uploader = Uploader(self.publish, count, maxsize=queue) if not wait else None

    def scope(self, ns: str) -> tuple[bytes, str]:
        """(BLAKE3 scope key, its hex) of this identity and a namespace."""
        key = scope_key(self._identity.key, ns)
        return key, key.hex()

    # -- hooks the Store calls ---------------------------------------------------------------
    def saved(self, sid: int) -> None:
        """After a save or commit made ``sid`` durable and visible locally: publish it (queued or now)."""
        if self._uploader is not None:
            self._uploader.enqueue(sid)
        else:
            self.publish(sid)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Wait for the queued uploads (see Uploader.flush)."""
        if self._uploader is None:
            return FlushResult()
        return self._uploader.flush(timeout)

    def close(self) -> None:
        """Finish queued uploads, then release threads."""
        try:
            if self._uploader is not None:
                self._uploader.close()
        finally:
            self._pool.shutdown(wait=True)

    # -- publish -----------------------------------------------------------------------------
    def _local_chain(self, sid: int) -> list[tuple[SnapRow, list[tuple[Any, list[Any]]]]] | None:
        def run(c: Conn) -> list[tuple[SnapRow, list[tuple[Any, list[Any]]]]] | None:
            snap = c.snapshot(sid)
            if snap is None or snap.state != 1:
                return None
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
        ns = chain[-1][0].namespace
        _skey, scope = self.scope(ns)
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
                                                                bytes(ch.checksum)) for ch in chunks)))
        return Manifest(
            identity_key=self._identity.key, identity=self._identity.canonical, namespace=ns,
            n_tokens=link.n_tokens, base_tokens=link.base_tokens, token_width=link.token_width,
            tokens=bytes(link.tokens), anchor=bytes(link.anchor), prefix_key=bytes(link.prefix_key),
            content_key=bytes(link.content_key), parent=parent, matchable=bool(link.matchable),
            logical_bytes=link.logical_bytes, created=time.time(), writer=self._writer, parts=tuple(entries))

    def _publish_links(self, scope: str, todo: list[Manifest]) -> None:
        entries = {ch.id: ch for m in todo for p in m.parts for ch in p.chunks}
        lease = f"{LAYOUT}/l/{self._writer}-{secrets.token_hex(8)}"
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
            _test_pause("after_heads")
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
            _test_pause("before_manifest")
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
            fd = os.open(self._repo.blob_path(e.id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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
        if (done != len(data) or head.raw_len != e.raw_len or head.checksum != e.checksum
                or len(data) != HEADER_SIZE + head.payload_len):
            raise _Gone()
        raw = view[HEADER_SIZE:] if head.codec == CODEC_RAW else _decoded(head, view[HEADER_SIZE:])
        if checksum(raw) != e.checksum:
            self._count("remote_local_damage", 1)
            raise _Gone()  # local damage: verify quarantines it; never spread it to the fleet
        return bytes(data)

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, arr: np.ndarray, ns: str, have: int) -> RemoteMatch | None:
        """The longest chain in the bucket whose tokens are a prefix of ``arr`` and longer than ``have``.

        A failing bucket never fails match(): the local answer stands and ``remote_errors`` counts it.
        """
        try:
            return self._lookup(arr, ns, have)
        except RemoteError:
            self._count("remote_errors", 1)
            return None

    def _lookup(self, arr: np.ndarray, ns: str, have: int) -> RemoteMatch | None:
        index = TokenIndex(arr)
        _skey, scope = self.scope(ns)
        n = len(arr)
        anchors = list(range(n // BLOCK, have // BLOCK - 1, -1))
        base = f"{LAYOUT}/m/{scope}/"
        for at in range(0, len(anchors), _PROBE_BATCH):
            batch = anchors[at:at + _PROBE_BATCH]
            listings = list(self._pool.map(
                lambda i: list(self.client.list(f"{base}{index.chain[i].hex()}/")), batch))
            for i, infos in zip(batch, listings):
                cands = []
                for info in infos:
                    name = info.key[len(base):] if info.key.startswith(base) else ""
                    parsed = parse_name(name)
                    if parsed is None:
                        continue
                    anchor, cn, pkey, _ckey = parsed
                    if anchor == index.chain[i] and have < cn <= n and pkey == index.prefix_key(cn):
                        cands.append((cn, name))
                for cn, name in sorted(cands, reverse=True):
                    chain = self._load_chain(scope, ns, name)
                    if chain is None or not chain[-1].matchable:
                        continue
                    segs = [decode_tokens(m.tokens, m.token_width, m.n_tokens - m.base_tokens) for m in chain]
                    if np.array_equal(np.concatenate(segs), arr[:cn]):
                        self._count("remote_hits", 1)
                        return RemoteMatch(0, cn, ns or None, RemoteHit(scope, ns, tuple(chain)))
        self._count("remote_misses", 1)
        return None

    def _manifest(self, scope: str, name: str) -> Manifest | None:
        with self._cache_lock:
            hit = self._cache.get(name)
            if hit is not None:
                self._cache.move_to_end(name)
                return hit
        data = self.client.get(manifest_key(scope, name), 256 << 20)
        if data is None:
            return None
        try:
            m = decode(data)
        except CorruptionError:
            self._count("remote_corrupt_manifests", 1)
            return None
        with self._cache_lock:
            self._cache[name] = m
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return m

    def _load_chain(self, scope: str, ns: str, name: str) -> list[Manifest] | None:
        """The chain ending at manifest ``name``, root first, if every link is present and consistent."""
        out: list[Manifest] = []
        seen: set[str] = set()
        cur: str | None = name
        while cur is not None:
            if cur in seen or len(out) > 100_000:
                return None
            seen.add(cur)
            m = self._manifest(scope, cur)
            if m is None:
                return None
            # never another's state: the object's body must agree with its key and with this store
            if (m.name != cur or m.identity_key != self._identity.key or m.identity != self._identity.canonical
                    or m.namespace != ns):
                self._count("remote_corrupt_manifests", 1)
                return None
            out.append(m)
            cur = m.parent
        out.reverse()
        prev = 0
        for m in out:
            if m.base_tokens != prev:
                return None
            prev = m.n_tokens
        return out

    # -- fetch into the local tier -----------------------------------------------------------
    def materialize(self, m: RemoteMatch, fits: Callable[[Conn, list[bytes]], bool],
                    identity_id: Callable[[Conn], int]) -> Match:
        """Fetch the chain's missing chunks (each verified) and insert the chain locally; a local Match."""
        hit = m.remote
        if hit is None:
            raise SnapshotUnavailableError("not a match from the shared tier; nothing was written")
        for _attempt in range(3):
            try:
                sid = self._materialize_once(hit, fits, identity_id)
                break
            except _Retry:
                continue
        else:
            raise SnapshotUnavailableError("the local tier kept evicting the fetched chunks; nothing was written")
        try:
            self.client.put(use_key(hit.scope, hit.chain[-1].name), b"")
        except RemoteError:
            pass  # last use is a hint for the budget, not worth failing a restore
        return Match(sid, m.n_tokens, m.namespace)

    def _materialize_once(self, hit: RemoteHit, fits: Callable[[Conn, list[bytes]], bool],
                          identity_id: Callable[[Conn], int]) -> int:
        needed: dict[bytes, ChunkEntry] = {ch.id: ch for mf in hit.chain for p in mf.parts for ch in p.chunks}
        # a chunk's address is keyed by its part's dtype and shape (v2), or by the identity and
        # namespace alone for chunks a store wrote before v2: the fetch accepts either, never another
        keys = {ch.id: (scope_key(self._identity.key, hit.namespace, p.dtype, p.shape),
                        scope_key(self._identity.key, hit.namespace))
                for mf in hit.chain for p in mf.parts for ch in p.chunks}
        have = self._repo.db.read(lambda c: {cid for cid in needed if c.chunk_exists(cid)})
        todo = [e for cid, e in needed.items() if cid not in have]
        # the files that did arrive before an error are orphans until a row references them: gc collects them
        results = list(self._pool.map(lambda e: self._fetch(hit.scope, keys[e.id], e), todo))
        created = [cid for cid, new, _key in results if new]
        used = {cid: key for cid, _new, key in results}
        fsync_dirs({os.path.dirname(self._repo.blob_path(e.id)) for e in todo})
        now = time.time()
        ns = hit.namespace

        def txn(c: Conn) -> int:
            for cid, e in needed.items():
                if c.chunk(cid) is not None:
                    continue
                try:
                    head, size = header_at(self._repo.blob_path(cid))
                except (OSError, CorruptionError):
                    raise _Retry() from None
                if head.raw_len != e.raw_len or head.checksum != e.checksum:
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
                    now=now, logical_bytes=mf.logical_bytes)
                if not mf.matchable:
                    c.set_unmatchable(sid)
                for p in mf.parts:
                    c.insert_part(sid, p.name, p.kind, p.dtype, p.shape, p.component, p.row_start,
                                  p.row_end, p.nbytes, [ch.id for ch in p.chunks])
                parent_id = sid
                ids.append(sid)
            ok, _ = evict_until(c, lambda fr: fits(c, fr), set(ids))
            if not ok:
                raise _NoRoom()
            c.add_counter("remote_imports", 1)
            return ids[-1]

        try:
            # evicted leaves' chunk files go after the commit (Repo.write)
            sid = self._repo.write(txn)
        except _NoRoom:
            self._repo.sweep(created)
            raise SnapshotUnavailableError(
                f"the shared tier's snapshot ({hit.chain[-1].n_tokens} tokens) does not fit the local budget "
                "even after evicting unpinned leaves; nothing was written") from None
        return sid

    def _fetch(self, scope: str, keys: tuple[bytes, bytes], e: ChunkEntry) -> tuple[bytes, bool, bytes]:
        """Stream one chunk object into a local chunk file, verifying it; (id, created, its scope key)."""
        skey = keys[0]
        key = chunk_key(scope, e.id)
        _test_pause("fetch")
        try:
            got = self.client.stream(key)
        except RemoteError as err:
            raise SnapshotUnavailableError(f"fetching chunk {e.id.hex()} from the shared tier failed ({err}); "
                                           "nothing was written") from None
        if got is None:
            raise SnapshotUnavailableError(f"chunk {e.id.hex()} is missing from the shared tier "
                                           "(removed by gc or lost); nothing was written")
        size, pieces = got
        if size != e.stored_len:
            self._corrupt(e, f"object is {size} bytes, the manifest says {e.stored_len}")
        tmp = os.path.join(self._repo.tmp, TEMP_PREFIX + secrets.token_hex(12))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        ok = False
        try:
            head_buf = bytearray()
            payload: bytearray | None = None
            h_id = blake3.blake3(key=skey, max_threads=blake3.blake3.AUTO)
            h_sum = _xxh()
            head = None
            written = 0
            try:
                for piece in pieces:
                    written += len(piece)
                    if written > e.stored_len:
                        self._corrupt(e, "object is longer than the manifest says")
                    _write_all(fd, piece)
                    if head is None:
                        need = HEADER_SIZE - len(head_buf)
                        head_buf += piece[:need]
                        piece = piece[need:]
                        if len(head_buf) < HEADER_SIZE:
                            continue
                        try:
                            head = parse_header(bytes(head_buf))
                        except CorruptionError as err:
                            self._corrupt(e, str(err))
                        if head.raw_len != e.raw_len or head.checksum != e.checksum:
                            self._corrupt(e, "header does not match the manifest")
                        payload = None if head.codec == CODEC_RAW else bytearray()
                    if payload is None:
                        h_id.update(piece)
                        h_sum.update(piece)
                    else:
                        payload += piece
            except RemoteError as err:
                raise SnapshotUnavailableError(f"fetching chunk {e.id.hex()} from the shared tier failed "
                                               f"({err}); nothing was written") from None
            if head is None or written != e.stored_len:
                self._corrupt(e, "object is shorter than the manifest says")
            if payload is not None:
                raw = _decoded(head, memoryview(payload))
                h_id.update(raw)
                h_sum.update(raw)
            if h_sum.digest() != e.checksum:
                self._corrupt(e, "content does not match its checksum")
            if h_id.digest() != e.id:
                # not the v2 address: a chunk written before v2 has the identity's v1 one
                raw_again = raw if payload is not None else _read_payload(tmp)
                if chunk_id(raw_again, keys[1]) != e.id:
                    self._corrupt(e, "content does not match its address")
                skey = keys[1]
            os.fsync(fd)
            ok = True
        finally:
            os.close(fd)
            if not ok:
                _unlink(tmp)
        path = self._repo.blob_path(e.id)
        # the address may be taken (another writer, an orphan, a damaged file): whether that file may
        # be replaced is the catalog's call under the write lock, as for every chunk a save publishes
        new = link_new(tmp, path)
        if not new:
            settle(self._repo.db, e.id, tmp, path, e.stored_len, head.codec)
        self._count("remote_fetched_chunks", 1)
        self._count("remote_fetched_bytes", e.stored_len)
        return e.id, new, skey

    def _corrupt(self, e: ChunkEntry, why: str) -> NoReturn:
        self._count("remote_corrupt_chunks", 1)
        raise CorruptChunkError(f"chunk {e.id.hex()} in the shared tier is corrupt ({why}); it was not "
                                "used and nothing was written (`snapstore verify --remote --deep`)", touched=False)


def _xxh() -> Any:
    from ._chunkfile import checksum_stream
    return checksum_stream()


def _decoded(head: Any, payload: memoryview) -> memoryview:
    out = memoryview(bytearray(head.raw_len))
    decode_payload(head, payload, out)
    return out


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


def _test_pause(point: str) -> None:
    """Test hook: ``SNAPSTORE_TEST_REMOTE_PAUSE=point:seconds`` sleeps there (forces race windows)."""
    spec = os.environ.get("SNAPSTORE_TEST_REMOTE_PAUSE", "")
    if spec.startswith(point + ":"):
        time.sleep(float(spec.split(":", 1)[1]))


def open_remote(url: str | None, repo: Repo, identity: Identity, owner: str, count: Callable[[str, int], None],
                wait: bool | None) -> RemoteTier | None:
    """The shared tier for ``url`` (else ``$SNAPSTORE_REMOTE``), or None when neither is set."""
    url = url if url is not None else (os.environ.get("SNAPSTORE_REMOTE") or None)
    if not url:
        return None
    if wait is None:
        flag = os.environ.get("SNAPSTORE_REMOTE_WAIT", "0").strip().lower()
        if flag not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
            raise ConfigError(f"$SNAPSTORE_REMOTE_WAIT must be 0/1 (or true/false), got {flag!r}")
        wait = flag in ("1", "true", "yes", "on")
    queue = env_int("SNAPSTORE_REMOTE_QUEUE") or 256
    gc_window()  # a malformed setting fails at open, not in the background
    return RemoteTier(S3Client(url), repo, identity, owner, count, wait=bool(wait), queue=queue)


def _read_payload(path: str) -> bytes:
    """The raw payload of a written (raw-codec) chunk file: its bytes after the header."""
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        return f.read()
