"""PrefixCache: a persistent, exact, hybrid-aware prefix cache for a transformers model, in one line.

``PrefixCache(model).generate(input_ids, **generate_kwargs)`` returns what ``model.generate``
returns, and keeps the state of every prompt it reads in a snapstore store: before generating it
restores the deepest stored snapshot at one of the call's *cuts* and reads only the rest; while it
reads, it captures snapshots at the cuts as pending saves, commits them when the call returns
normally and abandons them when it raises. The policy is described in docs/engine.md, section 9.

The cuts (``PrefixCache.split``) depend only on the prompt length, ``boundary`` and the call's
``cache_prefix`` — never on what the store holds — so a hit and a miss read the prompt in the same
pieces and return the same bytes: chunked prefill is not bitwise equal to one-shot prefill, but
chunked prefill with the same chunks is. ``uncached_generate`` is that reference run (no store).

The identity follows the model as it is at each call (:mod:`._prefix_watch`): a weight update,
config change, adapter switch or numerics setting since the last call re-hashes and switches the
store to the new identity. A call whose arguments are not all known to give ``model.generate``'s
numbers through the store (``_prefix_generate.bypass_reason``) goes to ``model.generate`` unchanged.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from snapstore import (
    Budget,
    ConfigError,
    InvalidInputError,
    Match,
    NotFoundError,
    PrefillRate,
    RestoreError,
    SaveResult,
    StateError,
    StoreIOError,
)

from .._prefix_policy import COUNTERS, CachePrefix, PrefixCacheStats, check_boundary, default_boundary
from .._prefix_policy import cuts as _cuts
from ..torch import TokenIds
from . import _cache
from ._capture import Captures
from ._generate import (
    BatchNotSupportedError,
    ForwardTimer,
    Generated,
    PromptEnd,
    _generator,
    bypass_reason,
    check_call,
    generate_rest,
    prefill,
)
from ._watch import Look

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from ..torch import TorchAdapter

__all__ = ["BatchNotSupportedError", "PrefixCache", "PrefixCacheStats", "default_boundary"]

log = logging.getLogger("snapstore.engine.prefix_cache")

RESUME = ("cut", "longest")


class PrefixCache:
    """A persistent prefix cache for one transformers model: ``generate`` restores, reads the rest, captures.

    path: the store directory (None: ``$SNAPSTORE_DIR``, else the per-user cache dir). boundary:
    tokens between automatic snapshots while reading a prompt (None: :func:`default_boundary`;
    0: none). budget: a :class:`snapstore.Budget` (None: environment / defaults). resume: ``"cut"``
    (default) restores only at one of the call's cuts, so the output is byte-identical to
    :meth:`uncached_generate`; ``"longest"`` restores the longest stored prefix wherever it ends
    (more reuse; the output then equals ``uncached_generate`` with that position added to
    ``cache_prefix``). pack: the checkpoint's hash for the identity (default: SHA-256 of the
    weights; after a weight change is seen, the SHA-256 of the weights as they are then).
    store_options go to :func:`snapstore.engine.hf.open_store` (drop_stale, chunk_bytes, codec,
    staging_bytes, check_rows, staging, extra). One ``generate`` at a time per instance.
    ``store`` and ``adapter`` are replaced when the identity changes.
    """

    def __init__(self, model: PreTrainedModel, path: str | os.PathLike[str] | None = None, *,
                 boundary: int | None = None, budget: Budget | None = None, resume: str = "cut",
                 pack: str | None = None, **store_options: Any):
        check_boundary(boundary)
        if resume not in RESUME:
            raise ConfigError(f"resume must be one of {RESUME}, got {resume!r}")
        if "batch" in store_options:
            raise ConfigError("PrefixCache serves batch size 1; do not pass batch=")
        self.model = model
        self.device = next(model.parameters()).device
        self._seen = Look(model)  # what the identity is computed from, as it was when computed
        self._pack = pack or "sha256:" + _cache.weights_sha256(model)
        self._extra = dict(store_options.pop("extra", None) or {})
        self._budget, self._options = budget, store_options
        extra = {**self._extra, **self._seen.identity_extra(model)}
        self.adapter: TorchAdapter = _cache.open_store(model, path, pack=self._pack, budget=budget, extra=extra,
                                                   **store_options)
        self.store = self.adapter.store
        self._boundary = boundary
        self.boundary = default_boundary(self.store.layout) if boundary is None else boundary
        self.resume = resume
        self._lock = threading.Lock()
        self._n: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._told: set[str] = set()
        self._closed = False
        # this cache's own prefill rate (tokens/s: a prompt's tokens over the time of the model's forwards that
        # read them), passed to match() so a restore estimated slower than reading its tokens is not made
        self.prefill_rate = PrefillRate()

    # -- the split ------------------------------------------------------------------------------
    def split(self, n_tokens: int, cache_prefix: CachePrefix = None) -> list[int]:
        """The cuts a ``generate`` of an ``n_tokens`` prompt reads at (sorted, each < n_tokens).

        Every multiple of ``boundary`` and every ``cache_prefix`` position below the prompt's end.
        The prompt is read in the pieces between cuts, the last piece by ``model.generate`` itself.
        """
        return _cuts(n_tokens, self.boundary, cache_prefix)

    # -- generate -------------------------------------------------------------------------------
    def generate(self, input_ids: TokenIds, *, cache_prefix: CachePrefix = None, session: str | None = None,
                 namespace: str | None = None, **generate_kwargs: Any) -> Generated:
        """``model.generate(input_ids, **generate_kwargs)`` through the prefix cache; returns what it returns.

        cache_prefix: a position (or list) to snapshot exactly at — the end of the system prompt or
        of the previous turn — so later prompts sharing it restore all of it. session: the
        conversation's key; the prompt's own snapshot supersedes the session's previous one.
        namespace: a tenant scope (nothing is matched or shared across namespaces).
        """
        from transformers import DynamicCache

        ids = self._check(input_ids, generate_kwargs)
        if session is not None and (not isinstance(session, str) or not session):
            raise InvalidInputError(f"session must be None or a non-empty string, got {session!r}")
        tokens: list[int] = ids[0].tolist()
        n = len(tokens)
        cuts = self.split(n, cache_prefix)
        why = self._bypass_reason(generate_kwargs)
        if why is not None:
            return self._bypass(ids, why, generate_kwargs)
        self._follow()
        m, prompt_stored = self._lookup(tokens, cuts, namespace)
        cache, start, parent = None, 0, None
        if m is not None:
            cache, start, parent = self._restore(m, session)
            if self.resume == "longest" and start and start not in cuts:
                cuts = sorted({*cuts, start})
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        self._add(calls=1, hits=int(start > 0), misses=int(start == 0), prompt_tokens=n, restored_tokens=start,
                  prefilled_tokens=n - start)
        caps = Captures(self.store.layout, self._save, lambda: self._add(captures=1), parent, namespace)
        timer = ForwardTimer(self.model, self.device)  # the prompt's forwards only: the rate match() weighs

        def capture(upto: list[int], as_session: str | None) -> None:
            if self.store.read_only:  # a cache baked into a read-only image: it generates, saves nothing
                self._add(skipped=1)
            else:
                caps.add(cache, upto, as_session)

        def at_cut(c: int) -> None:
            capture(tokens[:c], None)

        def prompt_end() -> None:
            self.prefill_rate.observe(n - start, timer.stop())
            if not prompt_stored and cache.get_seq_length() == n:
                capture(tokens, session)

        try:
            prefill(self.model, ids, cache, start, cuts, at_cut)
            out = generate_rest(self.model, ids, cache, generate_kwargs, PromptEnd(prompt_end))
            caps.wait()
        except BaseException:
            caps.drain()
            self._abandon(caps.results)
            raise
        finally:
            timer.close()
        if Look(self.model).same(self._seen):
            self._commit(caps.results)
        else:  # the model changed during the call (a callback, another thread): its captures may mix states
            log.warning("prefix cache: the model changed during the call; its %d captures are dropped",
                        len(caps.results))
            self._abandon(caps.results)
        return out

    def uncached_generate(self, input_ids: TokenIds, *, cache_prefix: CachePrefix = None,
                          **generate_kwargs: Any) -> Generated:
        """What ``generate`` returns, computed from token 0 without the store: the byte-identical reference.

        ``model.generate`` over a cache prefilled at the same cuts (``split``); with no cuts it is
        plain ``model.generate(input_ids, **generate_kwargs)``.
        """
        from transformers import DynamicCache

        ids = self._check(input_ids, generate_kwargs)
        if self._bypass_reason(generate_kwargs) is not None:
            out: Generated = _generator(self.model).generate(ids, **generate_kwargs)
            return out
        cache = DynamicCache(config=self.model.config)
        prefill(self.model, ids, cache, 0, self.split(ids.shape[1], cache_prefix), None)
        return generate_rest(self.model, ids, cache, generate_kwargs, None)

    # -- steps ----------------------------------------------------------------------------------
    def _check(self, input_ids: TokenIds, kw: dict[str, Any]) -> torch.Tensor:
        """input_ids as a (1, n) long tensor on the model's device; refuse a closed cache and what it cannot serve."""
        if self._closed:
            raise StateError("this PrefixCache is closed")
        self.device = next(self.model.parameters()).device  # where the model is now (it may have moved)
        return check_call(self.model, self.device, input_ids, kw)

    def _bypass_reason(self, kw: dict[str, Any]) -> str | None:
        """Why this call goes to model.generate unchanged (see ``bypass_reason``), or None."""
        if self.model.training or any(m.training and isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
                                      for m in self.model.modules()):
            return "the model is in training mode (dropout draws anew each forward); call model.eval()"
        return bypass_reason(self.model, kw)

    def _bypass(self, ids: torch.Tensor, why: str, kw: dict[str, Any]) -> Generated:
        """``model.generate(ids, **kw)`` as called: nothing restored or saved (counted; logged once per reason)."""
        self._add(calls=1, bypassed=1)
        if why not in self._told:
            self._told.add(why)
            log.info("prefix cache: %s; calling model.generate directly (nothing restored or saved)", why)
        out: Generated = _generator(self.model).generate(ids, **kw)
        return out

    def refresh(self) -> None:
        """Re-hash the weights now and switch the identity if they changed: for a change no per-call
        look sees (an in-place write through ``.data``, a NumPy or DLPack view of a weight)."""
        if self._closed:
            raise StateError("this PrefixCache is closed")
        self._follow(rehash=True)

    def _follow(self, rehash: bool = False) -> None:
        """Before a call: if what the identity is computed from changed since, compute it again (re-hash
        the weights if a tensor or adapter changed) and switch the store to it when it differs."""
        now = Look(self.model)
        if not rehash and now.same(self._seen):
            return
        if rehash or not now.same_tensors(self._seen) or now.adapters != self._seen.adapters:
            self._pack = "sha256:" + _cache.weights_sha256(self.model)  # the weights as they are now
        extra = {**self._extra, **now.identity_extra(self.model)}
        if _cache.identity(self.model, pack=self._pack, extra=extra) != self.store.identity:
            opts = {**self._options, "staging": self.adapter.staging}
            adapter = _cache.open_store(self.model, self.store.path, pack=self._pack, budget=self._budget, extra=extra,
                                    **opts)
            old, self.adapter, self.store = self.store, adapter, adapter.store
            old.close()
            if self._boundary is None:
                self.boundary = default_boundary(self.store.layout)
            self._add(identity_changes=1)
            log.info("prefix cache: the model changed since the last call (weights, config, adapters or numerics); "
                     "its identity is now %s", self.store.identity.key)
        self._seen = now

    def _lookup(self, tokens: list[int], cuts: list[int], namespace: str | None) -> tuple[Match | None, bool]:
        """The snapshot to resume from (deepest at a cut, or the longest), and whether the whole prompt is stored."""
        n = len(tokens)
        rate = self.prefill_rate.tokens_per_s  # None until measured: the longest prefix, as before
        m = self.store.match(tokens, namespace=namespace, prefill_tokens_per_s=rate)
        prompt_stored = m is not None and m.n_tokens == n
        while m is not None:
            if m.n_tokens < n and (self.resume == "longest" or m.n_tokens in cuts):
                return m, prompt_stored
            # a snapshot off the split (or the whole prompt: the last token must be read to get
            # its logits): look again below it, at the deepest cut (or one token short of the prompt)
            below = n - 1 if self.resume == "longest" else max((c for c in cuts if c < m.n_tokens), default=0)
            if below <= 0:
                break
            m = self.store.match(tokens[:below], namespace=namespace, prefill_tokens_per_s=rate)
        return None, prompt_stored

    def _restore(self, m: Match, session: str | None) -> tuple[DynamicCache | None, int, int | None]:
        """Restore ``m`` into a fresh cache (as ``session``: the conversation's own snapshots stay
        supersedable); on failure (damage, eviction race) read from token 0 instead."""
        t0 = time.perf_counter()
        try:
            cache, res = _cache.restore(self.model.config, self.adapter, m, device=self.device, session=session)
        except (RestoreError, NotFoundError) as e:
            # the split does not depend on the store, so re-reading from 0 yields the same bytes
            log.warning("prefix cache: restoring snapshot %s failed (%s); reading the prompt from token 0",
                        m.snapshot_id, e)
            self._add(restore_fallbacks=1)
            return None, 0, None
        self._add(restore_seconds=time.perf_counter() - t0)
        return cache, res.n_tokens, m.snapshot_id

    def _save(self, tokens: list[int], parts: dict[str, Any], snap: _cache.CacheSnapshot, parent: int | None,
              session: str | None, namespace: str | None) -> SaveResult | None:
        """One pending capture; a failing disk skips the capture (counted), it does not fail the call."""
        kw: dict[str, Any] = {"commit": False, "session": session, "namespace": namespace,
                              "token_dims": snap.token_dims, "pad_rows": snap.pad_rows}
        try:
            try:
                res = self.adapter.save(tokens, parts, parent=parent, **kw)
            except NotFoundError:
                # the parent was evicted meanwhile: store this capture whole
                res = self.adapter.save(tokens, parts, parent=None, **kw)
        except StoreIOError as e:
            log.warning("prefix cache: capture at %d tokens failed (%s); continuing without it", len(tokens), e)
            self._add(skipped=1)
            return None
        if not res.ok:
            self._add(skipped=1)
        return res

    def _commit(self, pending: list[SaveResult]) -> None:
        """Commit the call's captures (one chain: committing the deepest commits them all, root first)."""
        if not pending:
            return
        try:
            res = self.store.commit(pending[-1])
        except StoreIOError as e:
            log.warning("prefix cache: commit failed (%s); the captures are dropped", e)
            self._abandon(pending)
            return
        if res.ok:
            self._add(committed=len(pending))
        else:
            self._add(skipped=len(pending))

    def _abandon(self, pending: list[SaveResult]) -> None:
        """Drop the call's pending captures (abandoning the first drops its pending descendants)."""
        if not pending:
            return
        try:
            self.store.abandon(pending[0])
        except StoreIOError as e:  # the next open (or gc) drops them: their owner is gone by then
            log.warning("prefix cache: abandon failed (%s)", e)
        self._add(abandoned=len(pending))

    def _add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self._n[k] += v

    # -- the rest -------------------------------------------------------------------------------
    def stats(self) -> PrefixCacheStats:
        """Per-call counters since open (hits, tokens restored vs read, captures) and the store's Stats."""
        with self._lock:
            n = dict(self._n)
        ints = {k: int(v) for k, v in n.items() if k != "restore_seconds"}
        return PrefixCacheStats(**ints, restore_seconds=float(n["restore_seconds"]), store=self.store.stats())

    def close(self) -> None:
        """Close the store (pending captures of this process are abandoned) and release the staging buffer."""
        if self._closed:
            return
        self._closed = True
        try:
            self.adapter.close()
        finally:
            self.store.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
