"""snapstore for mlx_lm: a persistent, exact prefix cache for MLX models (no torch).

``PrefixCache(model).generate_step / stream_generate / generate`` mirror mlx_lm's functions of the
same names and keep every prompt's state in a snapstore store: KVCache, RotatingKVCache (sliding
windows), QuantizedKVCache (``kv_bits``), ArraysCache (SSM and linear-attention state) and
CacheList, bfloat16 included. ``StorePromptCache`` is mlx_lm.server's LRUPromptCache backed by the
store (``snapstore mlx-server``); ``import_prompt_cache`` / ``export_prompt_cache`` turn the files
``mlx_lm.cache_prompt`` writes into snapshots and back.
Installed with the ``mlx`` extra: ``pip install 'snapstore[mlx]'``.
See docs/engine.md, section 16. The names load on first use (PEP 562), so the ``snapstore`` CLI can
register its MLX commands (:mod:`snapstore.engine.mlx.cli`) without mlx; where mlx or mlx_lm is
missing, using a name (``from snapstore.engine.mlx import PrefixCache``) raises :class:`MlxMissingError`,
an ImportError that says what to install (``MlxMissingError`` itself imports without mlx, to catch it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from snapstore.engine._lazy import lazy_names

if TYPE_CHECKING:
    from .._prefix_policy import PrefixCacheStats
    from ._cache_state import UnsupportedCacheError, describe, parts_of, rebuild
    from ._deps import MlxMissingError
    from ._files import ExportResult, ImportResult, PromptCacheMismatchError, export_prompt_cache, import_prompt_cache
    from ._identify import weights_sha256
    from ._prefix_cache import PrefixCache
    from ._server_cache import StorePromptCache

__all__ = ["ExportResult", "ImportResult", "MlxMissingError", "PrefixCache", "PrefixCacheStats",
           "PromptCacheMismatchError", "StorePromptCache", "UnsupportedCacheError", "describe", "export_prompt_cache",
           "import_prompt_cache", "parts_of", "rebuild", "weights_sha256"]

_WHERE = {
    "PrefixCacheStats": "snapstore.engine._prefix_policy", "UnsupportedCacheError": "._cache_state",
    "describe": "._cache_state", "parts_of": "._cache_state", "rebuild": "._cache_state",
    "MlxMissingError": "._deps", "ExportResult": "._files", "ImportResult": "._files",
    "PromptCacheMismatchError": "._files", "export_prompt_cache": "._files", "import_prompt_cache": "._files",
    "weights_sha256": "._identify", "PrefixCache": "._prefix_cache", "StorePromptCache": "._server_cache",
}

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__, check="._deps")
