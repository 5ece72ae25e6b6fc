"""The stores one MLX PrefixCache keeps open: one per cache setting a call used, one per layout.

The layout of a prompt cache is probed once per setting (one forward of one token into a fresh
``make_prompt_cache``). With ``kv_bits``, mlx_lm quantizes the KV cache once it holds
``quantized_kv_start`` tokens, so a snapshot at position c has the quantized layout exactly when
c >= quantized_kv_start: the "q" phase, a second layout (and store) of the same identity.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from snapstore import Budget, Identity, Layout, Store

from ._cache_state import Node, describe
from ._identity import CacheSettings
from ._reading import quantizer

__all__ = ["Stores"]


class Stores:
    """The stores (and probed schemas) of one cache setting under one identity."""

    def __init__(self, model: Any, settings: CacheSettings, identity: Identity, path: str | os.PathLike[str] | None,
                 budget: Budget | None, options: dict[str, Any]):
        self.model, self.settings, self.identity = model, settings, identity
        self._path, self._budget, self._options = path, budget, options
        cache = self.fresh()
        model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        self.schemas: dict[str, tuple[tuple[Node, ...], Layout]] = {"p": describe(cache)}
        if settings.kv_bits is not None:
            quantizer(CacheSettings(settings.prefill_step_size, settings.kv_bits, settings.kv_group_size, 0,
                                    settings.max_kv_size))(cache)
            self.schemas["q"] = describe(cache)
        self._open: dict[str, Store] = {}
        self.path = path

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
