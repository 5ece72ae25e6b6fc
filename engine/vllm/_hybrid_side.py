"""The connector's hybrid half (several KV cache groups, ``SupportsHMA``): the lookup of an exact
stored boundary, the saves planned at each boundary vLLM holds a state for, and the worker's
page-wise load and save. A base of :class:`SnapstoreConnector`, which supplies the state declared here."""

from __future__ import annotations

import logging
import time
from typing import Any

import snapstore as ss

from ._groups import GroupPart, HybridLayout
from ._hybrid import PageWriter, gather_pages
from ._key import RequestKey
from ._ops import LAST_STATS, NULL_BLOCK, LoadOp, SaveOp, SnapstoreConnectorMetadata, Track

__all__ = ["HybridSide"]

log = logging.getLogger("snapstore.vllm")


class HybridSide:
    """Hybrid lookups, save plans, loads and saves (docs/engine.md "Hybrid models")."""

    _store: ss.Store | None
    _hy: HybridLayout | None
    _bs: int
    _every: int
    _side: str
    stats: dict[str, int]
    _handles: list[Any]
    _reqs: dict[str, Track]
    _views: dict[str, list[Any]]
    _no_hit: set[str]
    _recv_done: set[str]
    _matched: dict[str, tuple[int, int]]
    _stored: dict[str, tuple[int | str | None, int]]

    def _shard(self, op: LoadOp) -> ss.Match:  # SnapstoreConnector's: this rank's snapshot of the hit
        raise NotImplementedError

    def _lookup_hybrid(self, request: Any, key: RequestKey, num_computed_tokens: int) -> tuple[int, bool]:
        """A hybrid's hit: the longest stored boundary that is a prefix of the prompt (exact: a
        state is valid only where it was captured), aligned, its chain and chunks all there, and
        not a request whose load failed before. Loaded asynchronously (True): a failed load is
        then reported per request and vLLM recomputes it."""
        assert self._store is not None and self._hy is not None
        rid = request.request_id
        limit = self._hy.boundary(len(key.tokens) - 1)  # at least one prompt token is computed
        if limit <= num_computed_tokens or rid in self._no_hit:
            return 0, False
        self.stats["lookups"] += 1
        t0 = time.perf_counter()
        try:
            m = self._store.match(key.tokens[:limit], namespace=key.namespace)
            if m is None or m.n_tokens % self._hy.alignment or m.n_tokens <= num_computed_tokens \
                    or m.n_tokens < self._hy.min_boundary:
                return 0, False
            d = self._store.describe(m.snapshot_id, namespace=key.namespace)
            if d.n_tokens != m.n_tokens or dict(d.rows) != self._hy.rows(m.n_tokens):
                return 0, False  # never attention rows without the state at their end, nor a part of one
            self._stored[rid] = (m.snapshot_id, m.n_tokens)
            self._matched[rid] = (m.snapshot_id, m.n_tokens)
            self.stats["hit_tokens"] += m.n_tokens - num_computed_tokens
        except ss.SnapstoreError as e:
            log.warning("snapstore: lookup for request %s failed (%s); computing it", rid, e)
            return 0, False
        finally:
            self.stats["lookup_us"] += int((time.perf_counter() - t0) * 1e6)
            LAST_STATS[self._side] = dict(self.stats)  # after every lookup, a miss too: its time is that request's
        return m.n_tokens - num_computed_tokens, True

    def _plan_hybrid_saves(self, meta: SnapstoreConnectorMetadata, computed: dict[str, int],
                           scheduler_output: Any) -> None:
        """A save at each boundary whose pages vLLM holds after this step. With a recurrent state:
        the end of this step's chunk when it is aligned (the state lies in the block that ends
        there), or, when the chunk ends the prompt, the prompt's last aligned boundary (vLLM's
        prefill checkpoint). Without one (full + sliding-window groups): every ``save_every``
        boundary the step computed and the prompt's last one (a sliding group's window blocks
        below a boundary the step reached are all still held: vLLM frees blocks only when the
        next step is scheduled). Each is a delta over the one before it; rows only above the
        request's stored prefix."""
        assert self._hy is not None
        for rid, done in computed.items():
            tr = self._reqs[rid]
            n_prompt = len(tr.key.tokens)
            end = done + int(scheduler_output.num_scheduled_tokens.get(rid, 0))
            if tr.saved or end <= done:
                continue
            last = self._hy.boundary(n_prompt) if end >= n_prompt else None
            if last is not None:
                tr.saved = True
            if self._hy.has_state:
                ats = [last] if last is not None else [end] if end % self._hy.alignment == 0 else []
            else:
                step = max(self._every, self._hy.alignment) // self._hy.alignment * self._hy.alignment
                ats = [b for b in range(step, min(end, n_prompt) + 1, step) if b > done]
                ats += [last] if last is not None and last not in ats else []
            floor = max(done, tr.stored, tr.last)
            for at in ats:
                if at <= floor or at < max(self._bs, self._hy.min_boundary):
                    continue
                try:
                    groups = [p.blocks_at(tr.groups[p.group], at, self._bs) for p in self._hy.parts]
                except IndexError:
                    log.warning("snapstore: request %s has fewer blocks than its boundary %d needs; not saved", rid,
                                at)
                    continue
                if any(p.kind != "attn" and NULL_BLOCK in g for p, g in zip(self._hy.parts, groups)):
                    continue  # vLLM's null block: no state (or window block) was kept at this boundary
                main = self._hy.main
                meta.saves.append(SaveOp(rid, tr.key.tokens[:at], groups[main], [at], tr.key.namespace, tr.parent,
                                         tr.failed, groups))
                tr.parent, tr.last, floor = "auto", at, at

    def _load_hybrid(self, op: LoadOp) -> None:
        """Restore every group's part of a hybrid snapshot (attention rows above ``rows_from``,
        each state page into the block that ends at the boundary); an asynchronous load, reported
        finished (or failed) by :meth:`get_transfer_results`."""
        assert self._store is not None and self._hy is not None
        self._recv_done.add(op.req_id)
        if any(p.kind != "attn" and NULL_BLOCK in ids for p, ids in zip(self._hy.parts, op.groups)):
            raise ss.DestinationError(f"vLLM allocated no state (or window) block for request {op.req_id} at token "
                                      f"{op.n_tokens}")
        into = {p.name: PageWriter(self._views[p.name], self._writable(p, ids, op)) for p, ids in
                zip(self._hy.parts, op.groups)}
        res = self._store.restore(self._shard(op), into=into, rows_from=op.rows_from)
        if res.missing_components:  # an older snapshot without the draft: the target's state is whole
            log.info("snapstore: snapshot %d lacks %s; drafts for request %s start empty", op.snapshot_id,
                     sorted(res.missing_components), op.req_id)
        self.stats["loads"] += 1
        self.stats["loaded_blocks"] += len(op.block_ids) - op.rows_from

    def _writable(self, part: GroupPart, ids: list[int], op: LoadOp) -> list[int]:
        """A window part's blocks below ``op.rows_from`` are vLLM's own cached blocks (a local
        prefix hit): -1, never written (:class:`PageWriter`); every other part's ids as they are."""
        if part.kind != "window":
            return ids
        first = op.n_tokens // self._bs - len(ids)  # the block index of the window's first block
        return [-1 if first + j < op.rows_from else b for j, b in enumerate(ids)]

    def _save_hybrid(self, op: SaveOp) -> None:
        """Copy a hybrid boundary's pages (attention blocks below it, the state page at it) and
        queue its save: a delta over ``op.parent``, rows only above it, the state whole."""
        assert self._store is not None and self._hy is not None
        t0 = time.perf_counter()
        parts: dict[str, Any] = {}
        for p, ids in zip(self._hy.parts, op.groups):
            pages = gather_pages(self._views[p.name], ids, len(p.layers))
            parts[p.name] = pages[0] if p.kind == "state" else pages
        self.stats["save_copy_us"] += int((time.perf_counter() - t0) * 1e6)
        at = op.boundaries[-1]
        try:
            self._handles.append(self._store.save(op.tokens[:at], parts, rows=self._hy.rows(at), parent=op.parent,
                                                  namespace=op.namespace, wait=False))
        except ss.SnapstoreError as e:
            self.stats["save_errors"] += 1
            log.warning("snapstore: save for request %s failed: %s", op.req_id, e)
