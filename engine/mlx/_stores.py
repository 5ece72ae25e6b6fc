"""The stores one MLX PrefixCache keeps open: one per cache setting a call used, one per layout.

The layout of a prompt cache is probed once per setting (one forward of one token into a fresh
``make_prompt_cache``). With ``kv_bits``, mlx_lm quantizes the KV cache once it holds
``quantized_kv_start`` tokens, so a snapshot at position c has the quantized layout exactly when
c >= quantized_kv_start: the "q" phase, a second layout (and store) of the same identity.

With a draft model (speculative decoding), each layout also names the draft's cache, as parts
``d.<layer>...`` of the optional component ``draft-<16 hex digits of the draft's key>`` (its weights
and its modules' attributes, ``_identify.draft_key``):
a snapshot saved without it (by a call without the draft, or with another draft) still matches
and restores with the draft cache empty; the draft's own snapshots are never served to another
draft (its component is another one), and calls without a draft do not read them.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from snapstore import Budget, Fixed, Identity, Layout, Rows, Store

from ._cache_state import Node, describe
from ._identify import CacheSettings
from ._reading import quantizer

__all__ = ["Stores"]


class Stores:
    """The stores (and probed schemas) of one cache setting under one identity."""

    def __init__(self, model: Any, settings: CacheSettings, identity: Identity, path: str | os.PathLike[str] | None,
                 budget: Budget | None, options: dict[str, Any], draft: Any = None, draft_key: str | None = None):
        self.model, self.settings, self.identity = model, settings, identity
        self._path, self._budget, self._options = path, budget, options
        self.draft = draft
        self.schemas = self._probe(model, self.fresh())
        self.draft_schemas: dict[str, tuple[tuple[Node, ...], Layout]] = {}
        if draft is not None:
            self.component = f"draft-{(draft_key or '')[:16]}"
            self.draft_schemas = self._probe(draft, self.fresh_draft())
            for phase, (schema, layout) in self.schemas.items():
                self.schemas[phase] = (schema, _with_draft(layout, self.draft_schemas[phase][1], self.component))
        self._open: dict[str, Store] = {}
        self.path = path

    def _probe(self, model: Any, cache: list[Any]) -> dict[str, tuple[tuple[Node, ...], Layout]]:
        """The schema and layout of ``model``'s prompt cache, read (one token) and, with kv_bits, quantized."""
        s = self.settings
        model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        out = {"p": describe(cache)}
        if s.kv_bits is not None:
            quantizer(CacheSettings(s.prefill_step_size, s.kv_bits, s.kv_group_size, 0, s.max_kv_size))(cache)
            out["q"] = describe(cache)
        return out

    def fresh_draft(self) -> list[Any]:
        """A fresh prompt cache for the draft model (mlx_lm's speculative decoding makes it so)."""
        cache: list[Any] = make_prompt_cache(self.draft)
        return cache

    def fresh(self) -> list[Any]:
        """A fresh prompt cache for these settings (mlx_lm's ``make_prompt_cache``)."""
        cache: list[Any] = make_prompt_cache(self.model, max_kv_size=self.settings.max_kv_size)
        return cache

    def phase(self, n_tokens: int) -> str:
        """The layout a snapshot after ``n_tokens`` has: "q" once the KV cache is quantized, else "p"."""
        s = self.settings
        return "q" if s.kv_bits is not None and s.quantized_kv_start is not None \
            and n_tokens >= s.quantized_kv_start else "p"

    def store(self, phase: str) -> Store:
        """The store of ``phase``'s layout (opened on first use)."""
        st = self._open.get(phase)
        if st is None:
            st = Store.open(self._path, identity=self.identity, layout=self.schemas[phase][1], budget=self._budget,
                            **self._options)
            self._open[phase] = st
            self.path = st.path
        return st

    def close(self) -> None:
        stores, self._open = list(self._open.values()), {}
        for st in stores:
            st.close()


def _with_draft(layout: Layout, draft: Layout, component: str) -> Layout:
    """``layout`` plus the draft's parts (``d.``-prefixed) in the optional ``component``."""
    fixed = {**layout.fixed, **{f"d.{k}": Fixed(f.dtype, f.shape, component=component) for k, f in draft.fixed.items()}}
    rows = {**layout.rows, **{f"d.{k}": Rows(r.dtype, r.row_shape, component=component) for k, r in draft.rows.items()}}
    return Layout(fixed=fixed, rows=rows)
