"""The connector's scheduler half: each request's key, the lookup of its stored prefix (from the
catalog alone), the load planned once its blocks are allocated, the saves planned once its prompt
blocks are computed, and the prefill rate from the workers' step times. A base of
:class:`SnapstoreConnector`, which supplies the state declared here; over :class:`HybridSide`,
whose lookups and save plans it hands hybrid models to. The worker half stays in ``_connector``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import snapstore as ss

from ._hybrid_side import HybridSide
from ._key import RequestKey, request_key
from ._ops import LAST_STATS, LoadOp, SaveOp, SnapstoreConnectorMetadata, SnapstoreWorkerMetadata, Track
from ._rate import StepRate, prefill_tokens

__all__ = ["SchedulerSide"]

log = logging.getLogger("snapstore.vllm")


class SchedulerSide(HybridSide):
    """Lookups, load plans, save plans and the prefill rate (vLLM's scheduler-side connector calls)."""

    _keys: dict[str, RequestKey]
    _to_load: dict[str, LoadOp]
    _rate: StepRate
    _prompt_len: dict[str, int]
    _tp: int

    def _key(self, request: Any) -> RequestKey:
        """The request's key (kept for its lifetime): a declined one is counted and logged once."""
        rid = request.request_id
        key = self._keys.get(rid)
        if key is None:
            key = self._keys[rid] = request_key(request)
            if key.declined is not None:
                self.stats["declined"] += 1
                log.info("snapstore: request %s is neither loaded nor saved: it carries %s, which the store "
                         "cannot key", rid, key.declined)
        return key

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local prefix cache that the store holds, whole blocks, from the catalog
        alone (``match`` + ``describe``: no K/V is read), under the request's key (its adapter and
        salt's namespace, its multimodal items). At least one prompt token is left to compute."""
        if self._store is None:
            return 0, False
        key = self._key(request)
        if key.declined is not None:
            return 0, False
        if self._hy is not None:
            return self._lookup_hybrid(request, key, num_computed_tokens)
        prompt = key.tokens
        limit = (len(prompt) - 1) // self._bs * self._bs
        if limit <= 0:
            return 0, False
        self.stats["lookups"] += 1
        t0 = time.perf_counter()
        try:  # match + describe in one catalog read (issue 31); weighed against prefill once its rate is known
            d = self._store.lookup(prompt[:limit], namespace=key.namespace,
                                   prefill_tokens_per_s=self._rate.tokens_per_s)
            if d is None:
                return 0, False
            hit = min(d.n_tokens, limit) // self._bs * self._bs
            hit = min(hit, min(d.rows.values(), default=0) * self._bs)  # never more blocks than it writes
            # a whole stored snapshot is the explicit parent of this request's first save
            self._stored[request.request_id] = (d.snapshot_id if hit == d.snapshot_tokens else "auto", hit)
            if hit <= num_computed_tokens:
                return 0, False
            self._matched[request.request_id] = (d.snapshot_id, hit)
            self.stats["hit_tokens"] += hit - num_computed_tokens
        except ss.SnapstoreError as e:
            log.warning("snapstore: lookup for request %s failed (%s); computing it", request.request_id, e)
            return 0, False
        finally:
            self.stats["lookup_us"] += int((time.perf_counter() - t0) * 1e6)
            LAST_STATS[self._side] = dict(self.stats)  # after every lookup, a miss too: its time is that request's
        return hit - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the matched blocks once vLLM allocated them."""
        if num_external_tokens > 0 and request.request_id in self._matched and self._hy is not None:
            sid, hit = self._matched[request.request_id]
            per_group = blocks.get_block_ids()
            groups = [p.blocks_at(per_group[p.group], hit, self._bs) for p in self._hy.parts]
            main, key = self._hy.main, self._keys[request.request_id]
            self._to_load[request.request_id] = LoadOp(request.request_id, sid, hit,
                                                       (hit - num_external_tokens) // self._bs, groups[main],
                                                       key.namespace, groups,
                                                       tokens=key.tokens[:hit] if self._tp > 1 else None)
        elif num_external_tokens > 0 and request.request_id in self._matched:
            sid, hit = self._matched[request.request_id]
            ids = list(blocks.get_block_ids()[0])  # every block of the request, resumed ones too
            key = self._keys[request.request_id]
            self._to_load[request.request_id] = LoadOp(request.request_id, sid, hit,
                                                       (hit - num_external_tokens) // self._bs, ids[:hit // self._bs],
                                                       key.namespace, tokens=key.tokens[:hit] if self._tp > 1 else None)

    def build_connector_meta(self, scheduler_output: Any) -> SnapstoreConnectorMetadata:
        """This step's loads (newly scheduled requests with a match) and saves (requests whose
        prompt blocks are all computed after this step)."""
        meta = SnapstoreConnectorMetadata()
        meta.prefill_tokens = self._step_prefill(scheduler_output)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            key = self._keys.get(rid)
            if key is None or key.declined is not None:
                continue  # never looked up (nothing to key it by) or declined: no save
            parent, stored = self._stored.get(rid, ("auto", 0))
            self._reqs[rid] = Track(key, list(new.block_ids[0]), stored, parent)
            if self._hy is not None:
                self._reqs[rid].groups = [list(ids) for ids in new.block_ids]
                if rid in self._no_hit:  # its load failed: vLLM recomputes it, its saves are recomputed ones
                    t = self._reqs[rid]
                    t.failed, t.stored, t.parent = True, 0, None
            computed[rid] = int(new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._reqs.get(rid)
            if tr is None:
                continue
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tr.blocks = list(ids[0]) if ids is not None else []
                tr.groups = [list(g) for g in ids] if ids is not None else []
            elif ids is not None:
                tr.blocks.extend(ids[0])
                for have, more in zip(tr.groups, ids):
                    have.extend(more)
            computed[rid] = int(cached.num_computed_tokens[i])
        meta.loads.extend(self._to_load.values())
        self._to_load.clear()
        if self._hy is not None:
            self._plan_hybrid_saves(meta, computed, scheduler_output)
            computed = {}
        for rid, done in computed.items():
            tr = self._reqs[rid]
            n_save = len(tr.key.tokens) // self._bs * self._bs
            if tr.saved or n_save <= tr.stored:
                continue
            if done + int(scheduler_output.num_scheduled_tokens.get(rid, 0)) >= n_save:
                bounds = [b for b in range(self._every, n_save, self._every) if b > tr.stored] + [n_save]
                meta.saves.append(SaveOp(rid, tr.key.tokens[:n_save], tr.blocks[:n_save // self._bs], bounds,
                                         tr.key.namespace, tr.parent, tr.failed))
                tr.saved = True
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        return meta

    def _step_prefill(self, scheduler_output: Any) -> int:
        """The prompt tokens this step computes (every scheduled request's, keyed or not): what the
        workers' forward time of the step is a rate of."""
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._prompt_len[new.req_id] = len(getattr(new, "prompt_token_ids", None) or ())
            computed[new.req_id] = int(new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = int(cached.num_computed_tokens[i])
        for rid in scheduler_output.finished_req_ids:
            self._prompt_len.pop(rid, None)
        return prefill_tokens(dict(scheduler_output.num_scheduled_tokens), computed, self._prompt_len)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' forward times of the steps that prefilled feed the prefill rate. A failed
        load (blocks the workers reported): vLLM recomputes the request's blocks, so its save
        starts over — planned again once they are computed, every row, no parent (the save the
        failing step planned was dropped by the worker)."""
        timed = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(timed, SnapstoreWorkerMetadata) and timed.steps:
            for tokens, seconds in timed.steps:
                self._rate.observe(tokens, seconds)
            self.stats["prefill_tokens_per_s"] = int(self._rate.tokens_per_s or 0)
            LAST_STATS[self._side] = dict(self.stats)
        for rid in getattr(connector_output, "failed_recving", None) or ():  # a hybrid's failed async load
            self._no_hit.add(rid)
            self._stored[rid] = (None, 0)
            self._matched.pop(rid, None)
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not bad:
            return
        for tr in self._reqs.values():
            if bad.intersection(tr.blocks):
                tr.failed, tr.saved, tr.stored, tr.parent = True, False, 0, None

    def _forget(self, rid: str) -> None:
        for table in (self._reqs, self._matched, self._stored, self._keys, self._prompt_len):
            table.pop(rid, None)
        self._no_hit.discard(rid)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves copy the blocks at once, so vLLM may free them now."""
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: as :meth:`request_finished` (saves copied the pages they need)."""
        return self.request_finished(request, [])
