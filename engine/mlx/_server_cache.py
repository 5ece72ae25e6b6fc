"""``StorePromptCache``: mlx_lm.server's ``LRUPromptCache`` with a store behind it, so prompts outlive the process.

It is mlx_lm's class (a subclass: the same constructor arguments first, the same methods —
``fetch_nearest_cache``, ``insert_cache``, ``trim_to``, ``stats_by_type``, ``len()``, ``nbytes`` —
and the same in-memory LRU behaviour), with two additions:

- ``insert_cache`` also saves the entry to the store (a delta over the deepest stored prefix of the
  same identity, so a conversation's turns and the chats sharing a system prompt store each row
  once). A speculative server's entry (the target's cache, then the draft's) after a reply holds
  one token fewer in one of the two caches than its key: the prefix both hold is stored.
  mlx_lm.server inserts at the end of the system prompt and of the user's message while
  reading (``cache_type`` "system" / "user") and after each response ("assistant").
- ``fetch_nearest_cache`` also asks the store: when a stored prefix of the prompt is longer than
  what memory holds, it is restored into a fresh prompt cache and returned with the rest of the
  prompt, as mlx_lm returns its own entries. So after a restart a new chat with a known system
  prompt restores it instead of reading it.

The store is keyed like the MLX PrefixCache (the weights' SHA-256, the config, the cache settings:
docs/engine.md section 16), so the two share snapshots of the same model. A stored prefix is at
most the prompt's length minus one: the server always has at least one token to read. Entries
keyed by something other than token ids (image prompts) and cache kinds the integration does not
store are kept in memory only (counted). The model behind a server's model key is asked of
``models`` at each call; a reloaded model (a new object) is hashed again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from snapstore import Budget, LayoutError, NotFoundError, RestoreError, StoreIOError

from ._cache_state import UnsupportedCacheError, describe, destinations, held_tokens, parts_of, rebuild
from ._identify import CacheSettings
from ._open import open_stores
from ._reading import settings_of
from ._stores import Stores

__all__ = ["ServedModels", "StorePromptCache"]

log = logging.getLogger("snapstore.engine.mlx.server")

ServedModels = Callable[[Any], "tuple[Any, Any] | None"]
"""A server's model key -> (model, draft model or None) when that key is the model loaded now, else None."""

_COUNTERS = ("fetches", "store_hits", "restored_tokens", "restore_failures", "saved", "save_skipped",
             "not_persisted")


@dataclass
class _Served:
    model: Any
    draft: Any
    stores: Stores
    n_model: int  # entries of the model's own cache (a speculative server appends the draft's)


