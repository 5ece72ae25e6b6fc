"""``SnapstoreHiCache``: snapstore as SGLang HiCache's storage tier (the L3 behind host memory).

SGLang builds it with ``StorageBackendFactory`` from ``--hicache-storage-backend dynamic`` and the
extra config (docs/engine.md, "SGLang"). K/V pages are a chain: page ``i`` of a sequence is the
snapshot of tokens ``chain_tokens(prefix_keys + keys[:i+1])`` (one row per page), a delta over page
``i-1``, so a chain is stored once, a branch shares its stem, eviction takes the least-recently-used
tail pages first, and a hit is the longest stored chain. The pages of the other pools (Mamba state,
SWA, ...) are stored one snapshot per page key (a chained hash names its whole prefix). Every read
is checked against the chunk checksums: a damaged page is a miss.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

import snapstore

from ._identify import BACKEND_KEYS, SGLANG_KEYS, pool_identity, weights_pack
from ._keys import TOKENS_PER_PAGE, chain_tokens, key_tokens
from ._pages import PageReader, PageWriter, page_bytes_of, page_nbytes

log = logging.getLogger("snapstore.engine.sglang")
KV = "kv"


def _sglang_build() -> str:
    """The engine build in the identity: SGLang's version (a new SGLang may change page formats)."""
    import sglang

    return f"sglang-{getattr(sglang, '__version__', 'unknown')}"


def _budget(extra: Mapping[str, Any]) -> snapstore.Budget:
    """The store budget the extra config asks for (unset fields: snapstore's environment/defaults)."""
    mib = 1 << 20
    disk = extra.get("disk_mib")
    ram = extra.get("ram_mib")
    return snapstore.Budget(disk_bytes=None if disk is None else int(disk) * mib,
                            ram_bytes=None if ram is None else int(ram) * mib,
                            max_entries=extra.get("max_entries"), ttl=extra.get("ttl_s"))


