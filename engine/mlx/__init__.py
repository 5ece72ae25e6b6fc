"""snapstore for mlx_lm: a persistent, exact prefix cache for MLX models (no torch).

``PrefixCache(model).generate_step / stream_generate / generate`` mirror mlx_lm's functions of the
same names and keep every prompt's state in a snapstore store: KVCache, RotatingKVCache (sliding
windows), QuantizedKVCache (``kv_bits``), ArraysCache (SSM and linear-attention state) and
CacheList, bfloat16 included. ``StorePromptCache`` is mlx_lm.server's LRUPromptCache backed by the
store (``snapstore mlx-server``); ``import_prompt_cache`` / ``export_prompt_cache`` turn the files
``mlx_lm.cache_prompt`` writes into snapshots and back.
Installed with the ``mlx`` extra: ``pip install 'snapstore[mlx]'``.
See docs/engine.md, section 16.
"""

from __future__ import annotations

from . import _deps  # noqa: F401  (first: without mlx or mlx_lm, an error that says what to install)

# isort: split
from .._prefix_policy import PrefixCacheStats
from ._cache_state import UnsupportedCacheError, describe, parts_of, rebuild
from ._deps import MlxMissingError
from ._files import ExportResult, ImportResult, PromptCacheMismatchError, export_prompt_cache, import_prompt_cache
from ._identity import weights_sha256
from ._prefix_cache import PrefixCache
from ._server_cache import StorePromptCache

__all__ = ["ExportResult", "ImportResult", "MlxMissingError", "PrefixCache", "PrefixCacheStats",
           "PromptCacheMismatchError", "StorePromptCache", "UnsupportedCacheError", "describe", "export_prompt_cache",
           "import_prompt_cache", "parts_of", "rebuild", "weights_sha256"]
