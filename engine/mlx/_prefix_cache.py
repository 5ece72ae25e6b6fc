"""PrefixCache for mlx_lm: a persistent, exact, hybrid-aware prefix cache in one line.

``PrefixCache(model).generate_step(prompt, **kwargs)`` yields what ``mlx_lm.generate_step(prompt,
model, **kwargs)`` yields; ``stream_generate`` and ``generate`` mirror mlx_lm's too (:mod:`._stream`).
Before reading, it restores the deepest stored snapshot of the prompt at one of the call's stops
into a fresh prompt cache and reads only the rest; while reading it captures the state at every
stop as pending snapshots, committed when the call ends and abandoned when it raises. The policy
is the transformers PrefixCache's (docs/engine.md section 9; MLX in section 16).

The stops are the call's cuts (every multiple of ``boundary``, every ``cache_prefix`` position) and
the prompt's last token but one, where mlx_lm's own prefill stops before stepping the last token.
They depend only on the prompt and the call, never on what is stored, so a hit and a miss read the
same pieces and yield the same bytes as mlx_lm called over a cache read with the same split.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import mlx.core as mx

from snapstore import (
    Budget,
    InvalidInputError,
    Match,
    NotFoundError,
    PrefillRate,
    RestoreError,
    StateError,
    Store,
    StoreIOError,
)

from .._prefix_policy import COUNTERS, CachePrefix, PrefixCacheStats, check_boundary, cuts, default_boundary
from ._arrays import dtype_name
from ._cache_state import UnsupportedCacheError, destinations, parts_of, rebuild
from ._captures import Captures
from ._deps import mlx_generate
from ._identify import CacheSettings, Look, draft_key, identity, training_dropout, weights_sha256
from ._reading import bypass_reason, read, settings_of, wrap_processors, wrap_progress
from ._stores import Stores
from ._stream import generate as _generate
from ._stream import stream_generate as _stream_generate

__all__ = ["PrefixCache"]

log = logging.getLogger("snapstore.engine.prefix_cache")


class PrefixCache:
    """A persistent prefix cache for one mlx_lm model.

    path: the store directory (None: ``$SNAPSTORE_DIR``, else the per-user cache dir). boundary:
    tokens between automatic snapshots (None: 8192, halved while a segment's rows exceed 2 GiB; 0:
    none). budget: a :class:`snapstore.Budget`. pack: the checkpoint's hash for the identity
    (default: SHA-256 of the weights, re-hashed when a parameter is replaced). store_options go to
    :meth:`snapstore.Store.open` (drop_stale, chunk_bytes, codec, staging_bytes, check_rows, extra,
    ...). One call at a time per instance.
    """

    def __init__(self, model: Any, path: str | os.PathLike[str] | None = None, *, boundary: int | None = None,
                 budget: Budget | None = None, pack: str | None = None, **store_options: Any):
        check_boundary(boundary)
        self.model = model
        self._path, self._budget = path, budget
        self._extra = dict(store_options.pop("extra", None) or {})
        self._options = store_options
        self._seen = Look(model)
        self._pack = pack or "sha256:" + weights_sha256(model)
        self._stores: dict[tuple[CacheSettings, str | None], Stores] = {}
        self._drafts: dict[int, tuple[Look, str, str]] = {}  # id(draft) -> (look the key was taken at, key, weights)
        self._lock = threading.Lock()
        self._n: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._told: set[str] = set()
        self._closed = False
        # this cache's own prefill rate (tokens/s of the model's computation of prompt pieces, without the
        # caller's progress callback), passed to match() so a restore estimated slower than reading its
        # tokens is not made (docs/api.md "Restore or recompute")
        self.prefill_rate = PrefillRate()
        default = self._stores_for(settings_of(model, {}))
        self.store: Store = default.store("p")
        self._boundary = boundary
        self.boundary = default_boundary(self.store.layout) if boundary is None else boundary

    # -- the split --------------------------------------------------------------------------------
    def split(self, n_tokens: int, cache_prefix: CachePrefix = None) -> list[int]:
        """The cuts a prompt of ``n_tokens`` is read at (every multiple of ``boundary``, every
        ``cache_prefix`` position below the end); the prompt's last token but one is a stop as well."""
        return cuts(n_tokens, self.boundary, cache_prefix)

    # -- mlx_lm's functions -----------------------------------------------------------------------
    def generate_step(self, prompt: mx.array, stream: Any = None, *, cache_prefix: CachePrefix = None,
                      session: str | None = None, namespace: str | None = None,
                      **kwargs: Any) -> Iterator[tuple[Any, mx.array]]:
        """``mlx_lm.generate_step(prompt, model, stream, **kwargs)`` through the cache; yields what it yields.

        cache_prefix: position(s) to snapshot exactly at (the end of the system prompt). session: the
        conversation's key (its prompt-end snapshot supersedes the previous one). namespace: a tenant scope.
        """
        gen: Iterator[tuple[Any, mx.array]] = self._call(prompt, stream, None, cache_prefix, session, namespace, kwargs)
        return gen

    def speculative_generate_step(self, prompt: mx.array, draft_model: Any, stream: Any = None, *,
                                  cache_prefix: CachePrefix = None, session: str | None = None,
                                  namespace: str | None = None, **kwargs: Any) -> Iterator[tuple[Any, mx.array, bool]]:
        """``mlx_lm.speculative_generate_step(prompt, model, draft_model, stream, **kwargs)`` through the
        cache; yields what it yields. The draft's cache is the snapshots' optional draft component."""
        gen: Iterator[tuple[Any, mx.array, bool]] = self._call(prompt, stream, draft_model, cache_prefix, session,
                                                               namespace, kwargs)
        return gen

    def _call(self, prompt: mx.array, stream: Any, draft: Any, cache_prefix: CachePrefix, session: str | None,
              namespace: str | None, kwargs: dict[str, Any]) -> Any:
        """Serve a call through the store, or hand it to mlx_lm unchanged (``bypass_reason``)."""
        if self._closed:
            raise StateError("this PrefixCache is closed")
        stream = mlx_generate.generation_stream if stream is None else stream
        if session is not None and (not isinstance(session, str) or not session):
            raise InvalidInputError(f"session must be None or a non-empty string, got {session!r}")
        why = bypass_reason(kwargs, draft is not None)
        if why is None and any(training_dropout(m) for m in (self.model, draft) if m is not None):
            why = "a model is in training mode with dropout (it draws anew each forward); call model.eval()"
        if why is None and (not isinstance(prompt, mx.array) or prompt.ndim != 1 or prompt.size == 0):
            why = "the prompt is not a non-empty 1-D array of token ids"
        stops: list[int] = []
        if why is None:
            n = prompt.size
            stops = sorted({*self.split(n, cache_prefix), n - 1} - {0})
            try:
                self._follow()
                stores = self._stores_for(settings_of(self.model, kwargs, draft is not None), draft)
            except UnsupportedCacheError as e:
                why = str(e)
        if why is None and draft is not None and not all(n.kind in ("kv", "qkv") for n in stores.schemas["p"][0]):
            why = "speculative decoding needs a trimmable cache (mlx_lm raises)"
        if why is not None:
            return self._bypass(prompt, stream, draft, why, kwargs)
        return self._serve(prompt, stream, stops, stores, session, namespace, kwargs)

    def stream_generate(self, tokenizer: Any, prompt: Any, max_tokens: int = 256, draft_model: Any = None,
                        stream: Any = None, **kwargs: Any) -> Iterator[Any]:
        """``mlx_lm.stream_generate(model, tokenizer, prompt, ...)`` through the cache (same responses)."""
        return _stream_generate(self, tokenizer, prompt, max_tokens, draft_model, stream, **kwargs)

    def generate(self, tokenizer: Any, prompt: Any, verbose: bool = False, **kwargs: Any) -> str:
        """``mlx_lm.generate(model, tokenizer, prompt, ...)`` through the cache (same text)."""
        return _generate(self, tokenizer, prompt, verbose, **kwargs)

    # -- steps ------------------------------------------------------------------------------------
    def _bypass(self, prompt: Any, stream: Any, draft: Any, why: str, kw: dict[str, Any]) -> Any:
        """mlx_lm's function as called: nothing restored or saved (counted; logged once per reason)."""
        self._add(calls=1, bypassed=1)
        if why not in self._told:
            self._told.add(why)
            log.info("prefix cache: %s; calling mlx_lm directly (nothing restored or saved)", why)
        if draft is not None:
            return mlx_generate.speculative_generate_step(prompt, self.model, draft, stream, **kw)
        return mlx_generate.generate_step(prompt, self.model, stream, **kw)

    def _serve(self, prompt: mx.array, stream: Any, stops: list[int], st: Stores, session: str | None,
               namespace: str | None, kw: dict[str, Any]) -> Generator[Any, None, None]:
        tokens: list[int] = list(map(int, prompt.tolist()))  # type: ignore[arg-type]  # a 1-D array: a list
        n = len(tokens)
        found = self._lookup(st, tokens, stops, namespace)
        cache, draft, start = None, None, 0
        parents: dict[int, int | None] = {}
        if found is not None:
            cache, draft, start = self._restore(st, *found, session)
            if cache is not None and (st.draft is None or draft is not None):  # a parent with every part
                parents[id(found[0])] = found[1].snapshot_id
        if cache is None:
            cache = st.fresh()
        caught_up = start
        if st.draft is not None and draft is None:  # no draft state stored: the draft reads from token 0
            draft, caught_up = st.fresh_draft(), 0
        self._add(calls=1, hits=int(start > 0), misses=int(start == 0), prompt_tokens=n, restored_tokens=start,
                  prefilled_tokens=n - start)
        caps = Captures(parents, namespace, self._add)
        cb = kw.get("prompt_progress_callback")
        at = [start]  # tokens read so far, for the progress callback

        def progress(k: int) -> None:
            at[0] += k
            if cb is not None:
                cb(at[0], n)

        try:
            pos = start
            if cb is not None:
                cb(pos, n)
            with mx.stream(stream):
                for c in stops:
                    if draft is not None and caught_up < c <= pos:  # the draft reads the restored pieces
                        read(st.draft, draft, prompt[caught_up:c], st.settings)
                        caught_up = c
                    if c <= pos:
                        continue
                    if draft is not None:
                        read(st.draft, draft, prompt[pos:c], st.settings)
                    spent = read(self.model, cache, prompt[pos:c], st.settings, progress if cb is not None else None)
                    self.prefill_rate.observe(c - pos, spent)  # the chunks' computation, not the callback
                    pos = caught_up = c
                    self._capture(caps, st, cache, draft, tokens[:c], session if c == n - 1 else None)
            if draft is not None:  # mlx_lm's speculative decoding hands its processors only what it read
                yield from mlx_generate.speculative_generate_step(prompt[n - 1:], self.model, st.draft, stream,
                                                                  **{**kw, "prompt_cache": cache + draft})
            else:
                rest = {**kw, "prompt_cache": cache,
                        "logits_processors": wrap_processors(kw.get("logits_processors"), prompt[:n - 1]),
                        "prompt_progress_callback": wrap_progress(cb, n - 1, n)}
                yield from mlx_generate.generate_step(prompt[n - 1:], self.model, stream, **rest)
        except GeneratorExit:  # the consumer stopped (mlx_lm's stream_generate does at EOS): the prompt was read
            caps.drain()
            self._commit(caps)
            raise
        except BaseException:
            caps.drain()
            self._abandon(caps)
            raise
        caps.wait()
        self._commit(caps)

    def _capture(self, caps: Captures, st: Stores, cache: list[Any], draft: list[Any] | None, tokens: list[int],
                 session: str | None) -> None:
        """Capture the cache (and the draft's, as ``d.`` parts) after ``tokens`` into the store of its layout."""
        n = len(tokens)
        store = st.store(st.phase(n))
        if store.read_only:  # a cache baked into a read-only image: it generates, saves nothing (counted)
            self._add(skipped=1)
            return
        parts = parts_of(cache, n)
        if draft is not None:
            parts.update({f"d.{k}": v for k, v in parts_of(draft, n).items()})
        caps.add(store, tokens, parts, session)

    def _lookup(self, st: Stores, tokens: list[int], stops: list[int],
                namespace: str | None) -> tuple[Store, Match] | None:
        """The deepest stored snapshot at one of the stops, over the layouts the stops have."""
        best: tuple[Store, Match] | None = None
        for phase in sorted({st.phase(c) for c in stops}):
            allowed = [c for c in stops if st.phase(c) == phase]
            store = st.store(phase)
            rate = self.prefill_rate.tokens_per_s  # None until measured: the longest prefix, as before
            m = store.match(tokens[:allowed[-1]], namespace=namespace, prefill_tokens_per_s=rate)
            while m is not None and m.n_tokens not in allowed:
                below = max((c for c in allowed if c < m.n_tokens), default=0)
                m = store.match(tokens[:below], namespace=namespace, prefill_tokens_per_s=rate) if below > 0 else None
            if m is not None and (best is None or m.n_tokens > best[1].n_tokens):
                best = (store, m)
        return best

    def _restore(self, st: Stores, store: Store, m: Match,
                 session: str | None) -> tuple[list[Any] | None, list[Any] | None, int]:
        """Restore ``m`` into a fresh prompt cache (and the draft's, when the snapshot has it: else None);
        on failure (damage, eviction race) read from token 0."""
        t0 = time.perf_counter()
        phase = st.phase(m.n_tokens)
        schema, layout = st.schemas[phase]
        try:
            dest = destinations(layout, m.n_tokens)
            res = store.restore(m, into=dest, session=session)
        except (RestoreError, NotFoundError) as e:
            log.warning("prefix cache: restoring snapshot %s failed (%s); reading the prompt from token 0",
                        m.snapshot_id, e)
            self._add(restore_fallbacks=1)
            return None, None, 0
        cache = rebuild(schema, layout, dest, res.n_tokens)
        draft = None
        if st.draft is not None and st.component not in res.missing_components:
            dschema, dlayout = st.draft_schemas[phase]
            draft = rebuild(dschema, dlayout, {k[2:]: v for k, v in dest.items() if k.startswith("d.")}, res.n_tokens)
        mx.eval([c.state for c in cache + (draft or [])])
        self._add(restore_seconds=time.perf_counter() - t0)
        return cache, draft, res.n_tokens

    def _commit(self, caps: Captures) -> None:
        """Commit each chain of captures (committing the deepest commits its pending ancestors, root first)."""
        for store, chain in caps.chains():
            try:
                res = store.commit(chain[-1])
            except StoreIOError as e:
                log.warning("prefix cache: commit failed (%s); the captures are dropped", e)
                self._abandon_chain(store, chain)
                continue
            self._add(**({"committed": len(chain)} if res.ok else {"skipped": len(chain)}))

    def _abandon(self, caps: Captures) -> None:
        for store, chain in caps.chains():
            self._abandon_chain(store, chain)

    def _abandon_chain(self, store: Store, chain: list[Any]) -> None:
        try:
            store.abandon(chain[0])
        except StoreIOError as e:  # the next open (or gc) drops them: their owner is gone by then
            log.warning("prefix cache: abandon failed (%s)", e)
        self._add(abandoned=len(chain))

    # -- identity ---------------------------------------------------------------------------------
    def _stores_for(self, s: CacheSettings, draft: Any = None) -> Stores:
        """The stores of cache settings ``s`` and draft model (probed and opened on first use)."""
        dkey = self._draft_key(draft) if draft is not None else None
        st = self._stores.get((s, dkey))
        if st is None:
            ident = identity(self.model, self._pack, self._kv(s), s, self._extra)
            st = Stores(self.model, s, ident, self._path, self._budget, self._options, draft, dkey)
            self._stores[(s, dkey)] = st
        return st

    def _draft_key(self, draft: Any) -> str:
        """The draft model's key (``draft_key``: its weights and its modules' attributes), hashed once
        per draft and again when its look changed (the weights only when a parameter was replaced)."""
        seen = self._drafts.get(id(draft))
        now = Look(draft)
        if seen is None or not now.same(seen[0]):
            weights = weights_sha256(draft) if seen is None or not now.same_params(seen[0]) else seen[2]
            seen = (now, draft_key(draft, weights, now.modules), weights)
            self._drafts[id(draft)] = seen
        return seen[1]

    def _kv(self, s: CacheSettings) -> str:
        """The identity's kv field: the activations' dtype, or the KV quantization."""
        if s.kv_bits is not None:
            return f"q{s.kv_bits}g{s.kv_group_size}"
        leaves = _leaves(self.model)
        return dtype_name(leaves[0][1].dtype) if leaves else "none"

    def refresh(self) -> None:
        """Re-hash the weights now and switch the identity if they changed: for an in-place write
        (``w[...] = x``), which keeps the array object and is not seen per call."""
        if self._closed:
            raise StateError("this PrefixCache is closed")
        self._follow(rehash=True)

    def _follow(self, rehash: bool = False) -> None:
        """Before a call: if a parameter was replaced (re-hashed), the config or a module's attribute
        changed (an adapter's scale, a dropout, the training flag), reopen under the new identity."""
        now = Look(self.model)
        if not rehash and now.same(self._seen):
            return
        pack = "sha256:" + weights_sha256(self.model) if rehash or not now.same_params(self._seen) else self._pack
        if pack != self._pack or now.config != self._seen.config or now.modules != self._seen.modules:
            self._pack = pack
            stores, self._stores = list(self._stores.values()), {}
            default = self._stores_for(settings_of(self.model, {}))
            self.store = default.store("p")
            for s in stores:
                s.close()
            if self._boundary is None:
                self.boundary = default_boundary(self.store.layout)
            self._add(identity_changes=1)
            log.info("prefix cache: the model changed since the last call (weights, config or a module's settings); "
                     "its identity is now %s", self.store.identity.key)
        self._seen = now

    # -- the rest ---------------------------------------------------------------------------------
    def _add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self._n[k] += v

    def stats(self) -> PrefixCacheStats:
        """Per-call counters since open (hits, tokens restored vs read, captures) and the store's Stats."""
        with self._lock:
            n = dict(self._n)
        ints = {k: int(v) for k, v in n.items() if k != "restore_seconds"}
        return PrefixCacheStats(**ints, restore_seconds=float(n["restore_seconds"]), store=self.store.stats())

    def close(self) -> None:
        """Close the stores (pending captures of this process are abandoned)."""
        if self._closed:
            return
        self._closed = True
        for st in self._stores.values():
            st.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leaves(model: Any) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]  # a list here
    return [(k, v) for k, v in leaves if mx.issubdtype(v.dtype, mx.floating)]