class SnapstoreHiCache(HiCacheStorage):  # type: ignore[misc]  # SGLang's class is untyped
    """A HiCache storage backend over a snapstore directory (TP ranks may share one)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(k for k in extra if k not in BACKEND_KEYS and k not in SGLANG_KEYS)
        if unknown:
            raise snapstore.ConfigError(
                f"SnapstoreHiCache: unknown extra-config keys {unknown}; the backend reads "
                f"{sorted(BACKEND_KEYS)} (docs/engine.md, 'SGLang')")
        if not extra.get("interface_v1"):
            raise snapstore.ConfigError(
                "SnapstoreHiCache needs \"interface_v1\": 1 in --hicache-storage-backend-extra-config: "
                "pages move zero-copy between the host pool and the store, keyed by their chain")
        weights_pack(extra, storage_config.model_name or "")  # the weights must be known before a page is kept
        self.storage_config = storage_config
        self.path = extra.get("path")
        self._extra = extra
        self._budget = _budget(extra)
        self._build = _sglang_build()
        self._stores: dict[str, snapstore.Store] = {}
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.registered_pools: dict[str, Any] = {}
        self.mem_pool_host: Any = None
        self._warned_prefix = False
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []

    # -- pools and stores -----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor (K/V) host pool: the v1 path's source and destination."""
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of the hybrid (v2) set: K/V, Mamba state, SWA, ... by SGLang's pool name."""
        self.registered_pools[str(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        """Open a store per registered pool now, so a bad directory or config fails the attach."""
        for name in self._pool_names():
            self._store(name)

    def _pool_names(self) -> list[str]:
        names = list(self.registered_pools)
        if self.mem_pool_host is not None and KV not in names:
            names.insert(0, KV)
        return names

    def _pool(self, name: str) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None and name == KV:
            pool = self.mem_pool_host
        if pool is None:
            raise snapstore.StateError(f"SnapstoreHiCache: no host pool named {name!r} was registered")
        return pool

    def _store(self, name: str) -> snapstore.Store:
        """The store of pool ``name`` (opened on first use): its identity, a one-page-row layout."""
        with self._lock:
            store = self._stores.get(name)
            if store is not None:
                return store
            pool = self._pool(name)
            nbytes = page_nbytes(pool)
            if name == KV:  # a chain: one row per page, any page-aligned prefix matches
                layout = snapstore.Layout(rows={"page": snapstore.Rows("uint8", (nbytes,))},
                                          tokens_per_row=TOKENS_PER_PAGE)
            else:  # one snapshot per page key
                layout = snapstore.Layout(fixed={"page": snapstore.Fixed("uint8", (nbytes,))})
            chunk_mib = self._extra.get("chunk_mib")
            store = snapstore.Store.open(
                self.path, identity=pool_identity(self.storage_config, pool, name, self._build), layout=layout,
                budget=self._budget, drop_stale=bool(self._extra.get("drop_stale", True)),
                chunk_bytes=None if chunk_mib is None else int(chunk_mib) << 20)
            self._stores[name] = store
            return store

    def _writes(self, name: str) -> bool:
        """Whether this rank writes ``name``'s pages (MLA K/V: one writer per shard, as SGLang says)."""
        return name != KV or bool(self.storage_config.is_storage_writer)

    # -- the K/V chain --------------------------------------------------------------------------
    def _prefix(self, extra_info: HiCacheStorageExtraInfo | None) -> list[str]:
        """The page keys before this call's, from the sequence start (none: the chain starts here)."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None:
            self.counters["calls_without_prefix_keys"] += 1
            if not self._warned_prefix:
                self._warned_prefix = True
                log.warning("SnapstoreHiCache: SGLang passes no prefix_keys, so each call's pages are chained "
                            "from its own first page and a later call split elsewhere misses them; add "
                            "\"hicache_storage_pass_prefix_keys\": true to --hicache-storage-backend-extra-config")
            return []
        return list(prefix)

    def _chain_hit(self, store: snapstore.Store, chain: Sequence[str]) -> tuple[snapstore.Match | None, int]:
        """The longest stored prefix of ``chain``: its match and its length in pages (a store error: none)."""
        try:
            m = store.match(chain_tokens(chain))
        except snapstore.SnapstoreError as e:  # the engine serves on without its L3: a miss, counted
            self._failed("match", e)
            return None, 0
        return m, (0 if m is None else m.n_tokens // TOKENS_PER_PAGE)

    def _failed(self, op: str, e: BaseException) -> None:
        """Count and log a store error met while serving SGLang (it gets a miss or False, never the error)."""
        self.counters[f"{op}_errors"] += 1
        log.warning("SnapstoreHiCache: %s failed (%s); SGLang is answered as for a missing page", op, e)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored after ``prefix_keys`` (a gap stops it)."""
        if not keys:
            return 0
        prefix = self._prefix(extra_info)
        _, hit = self._chain_hit(self._store(KV), prefix + list(keys))
        found = max(0, min(len(keys), hit - len(prefix)))
        self.counters["exists_pages_found"] += found
        self.counters["exists_pages_missed"] += len(keys) - found
        return found

    def _get_chain(self, name: str, keys: Sequence[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        """Read the stored pages of ``keys`` into the host slots ``host_indices`` (checked, in order)."""
        pool = self._pool(name)
        store = self._store(name)
        prefix = self._prefix(extra_info)
        page_size = int(getattr(pool, "page_size", 1) or 1)
        if not keys or host_indices.numel() != len(keys) * page_size:
            return [False] * len(keys)
        m, hit = self._chain_hit(store, prefix + list(keys))
        n = max(0, min(len(keys), hit - len(prefix)))
        if m is None or n == 0:
            self.counters["get_pages_missed"] += len(keys)
            return [False] * len(keys)
        starts = host_indices[::page_size].tolist()
        base = len(prefix)
        writer = PageWriter(pool, lambda row: int(starts[row - base]), base + n, page_nbytes(pool))
        try:
            store.restore(m, into={"page": writer}, rows_from=base)
        except snapstore.SnapstoreError as e:  # a damaged or vanished page: the pages before it are good
            self._failed("get", e)
        good = 0
        for row in writer.rows_done:  # rows arrive in order; count the leading run
            if row != base + good:
                break
            good += 1
        self.counters["get_pages"] += good
        self.counters["get_pages_missed"] += len(keys) - good
        self._prefetch_pages.append(good)
        return [i < good for i in range(len(keys))]

    def _set_chain(self, name: str, keys: Sequence[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        """Store the pages of ``keys`` from host slots ``host_indices``, each a delta over the one before."""
        pool = self._pool(name)
        page_size = int(getattr(pool, "page_size", 1) or 1)
        if not keys or host_indices.numel() != len(keys) * page_size:
            return [False] * len(keys)
        if not self._writes(name):
            return [True] * len(keys)  # another rank writes this replicated MLA shard
        store = self._store(name)
        prefix = self._prefix(extra_info)
        chain = prefix + list(keys)
        tokens = chain_tokens(chain)
        m, hit = self._chain_hit(store, chain)
        if hit < len(prefix):  # the prefix's pages are not stored: nothing to chain these onto
            self.counters["set_skipped_prefix_missing"] += len(keys)
            return [False] * len(keys)
        starts = host_indices[::page_size].tolist()
        base = len(prefix)
        row_bytes = page_nbytes(pool)
        parent: Any = m.snapshot_id if m is not None else None
        done = hit - base  # pages already stored (dedup: the chain is stored once)
        self.counters["set_pages_deduplicated"] += done
        for i in range(done, len(keys)):
            row = base + i
            reader = PageReader(pool, lambda r: int(starts[r - base]), row + 1, row_bytes)
            try:
                res = store.save(tokens[:(row + 1) * TOKENS_PER_PAGE], {"page": reader}, parent=parent)
            except snapstore.SnapstoreError as e:  # the disk, the source: these pages are not stored
                self._failed("set", e)
                break
            if not res.ok:
                self.counters[f"set_skipped_{res.skipped}"] += len(keys) - i
                break
            parent = res.snapshot_id
            done = i + 1
            self.counters["set_pages"] += 1
        self._backup_pages.append(done)
        return [i < done for i in range(len(keys))]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Zero-copy read of ``keys`` into the anchor host pool's slots ``host_indices``."""
        return self._get_chain(KV, keys, host_indices, extra_info)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Zero-copy write of the anchor host pool's pages at ``host_indices`` under ``keys``."""
        return self._set_chain(KV, keys, host_indices, extra_info)

    # -- one page per key (the legacy calls and the v2 side pools) ------------------------------
    def _has_page(self, store: snapstore.Store, key: str) -> snapstore.Match | None:
        """The snapshot of the page stored under ``key`` alone, or None."""
        try:
            m = store.match(key_tokens(key))
        except snapstore.SnapstoreError as e:
            self._failed("match", e)
            return None
        return m if m is not None and m.n_tokens == TOKENS_PER_PAGE else None

    def _read_key(self, store: snapstore.Store, key: str, target: torch.Tensor) -> bool:
        """Restore the page stored under ``key`` into ``target`` (a flat page tensor), checked."""
        m = self._has_page(store, key)
        if m is None:
            return False
        flat = np.asarray(target.view(torch.uint8).numpy())
        dest: Any = flat
        if store.layout.rows:  # the K/V store: a one-row chain rooted at this key
            dest = flat.reshape(1, -1)
        try:
            store.restore(m, into={"page": dest})
        except snapstore.SnapstoreError as e:
            self._failed("get", e)
            return False
        return True

    def _write_key(self, store: snapstore.Store, key: str, value: torch.Tensor) -> bool:
        flat = np.asarray(value.contiguous().view(torch.uint8).numpy())
        part: Any = flat.reshape(1, -1) if store.layout.rows else flat
        try:
            res = store.save(key_tokens(key), {"page": part}, parent=None)
        except snapstore.SnapstoreError as e:
            self._failed("set", e)
            return False
        if not res.ok:
            self.counters[f"set_skipped_{res.skipped}"] += 1
        return bool(res.ok)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page stored under ``key`` alone (a one-page chain), read into ``target_location``."""
        if target_location is None:
            target_location = self._pool(KV).get_dummy_flat_data_page()
        return target_location if self._read_key(self._store(KV), key, target_location) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """``get`` for each key."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (a flat page tensor) under ``key`` alone (a one-page chain)."""
        if value is None:
            return False
        return self._write_key(self._store(KV), key, value)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """``set`` for each key; False as soon as one is not stored."""
        return all(self.set(k, v) for k, v in zip(keys, values or []))

    def exists(self, key: str) -> bool:
        """Whether a page is stored under ``key`` alone (the legacy by-key calls)."""
        return self._has_page(self._store(KV), key) is not None

    # -- v2: the hybrid pool set ----------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix over K/V and every side pool, by each pool's hit policy (as SGLang's file backend)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            name = str(transfer.name)
            if name == KV:
                continue
            store = self._store(name)
            present = [self._has_page(store, keys[i]) is not None for i in range(kv_pages)]
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing):n])}
                boundary = max(ok, default=0)
            else:  # ALL_PAGES (BLOCK_GROUPS is not gated: its verdict is its own leading run)
                boundary = present.index(False) if False in present else kv_pages
                if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                    group = max(1, int(transfer.group_pages or 1))
                    hit_count[name] = boundary - boundary % group
                    continue
                ok = set(range(1, boundary + 1))
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _side_io(self, transfer: PoolTransfer, write: bool) -> list[bool]:
        name = str(transfer.name)
        pool = self._pool(name)
        keys = list(transfer.keys or [])
        page_size = int(getattr(pool, "page_size", 1) or 1)
        idx = transfer.host_indices
        if idx is None or idx.numel() != len(keys) * page_size:
            return [False] * len(keys)
        store = self._store(name)
        out: list[bool] = []
        for i, key in enumerate(keys):
            slot = int(idx[i * page_size].item())
            if write:
                ok = self._has_page(store, key) is not None
                if not ok:
                    flat = torch.from_numpy(page_bytes_of(pool, slot).copy())
                    ok = self._write_key(store, key, flat)
            else:
                scratch = pool.get_dummy_flat_data_page()
                ok = self._read_key(store, key, scratch)
                if ok:
                    pool.set_from_flat_data_page(slot, scratch)
            out.append(ok)
        self.counters[f"{name}_{'set' if write else 'get'}_pages"] += sum(out)
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool (K/V as a chain, the side pools page by page)."""
        return self._v2(transfers, extra_info, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Write each transfer's pages from its pool (K/V as a chain, the side pools page by page)."""
        return self._v2(transfers, extra_info, write=True)

    def _v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None, *,
            write: bool) -> dict[str, list[bool]]:
        """The v2 calls' one loop: each transfer by its pool, the K/V chain or a side pool."""
        chain = self._set_chain if write else self._get_chain
        res: dict[str, list[bool]] = {}
        for t in transfers:
            name = str(t.name)
            if name == KV:
                idx = t.host_indices if t.host_indices is not None else torch.empty(0, dtype=torch.int64)
                res[name] = chain(KV, list(t.keys or []), idx, extra_info)
            else:
                res[name] = self._side_io(t, write=write)
        return res

    # -- maintenance ----------------------------------------------------------------------------
    def clear(self) -> bool:
        """Drop every page of this rank's identities (other models and ranks in the directory stay)."""
        for store in list(self._stores.values()):
            for info in store.snapshots():
                if info.parent_id is None:
                    try:
                        store.delete(info.snapshot_id)
                    except snapstore.NotFoundError:
                        pass  # another process dropped it first
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages per prefetch / backup since the last call)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(self._prefetch_pages)
        metrics.backup_pgs.extend(self._backup_pages)
        self._prefetch_pages.clear()
        self._backup_pages.clear()
        return metrics

    def store_stats(self) -> dict[str, snapstore.Stats]:
        """snapstore's own ``Stats`` per pool (hits, evictions, stored bytes, skips)."""
        return {name: store.stats() for name, store in self._stores.items()}

    def close(self) -> None:
        """Close every store (pending writes land first)."""
        with self._lock:
            stores, self._stores = self._stores, {}
        for store in stores.values():
            store.close()
