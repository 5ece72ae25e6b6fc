"""vLLM v1 KV connector: persistent prefixes for vLLM through snapstore (docs/engine.md §11).

Configure vLLM with ``kv_connector="SnapstoreConnector"`` and ``kv_connector_module_path=
"snapstore.engine.vllm"``. The connector is :mod:`snapstore.engine.vllm._connector` (it needs vLLM);
the block copies and the weights digest are in ``_blocks``, the per-request key in ``_key``, a
hybrid model's groups and pages in ``_groups`` and ``_hybrid`` (all work without vLLM, so the
connector is imported when one of its names is first asked for).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LAST_STATS", "SnapstoreConnector", "SnapstoreConnectorMetadata", "exact_layout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _connector  # imports vLLM: only when the connector itself is wanted

        return getattr(_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
