"""Find a prompt's longest chain in the shared tier without listing the bucket.

For each block anchor of the prompt, deepest first and a few in parallel, one LIST of that
anchor's key prefix returns only manifests whose first blocks equal the prompt's; the candidate's
chain is read (parents by name, decoded manifests cached: they are immutable), checked to be this
identity's and namespace's and contiguous, and its tokens compared with the prompt exactly.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from snapstore._errors import CorruptionError, RemoteError
from snapstore._identity import Identity
from snapstore._results import Match
from snapstore._tokens import BLOCK, TokenIndex, decode_tokens
from snapstore.remote.keys import LAYOUT, manifest_key
from snapstore.remote.manifest import Manifest, decode, parse_name
from snapstore.remote.s3client import S3Client

__all__ = ["Lookup", "RemoteHit", "RemoteMatch"]

_PROBE_BATCH = 8  # anchors listed in parallel per round of a lookup
_CACHE = 4096  # decoded manifests kept


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


class Lookup:
    """Prompt -> the longest matching chain in the bucket (one store's identity)."""

    def __init__(self, client: S3Client, identity: Identity, scope: Callable[[str], str],
                 count: Callable[[str, int], None], pool: ThreadPoolExecutor):
        self.client = client
        self._identity = identity
        self._scope = scope
        self._count = count
        self._pool = pool
        self._cache: OrderedDict[str, Manifest] = OrderedDict()
        self._cache_lock = threading.Lock()

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
        scope = self._scope(ns)
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