class StorePromptCache(LRUPromptCache):  # type: ignore[misc]  # mlx_lm is untyped
    """mlx_lm's LRUPromptCache backed by a snapstore store (see the module docstring).

    max_size, max_bytes: mlx_lm's (the in-memory tier). path: the store directory (None:
    ``$SNAPSTORE_DIR``, else the per-user cache dir). models: resolves a model key (see
    :data:`ServedModels`); without it nothing is stored or restored. settings: the cache settings
    the server reads with (None: mlx_lm's defaults). persist: the ``cache_type`` values saved to
    the store. budget and store_options go to :meth:`snapstore.Store.open`.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, path: str | os.PathLike[str] | None = None,
                 models: ServedModels | None = None, settings: CacheSettings | None = None,
                 budget: Budget | None = None, persist: Iterable[str] = ("system", "user", "assistant"),
                 **store_options: Any):
        super().__init__(max_size, max_bytes)
        self._path, self._models, self._settings, self._budget = path, models, settings, budget
        self._persist = frozenset(persist)
        self._options = store_options
        self._served: dict[Any, _Served] = {}
        self._lock = threading.Lock()
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._told: set[str] = set()

    # -- mlx_lm's methods -------------------------------------------------------------------------
    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """mlx_lm's lookup; a longer stored prefix (restored into a fresh prompt cache) when the store has one."""
        cache, rest = super().fetch_nearest_cache(model, tokens)
        self._add(fetches=1)
        got = self._restore(model, tokens, len(tokens) - len(rest))
        return (cache, rest) if got is None else got

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        """mlx_lm's insert; also saved to the store when ``cache_type`` is one of ``persist``."""
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        if cache_type in self._persist:
            self._save(model, tokens, prompt_cache)

    # -- the store --------------------------------------------------------------------------------
    def _entry(self, key: Any) -> _Served | None:
        got = self._models(key) if self._models is not None else None
        if got is None:
            return None
        model, draft = got
        e = self._served.get(key)
        if e is None or e.model is not model or e.draft is not draft:
            if e is not None:
                e.stores.close()
            s = self._settings or settings_of(model, {}, draft is not None)
            stores = open_stores(model, s, self._path, budget=self._budget, options=self._options, draft=draft)
            e = _Served(model, draft, stores, len(stores.schemas["p"][0]))
            self._served[key] = e
            log.info("snapstore: prompt caches of %s persist in %s (identity %s)", key, stores.store("p").path,
                     stores.identity.key[:16])
        return e

    def _save(self, key: Any, tokens: Sequence[Any], cache: list[Any]) -> None:
        ids = _token_ids(tokens)
        e = self._entry(key) if ids else None
        if e is None or ids is None:
            self._not_persisted("a prompt keyed by more than token ids (images), or no model resolved for its key")
            return
        mine, theirs = cache[:e.n_model], cache[e.n_model:]
        try:
            schema, _ = describe(mine)
            phase = next((p for p, (sch, _) in e.stores.schemas.items() if sch == schema), None)
            if phase is None or (e.stores.draft is None) != (not theirs):
                self._not_persisted("a prompt cache unlike the one probed for these settings")
                return
            # after speculative decoding the target's or the draft's cache lags the key by a token: store
            # the prefix both hold (KV rows: the first n are the state after n tokens)
            n = min(len(ids), held_tokens(mine + theirs) or len(ids)) if theirs else len(ids)
            parts = parts_of(mine, n, prefix=bool(theirs))
            if theirs:
                parts.update({f"d.{k}": v for k, v in parts_of(theirs, n, prefix=True).items()})
            res = e.stores.store(phase).save(ids[:n], parts, parent="auto")
        except (LayoutError, UnsupportedCacheError) as ex:  # a kind we do not store, or state not at len(ids)
            self._not_persisted(str(ex))
            return
        except StoreIOError as ex:
            log.warning("snapstore: saving a prompt cache failed (%s); it stays in memory only", ex)
            self._add(save_skipped=1)
            return
        self._add(**({"saved": 1} if res.snapshot_id is not None else {"save_skipped": 1}))

    def _restore(self, key: Any, tokens: Sequence[Any], have: int) -> tuple[list[Any], list[int]] | None:
        """The deepest stored prefix of ``tokens`` (at most all but the last) longer than ``have``, restored."""
        ids = _token_ids(tokens)
        if ids is None or len(ids) < 2 or have >= len(ids) - 1:
            return None
        e = self._entry(key)
        if e is None:
            return None
        best = None
        for phase in e.stores.schemas:
            m = e.stores.store(phase).match(ids[:-1])
            if m is not None and m.n_tokens > have and (best is None or m.n_tokens > best[1].n_tokens):
                best = (phase, m)
        if best is None:
            return None
        phase, m = best
        schema, layout = e.stores.schemas[phase]
        try:
            dest = destinations(layout, m.n_tokens)
            res = e.stores.store(phase).restore(m, into=dest)
        except (RestoreError, NotFoundError) as ex:
            log.warning("snapstore: restoring snapshot %s failed (%s); the server reads the prompt", m.snapshot_id, ex)
            self._add(restore_failures=1)
            return None
        if e.stores.draft is not None and e.stores.component in res.missing_components:
            return None  # stored without the draft's state: the server would draft from an empty cache
        cache = rebuild(schema, layout, dest, res.n_tokens)
        if e.stores.draft is not None:
            dschema, dlayout = e.stores.draft_schemas[phase]
            cache += rebuild(dschema, dlayout, {k[2:]: v for k, v in dest.items() if k.startswith("d.")},
                             res.n_tokens)
        mx.eval([c.state for c in cache])
        self._add(store_hits=1, restored_tokens=res.n_tokens)
        log.info("snapstore: restored %d of %d prompt tokens from snapshot %d", res.n_tokens, len(ids), m.snapshot_id)
        return cache, list(tokens[res.n_tokens:])

    def _not_persisted(self, why: str) -> None:
        self._add(not_persisted=1)
        if why not in self._told:
            self._told.add(why)
            log.info("snapstore: a prompt cache kept in memory only: %s", why)

    def _add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._n[k] += v

    def stats(self) -> dict[str, int]:
        """Counters since start: fetches, store_hits, restored_tokens, restore_failures, saved,
        save_skipped (budget or I/O), not_persisted (kept in memory only)."""
        with self._lock:
            return dict(self._n)

    def close(self) -> None:
        """Close the stores (the in-memory tier stays usable, without persistence)."""
        served, self._served, self._models = list(self._served.values()), {}, None
        for e in served:
            e.stores.close()


def _token_ids(tokens: Sequence[Any]) -> list[int] | None:
    """``tokens`` as a list of ints, or None when an entry is not a token id (an image's key)."""
    out: list[int] = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return None
        out.append(t)
    return out
