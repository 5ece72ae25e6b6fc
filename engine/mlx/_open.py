"""The stores of one mlx_lm model under the identity the MLX PrefixCache uses, for the integrations
that are not a PrefixCache (the server's prompt cache, prompt-cache files): a snapshot any of them
saves is one the others restore, when the model and the cache settings are the same."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from snapstore import Budget

from ._arrays import dtype_name
from ._identify import CacheSettings, draft_key, identity, weights_sha256
from ._stores import Stores

__all__ = ["kv_field", "open_stores"]


def kv_field(model: Any, s: CacheSettings) -> str:
    """The identity's kv field: the KV quantization, else the dtype of the model's first floating parameter
    (as :class:`PrefixCache` computes it)."""
    if s.kv_bits is not None:
        return f"q{s.kv_bits}g{s.kv_group_size}"
    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]  # a list here
    floats = [v for _, v in leaves if mx.issubdtype(v.dtype, mx.floating)]
    return dtype_name(floats[0].dtype) if floats else "none"


def open_stores(model: Any, settings: CacheSettings, path: str | os.PathLike[str] | None, *,
                budget: Budget | None = None, options: dict[str, Any] | None = None, draft: Any = None,
                pack: str | None = None, extra: dict[str, Any] | None = None) -> Stores:
    """The :class:`Stores` of ``model`` (and ``draft``) under ``settings``: the weights hashed now
    (``pack`` skips that), the layout probed with one token, each phase's store opened on first use."""
    pack = pack or "sha256:" + weights_sha256(model)
    ident = identity(model, pack, kv_field(model, settings), settings, dict(extra or {}))
    dkey = draft_key(draft) if draft is not None else None
    return Stores(model, settings, ident, path, budget, dict(options or {}), draft, dkey)
