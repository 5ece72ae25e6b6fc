"""Hugging Face transformers integration: snapshot and restore a ``DynamicCache`` (transformers 5.23),
and ``PrefixCache``, the one-line prefix cache for ``model.generate`` (docs/engine.md §9).

The parts a cache is stored as are listed in :mod:`snapstore.engine.hf._cache`; the prefix cache's
modules are ``_prefix_cache`` (the calls), ``_capture`` (pending captures on a worker thread),
``_generate`` (what generate arguments it serves), ``_watch`` (the model's identity, looked at per
call) and ``_identify`` (weights and config digests).
"""

from __future__ import annotations

from ._cache import (
    META,
    CachePart,
    CacheSnapshot,
    config_sha256,
    identity,
    layout_for,
    open_store,
    restore,
    save,
    snapshot,
    weights_sha256,
)
from ._prefix_cache import PrefixCache

__all__ = [
    "META",
    "CachePart",
    "CacheSnapshot",
    "PrefixCache",
    "config_sha256",
    "identity",
    "layout_for",
    "open_store",
    "restore",
    "save",
    "snapshot",
    "weights_sha256",
]
