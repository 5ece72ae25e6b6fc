"""A vLLM KV connector backed by snapstore: persistent, verified, budgeted prefix K/V.

Load it with ``--kv-transfer-config '{"kv_connector": "SnapstoreConnector", "kv_connector_module_path":
"snapstore.engine.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"path": ..., "disk_mib": ...}}'``
(docs/engine.md "vLLM"). Scheduler side (``_scheduler_side``): :meth:`get_num_new_matched_tokens`
answers from ``store.lookup`` (match of a block-granular prefix and describe, one catalog read; no K/V).
Worker side (here): :meth:`start_load_kv` restores straight into the allocated blocks of every layer,
:meth:`wait_for_save` copies a finished prompt's blocks once and saves them with
``save(wait=False)`` as a delta over what the store holds (a writer thread does the disk work).
A load that fails (damaged or missing chunk, evicted snapshot) reports its blocks through
:meth:`get_block_ids_with_load_errors`, so vLLM recomputes them; a store that cannot be opened
disables the connector with one log line. The vLLM objects are typed ``Any``: this module is
imported only where vLLM is installed (its own venv, scripts/vllm_venv.sh).

Hybrid models (more than one KV cache group, e.g. gated delta net / Mamba + attention) go through
``SupportsHMA``: each attention group is a row stream and each Mamba group's state page at a block
boundary a fixed part of the snapshot at that boundary (``_groups``, ``_hybrid``). Their loads are
asynchronous (vLLM cannot map a failed block of one group back to a request, but it can recompute
a request whose load failed), a hit is an exact stored boundary, and a save is planned at every
block boundary vLLM holds a state for (each aligned chunk end and the prompt's last boundary).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

import snapstore as ss

from ._blocks import BlockWriter, gather_blocks, host_pools, torch_dtype_name, weights_hash
from ._checks import attn_backend, exact_layout, hybrid_geometry, plan_groups, single_geometry
from ._groups import HybridLayout, describe_groups
from ._hybrid import group_views
from ._key import RequestKey, config_digest
from ._ops import LAST_STATS, LoadOp, SaveOp, SnapstoreConnectorMetadata, SnapstoreWorkerMetadata, Track
from ._rate import ForwardClock, StepRate
from ._scheduler_side import SchedulerSide

__all__ = ["LAST_STATS", "SnapstoreConnector", "SnapstoreConnectorMetadata", "exact_layout"]

log = logging.getLogger("snapstore.vllm")
_SAVE_EVERY = 256  # tokens between saved boundaries: a later prompt stores only rows past the last shared one


class SnapstoreConnector(SchedulerSide, KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """``KVConnectorBase_V1`` over a snapstore store (one per scheduler and per worker)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra: dict[str, Any] = dict(cfg.kv_connector_extra_config or {})
        self._bs = int(vllm_config.cache_config.block_size)
        self._every = max(self._bs, -(-int(extra.get("save_every", _SAVE_EVERY)) // self._bs) * self._bs)
        self.stats: dict[str, int] = {"lookups": 0, "hit_tokens": 0, "loads": 0, "loaded_blocks": 0,
                                      "load_errors": 0, "failed_blocks": 0, "saves": 0, "save_errors": 0,
                                      "lookup_us": 0, "load_us": 0, "save_copy_us": 0, "declined": 0,
                                      "saves_dropped": 0, "prefill_tokens_per_s": 0}
        self._side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._store: ss.Store | None = None
        self._pools: list[Any] = []
        self._invalid: set[int] = set()
        self._handles: list[Any] = []
        self._reqs: dict[str, Track] = {}
        self._keys: dict[str, RequestKey] = {}  # req -> its key (tokens, namespace) or why it is declined
        self._matched: dict[str, tuple[int, int]] = {}  # req -> (snapshot id, tokens) of its last lookup
        self._stored: dict[str, tuple[int | str | None, int]] = {}  # req -> (its first save's parent, tokens matched)
        self._failed_now: set[str] = set()  # worker: requests whose load failed this step
        self._bad_now: set[int] = set()  # worker: blocks whose load failed this step
        self._failed: set[str] = set()  # worker: requests with a failed load whose saves must be recomputed ones
        self._to_load: dict[str, LoadOp] = {}  # req -> its planned load (built in update_state_after_alloc)
        self._hy: HybridLayout | None = None  # the parts of a multi-group cache; None: one attention group
        self._views: dict[str, list[Any]] = {}  # worker, hybrid: part name -> page views of its layers
        self._no_hit: set[str] = set()  # scheduler, hybrid: requests whose load failed: computed, not loaded
        self._recv_done: set[str] = set()  # worker, hybrid: async loads finished this step (failed ones too)
        self._recv_failed: set[str] = set()  # worker, hybrid: async loads that failed this step
        self._rate = StepRate()  # scheduler: the engine's prefill rate, for match(prefill_tokens_per_s=)
        self._prompt_len: dict[str, int] = {}  # scheduler: every running request's prompt length
        self._clock = ForwardClock()  # worker: times each prefilling step's forward (on the cache's device)
        self._tp, self._rank = 1, 0  # tensor parallel size, this worker's rank (set once the store opens)
        if role == KVConnectorRole.SCHEDULER and extra.get("on_load_error", "recompute") == "recompute":
            cfg.kv_load_failure_policy = "recompute"  # a failed load recomputes its blocks: never junk
        try:
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            self._hy = plan_groups(mc, kv_cache_config)
            extra_keys: dict[str, str] = {}
            if self._hy is None:  # one full-attention or MLA group
                self._geo, extra_keys = single_geometry(vllm_config, self._bs)
            else:  # the group layout and the state tensors' memory layout change the stored bytes
                self._bs = self._hy.block_size
                self._geo = hybrid_geometry(self._hy, kv_cache_config)
                extra_keys = {"kv_groups": describe_groups(kv_cache_config), "alignment": str(self._hy.alignment),
                              "ssm_conv_layout": os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "")}
            rank, self._tp = 0, int(pc.tensor_parallel_size)  # the scheduler matches as rank 0 (its chain)
            if role == KVConnectorRole.WORKER:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                rank = int(get_tensor_model_parallel_rank())
            self._rank = rank
            import vllm

            ident = self._geo.identity(
                build=f"vllm-{vllm.__version__}", kv=torch_dtype_name(self._geo.dtype),
                pack=str(extra.get("weights_hash") or weights_hash(str(mc.model))),
                backend=attn_backend(vllm_config, self._geo) if self._geo.entry else "none",
                tp=(rank, int(pc.tensor_parallel_size)),
                extra={"cache_dtype": str(vllm_config.cache_config.cache_dtype),
                       "config": config_digest(vllm_config), **extra_keys})
            layout = self._geo.layout()
            if self._hy is not None:
                layout = self._hy.layout()
                ident = dataclasses.replace(ident, mtp=any(p.draft for p in self._hy.parts))
            budget = ss.Budget(disk_bytes=int(extra["disk_mib"]) << 20 if "disk_mib" in extra else None)
            self._store = ss.Store.open(extra.get("path"), identity=ident, layout=layout, budget=budget,
                                        drop_stale=bool(extra.get("drop_stale", False)))
            atexit.register(self._close)  # queued saves land even when vLLM exits without shutdown()
        except Exception as e:  # any failure to open disables the connector; vLLM serves on without it
            log.error("snapstore connector disabled (%s side): cannot open the store at %r: %s: %s", self._side,
                      extra.get("path"), type(e).__name__, e)
            self._store = None
        self._warm_up()

    def _warm_up(self) -> None:
        """The first request's statement preparation, paid before serving; an optimisation only:
        a failure (a busy catalog) is logged and the connector serves on."""
        if self._store is None:
            return
        try:
            self._store.warm_up()
        except ss.SnapstoreError as e:
            log.warning("snapstore: warming up the store failed (%s); the first request pays it", e)

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep host views of every layer's cache; a cache that is not what the identity says
        (another layout, dtype, device) disables the connector with one log line."""
        first = next(iter(kv_caches.values()), None)
        self._clock = ForwardClock(getattr(first, "device", None))  # CUDA: timed with events
        if self._store is None:
            return
        try:
            if self._hy is not None:
                self._views = {p.name: group_views(p, kv_caches) for p in self._hy.parts}
                self._pools = [True]  # registered (the hybrid path reads self._views)
                return
            if len(kv_caches) != self._geo.layers:
                raise ss.LayoutError(f"{len(kv_caches)} cache tensors for {self._geo.layers} layers")
            self._pools = host_pools(list(kv_caches.values()), self._geo)
        except ss.SnapstoreError as e:
            log.error("snapstore connector disabled (worker side): %s", e)
            self._close()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """The step's metadata, just before its forward (and the loads vLLM runs first): the
        forward's clock starts for a step that prefills."""
        super().bind_connector_metadata(connector_metadata)
        self._clock.begin(getattr(connector_metadata, "prefill_tokens", 0))

    def build_connector_worker_meta(self) -> SnapstoreWorkerMetadata | None:
        """The forward times of the steps that prefilled, for the scheduler's prefill rate."""
        steps = self._clock.take()
        return SnapstoreWorkerMetadata(steps) if steps else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Restore every planned load into its blocks before the forward; a failure marks them invalid."""
        t_in = time.perf_counter()
        try:
            self._start_load_kv()
        finally:  # inside the forward's window (before or after the forward): not forward time
            self._clock.loaded(time.perf_counter() - t_in)

    def _start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        self._failed_now.clear()
        self._bad_now.clear()
        if self._store is None or not self._pools or not isinstance(meta, SnapstoreConnectorMetadata):
            for op in getattr(meta, "loads", []):  # nothing can load: vLLM recomputes the blocks
                self._load_failed(op)
            return
        t0 = time.perf_counter()
        for op in meta.loads:
            try:
                if self._hy is not None:
                    self._load_hybrid(op)
                    continue
                self._store.restore(self._shard(op), into={"kv": BlockWriter(self._pools, op.block_ids)},
                                    rows_from=op.rows_from)
                self.stats["loads"] += 1
                self.stats["loaded_blocks"] += len(op.block_ids) - op.rows_from
            except ss.SnapstoreError as e:  # corrupt / missing chunk, evicted snapshot: recompute, never junk
                self.stats["load_errors"] += 1
                self.stats["failed_blocks"] += len(op.block_ids) - op.rows_from
                self._load_failed(op)
                log.warning("snapstore: load for request %s failed%s, vLLM recomputes %d blocks: %s", op.req_id,
                            f" on tensor-parallel rank {self._rank}" if self._tp > 1 else "",
                            len(op.block_ids) - op.rows_from, e)
        self.stats["load_us"] += int((time.perf_counter() - t0) * 1e6)
        LAST_STATS[self._side] = dict(self.stats)

    def _shard(self, op: LoadOp) -> ss.Match:
        """What this rank restores for ``op``: the scheduler's match names rank 0's snapshot; under
        tensor parallelism every other rank finds its own shard of the same tokens (its own chain,
        saved by the same save plan). A rank that holds less fails its load: its blocks are reported,
        vLLM pools every rank's failed blocks and recomputes them on all ranks (never a mix)."""
        if op.tokens is None or self._rank == 0:
            return ss.Match(op.snapshot_id, op.n_tokens, op.namespace)
        assert self._store is not None
        m = self._store.match(op.tokens, namespace=op.namespace)
        if m is None or m.n_tokens < op.n_tokens:
            raise ss.SnapshotUnavailableError(
                f"tensor-parallel rank {self._rank} holds {m.n_tokens if m else 0} of the {op.n_tokens} tokens rank 0 "
                "matched (its shard was not saved, was evicted or dropped)")
        return ss.Match(m.snapshot_id, op.n_tokens, op.namespace)

    def _load_failed(self, op: LoadOp) -> None:
        """Report the blocks (vLLM recomputes them) and keep this step's saves off them: the
        forward that follows read whatever the blocks held. A hybrid's load is reported per
        request (vLLM cannot map one group's block ids back to requests): it recomputes it whole."""
        if self._hy is not None:
            self._recv_done.add(op.req_id)
            self._recv_failed.add(op.req_id)
            self._failed_now.add(op.req_id)
            self._failed.add(op.req_id)
            return
        self._invalid.update(op.block_ids[op.rows_from:])
        self._bad_now.update(op.block_ids[op.rows_from:])
        self._failed_now.add(op.req_id)
        self._failed.add(op.req_id)

    def _save_sound(self, op: SaveOp) -> bool:
        """Whether ``op`` covers only rows its request computed or loaded: not when a load of it
        failed this step or before the save was planned, nor when its blocks failed to load."""
        if op.recomputed:
            self._failed.discard(op.req_id)
        elif op.req_id in self._failed:
            return False
        return op.req_id not in self._failed_now and self._bad_now.isdisjoint(op.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are complete when :meth:`start_load_kv` returns."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole, every layer at once, after the forward (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Copy each finished prompt's blocks once and queue its saves (``wait=False``): the
        disk work runs on the store's writer thread, off the forward pass."""
        self._clock.end()  # the forward is over: its time is the step's (for a step that prefilled)
        meta = self._get_connector_metadata()
        if self._store is None or not self._pools or not isinstance(meta, SnapstoreConnectorMetadata):
            return
        self._reap()
        for op in meta.saves:
            if not self._save_sound(op):
                self.stats["saves_dropped"] += 1
                log.warning("snapstore: not saving request %s: a load of it failed, vLLM recomputes it", op.req_id)
                continue
            if self._hy is not None:
                self._save_hybrid(op)
                continue
            t0 = time.perf_counter()
            rows = gather_blocks(self._pools, op.block_ids)
            self.stats["save_copy_us"] += int((time.perf_counter() - t0) * 1e6)
            parent = op.parent
            for b in op.boundaries:  # FIFO: each later boundary is a delta over the one before it ("auto")
                try:
                    self._handles.append(self._store.save(op.tokens[:b], {"kv": rows}, rows=b // self._bs,
                                                          parent=parent, namespace=op.namespace, wait=False))
                    parent = "auto"
                except ss.SnapstoreError as e:
                    self.stats["save_errors"] += 1
                    log.warning("snapstore: save for request %s failed: %s", op.req_id, e)
                    break
        LAST_STATS[self._side] = dict(self.stats)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid's loads finished this step, and the ones that failed (vLLM recomputes those)."""
        if self._hy is None:
            return super().get_transfer_results(finished_req_ids)
        out = KVConnectorTransferResults(finished_recving=set(self._recv_done), failed_recving=set(self._recv_failed))
        self._recv_done.clear()
        self._recv_failed.clear()
        return out

    def _reap(self) -> None:
        """Count the saves that finished (errors are logged, never raised into vLLM)."""
        live = []
        for h in self._handles:
            if not h.done():
                live.append(h)
                continue
            try:
                res = h.result()
                self.stats["saves"] += 1 if res.ok else 0
            except ss.SnapstoreError as e:
                self.stats["save_errors"] += 1
                log.warning("snapstore: a save failed: %s", e)
        self._handles = live

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: vLLM recomputes them."""
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self) -> None:
        """Wait for queued saves and close the store."""
        self._close()

    def _close(self) -> None:
        if self._store is not None:
            try:
                self._store.flush()
                self._reap()
                self._store.close()
            except ss.SnapstoreError as e:
                log.warning("snapstore: closing the store failed: %s", e)
            finally:
                self._store = None
        LAST_STATS[self._side] = dict(self.stats)
