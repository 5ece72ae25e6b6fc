"""The maintenance scan of the shared tier: list the leases, then the manifests (read through a
bounded pool, ``scan_width()`` at once, the listing order and findings unchanged), the last-use
markers and the chunks; and which manifests a scan finds damaged. verify, gc and inspect
(``remote.maint``) decide on what it returns. Ages are on the server's clock (a probe object's
LastModified), so a node with a skewed clock cannot make gc delete early.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from snapstore._config import env_int
from snapstore._errors import CorruptionError, RemoteError
from snapstore.chunks.chunkfile import scope_key
from snapstore.remote.keys import LAYOUT, manifest_key
from snapstore.remote.manifest import Manifest, decode, parse_name
from snapstore.remote.s3client import ObjectInfo, S3Client

__all__ = ["Scan", "find_damage", "list_leases", "scan_bucket", "scan_width"]

_MAN = f"{LAYOUT}/m/"
_CHK = f"{LAYOUT}/c/"
_USE = f"{LAYOUT}/u/"
_LEASE = f"{LAYOUT}/l/"
_SCAN_WIDTH = 16  # manifests read at once by a scan (docs/benchmarks.md "A fleet on one bucket")
_AHEAD = 4  # reads in flight or done but not yet taken, per pool thread (bounds what the scan holds)


def scan_width() -> int:
    """How many manifests a maintenance scan reads at once: SNAPSTORE_REMOTE_SCAN_WIDTH, else 16.
    The reads were one at a time; at a cloud store's ~15 ms a GET that alone capped gc at ~65
    manifests/s (docs/design.md "Beyond one machine")."""
    return max(1, env_int("SNAPSTORE_REMOTE_SCAN_WIDTH") or _SCAN_WIDTH)


@dataclass
class Scan:
    server_now: float
    manifests: dict[tuple[str, str], tuple[Manifest | None, ObjectInfo, str]]  # (scope, name) -> (m, info, why)
    chunks: dict[tuple[str, str], ObjectInfo]  # (scope, cid hex)
    uses: dict[tuple[str, str], float]
    leases: list[tuple[ObjectInfo, set[tuple[str, str]]]]
    other: list[str]


def _server_now(client: S3Client) -> float:
    """The server's clock: LastModified of a probe object written now."""
    key = f"{LAYOUT}/clock/{secrets.token_hex(8)}"
    t = time.monotonic()
    client.put(key, b"")
    info = client.head(key)
    client.delete([key])
    if info is None:
        raise RemoteError(5, f"{client.url}: a probe object vanished right after it was written")
    return info.modified + (time.monotonic() - t) / 2


def list_leases(client: S3Client) -> list[tuple[ObjectInfo, set[tuple[str, str]]]]:
    out = []
    for info in client.list(_LEASE):
        refs: set[tuple[str, str]] = set()
        data = client.get(info.key, 64 << 20)
        if data is not None:
            try:
                doc = json.loads(data)
                scope = str(doc["scope"])
                refs = {(scope, str(c)) for c in doc["chunks"]}
            except (ValueError, KeyError, TypeError):
                refs = set()  # a damaged lease protects nothing; gc removes it once stale
        out.append((info, refs))
    return out


