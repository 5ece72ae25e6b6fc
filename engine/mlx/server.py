"""``python -m snapstore.engine.mlx.server [--store-dir DIR] [--store-disk-mib N] [--store-persist TYPES] ARGS...``:
mlx_lm.server with a persistent prompt cache (what ``snapstore mlx-server`` runs).

ARGS are mlx_lm.server's own (``--model``, ``--port``, ``--prompt-cache-size``, ...), passed through
unchanged. The only change to the server is its prompt cache: a :class:`StorePromptCache` (mlx_lm's
LRUPromptCache with a store behind it) instead of the in-memory one, made with the server's own
``--prompt-cache-size`` / ``--prompt-cache-bytes`` and cache settings (``--prefill-step-size``,
``--kv-bits``, ...). It is swapped in where mlx_lm.server builds its response generator, so the
server's handling of requests is mlx_lm's own.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import mlx_lm.server as mlx_server

from snapstore import Budget

from ._identify import CacheSettings
from ._server_cache import ServedModels, StorePromptCache

__all__ = ["install", "main", "server_settings"]

log = logging.getLogger("snapstore.engine.mlx.server")


def server_settings(cli: argparse.Namespace) -> CacheSettings:
    """The cache settings mlx_lm.server reads prompts with (its ``--prefill-step-size``, ``--kv-bits``, ...)."""
    bits = getattr(cli, "kv_bits", None)
    return CacheSettings(prefill_step_size=int(cli.prefill_step_size), kv_bits=bits,
                         kv_group_size=cli.kv_group_size if bits is not None else None,
                         quantized_kv_start=cli.quantized_kv_start if bits is not None else None, max_kv_size=None)


def served_models(provider: Any) -> ServedModels:
    """The models behind a model key: the provider's loaded model when the key is the one loaded now."""
    def lookup(key: Any) -> tuple[Any, Any] | None:
        if provider.model is None or provider.model_key != key:
            return None
        return provider.model, provider.draft_model
    return lookup


def install(path: str | None = None, budget: Budget | None = None,
            persist: Sequence[str] = ("system", "user", "assistant")) -> None:
    """Make mlx_lm.server (this process's) build its response generator over a StorePromptCache."""
    base = mlx_server.ResponseGenerator
    if getattr(base, "_snapstore", False):
        return

    class StoreResponseGenerator(base):  # type: ignore[misc,valid-type]  # mlx_lm's class, untyped
        """mlx_lm's ResponseGenerator over a StorePromptCache with the server's own limits."""

        _snapstore = True

        def __init__(self, model_provider: Any, prompt_cache: Any):
            cache = StorePromptCache(prompt_cache.max_size, prompt_cache.max_bytes, path=path,
                                     models=served_models(model_provider),
                                     settings=server_settings(model_provider.cli_args), budget=budget,
                                     persist=persist)
            super().__init__(model_provider, cache)

    mlx_server.ResponseGenerator = StoreResponseGenerator


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the store's options, leave the rest to mlx_lm.server's own parser, and serve."""
    p = argparse.ArgumentParser(prog="snapstore mlx-server", add_help=False)
    p.add_argument("--store-dir", metavar="DIR")
    p.add_argument("--store-disk-mib", type=int, metavar="N")
    p.add_argument("--store-persist", default="system,user,assistant", metavar="TYPES")
    ours, rest = p.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    budget = Budget(disk_bytes=ours.store_disk_mib << 20) if ours.store_disk_mib is not None else None
    persist = tuple(t for t in ours.store_persist.split(",") if t)
    install(ours.store_dir, budget, persist)
    logging.getLogger("snapstore").setLevel(logging.INFO)
    sys.argv = ["snapstore mlx-server", *rest]
    mlx_server.main()


if __name__ == "__main__":
    main()
