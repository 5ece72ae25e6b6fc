"""snapstore's integrations, one folder each: the torch adapter (``torch``), transformers (``hf``),
mlx_lm (``mlx``), vLLM (``vllm``), SGLang (``sglang``) and llama-server (``llamacpp``).

Each uses only the core's public names (``import snapstore``). The torch adapter's names are also
reachable here, as ``snapstore.engine.TorchAdapter`` and so on (their home before the integrations
had folders), loaded on first use: importing this package imports no torch and no runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .torch import (
        DEFAULT_STAGING_BYTES,
        Staging,
        TensorSink,
        TensorSource,
        TorchAdapter,
        TorchPagedRows,
        canonical,
        dtype_name,
        fixed_spec,
        layout_of,
        part_sink,
        part_source,
        rows_spec,
        torch_dtype,
    )

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Staging",
    "TensorSink",
    "TensorSource",
    "TorchAdapter",
    "TorchPagedRows",
    "canonical",
    "dtype_name",
    "fixed_spec",
    "layout_of",
    "part_sink",
    "part_source",
    "rows_spec",
    "torch_dtype",
]


def __getattr__(name: str) -> Any:
    """The torch adapter's names, from :mod:`snapstore.engine.torch` on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.torch"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