def scan_bucket(client: S3Client, *, with_manifests: bool = True) -> Scan:
    now = _server_now(client)
    leases = list_leases(client)  # first: see the module docstring
    manifests: dict[tuple[str, str], tuple[Manifest | None, ObjectInfo, str]] = {}
    other: list[str] = []
    width = scan_width()
    ahead = _AHEAD * width
    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="snapstore-scan") as pool:
        pending: deque[tuple[tuple[str, str], Future[tuple[Manifest | None, ObjectInfo, str] | None]]] = deque()

        def settle(limit: int) -> None:
            while len(pending) > limit:
                key, fut = pending.popleft()
                got = fut.result()
                if got is not None:  # else removed meanwhile
                    manifests[key] = got

        for info in client.list(_MAN):
            scope, _, name = info.key[len(_MAN):].partition("/")
            if len(scope) != 64 or parse_name(name) is None:
                other.append(info.key)
                continue
            if not with_manifests:
                manifests[(scope, name)] = (None, info, "")
                continue
            pending.append(((scope, name), pool.submit(_read_manifest, client, info, scope, name)))
            settle(ahead)  # bounded: at most ``ahead`` manifests read and held beyond the listing
        settle(0)
    if with_manifests:
        _late_parents(client, manifests)
    uses = {}
    for info in client.list(_USE):
        scope, _, name = info.key[len(_USE):].partition("/")
        uses[(scope, name)] = info.modified
    chunks = {}
    for info in client.list(_CHK):
        scope, _, cid = info.key[len(_CHK):].partition("/")
        chunks[(scope, cid)] = info
    return Scan(now, manifests, chunks, uses, leases, other)


def _read_manifest(client: S3Client, info: ObjectInfo, scope: str,
                   name: str) -> tuple[Manifest | None, ObjectInfo, str] | None:
    """(manifest or None, info, why it does not parse) of one listed manifest; None if it is gone."""
    data = client.get(info.key, 256 << 20)
    if data is None:
        return None
    m: Manifest | None = None
    why = ""
    try:
        m = decode(data)
    except CorruptionError as e:
        why = str(e)
    if m is not None and (m.name != name or scope_key(m.identity_key, m.namespace).hex() != scope):
        m, why = None, "its body names another key or scope than the one it is stored at"
    return m, info, why


def _late_parents(client: S3Client, manifests: dict[tuple[str, str], tuple[Manifest | None, ObjectInfo, str]]) -> None:
    """Add the parents a listing missed though they exist. A LIST is not a snapshot: its pages are
    read one after another (here between GETs of the manifests), so a parent published meanwhile
    whose key sorts into a page already read is absent while its child, published after it, is
    listed; such a healthy chain must not be reported (or, with ``--repair``, removed) as damaged.
    Only parents the listing lacks are read (a HEAD each): the scan stays one listing."""
    todo = sorted({(scope, m.parent) for (scope, _n), (m, _i, _w) in manifests.items()
                   if m is not None and m.parent is not None and (scope, m.parent) not in manifests})
    while todo:
        scope, name = todo.pop()
        if (scope, name) in manifests:
            continue
        info = client.head(manifest_key(scope, name))
        got = None if info is None else _read_manifest(client, ObjectInfo(manifest_key(scope, name), info.size,
                                                                          info.modified), scope, name)
        if got is None:
            continue  # really missing: _damage reports the child
        manifests[(scope, name)] = got
        m = got[0]
        if m is not None and m.parent is not None and (scope, m.parent) not in manifests:
            todo.append((scope, m.parent))


def find_damage(s: Scan) -> tuple[dict[tuple[str, str], str], dict[tuple[str, str], list[str]]]:
    """(damaged manifest -> reason, missing chunk -> manifests needing it); descendants inherit damage."""
    bad: dict[tuple[str, str], str] = {}
    missing: dict[tuple[str, str], list[str]] = {}
    for key, (m, _info, why) in s.manifests.items():
        scope, name = key
        if m is None:
            bad[key] = why or "does not parse"
            continue
        if m.parent is not None and (scope, m.parent) not in s.manifests:
            bad[key] = f"parent {m.parent} is missing"
        for p in m.parts:
            for ch in p.chunks:
                info = s.chunks.get((scope, ch.id.hex()))
                if info is None or info.size != ch.stored_len:
                    missing.setdefault((scope, ch.id.hex()), []).append(name)
                    bad.setdefault(key, f"chunk {ch.id.hex()} is missing or has the wrong size")
    changed = True
    while changed:  # a link whose ancestor is damaged cannot be restored either
        changed = False
        for key, (m, _info, _why) in s.manifests.items():
            if key in bad or m is None or m.parent is None:
                continue
            if (key[0], m.parent) in bad:
                bad[key] = f"ancestor {m.parent} is damaged"
                changed = True
    return bad, missing
