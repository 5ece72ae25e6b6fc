"""snapstore's integrations, one folder each: the torch adapter (``torch``), transformers (``hf``),
mlx_lm (``mlx``), vLLM (``vllm``), SGLang (``sglang``) and llama-server (``llamacpp``).

Each uses only the core's public names (``import snapstore``). The torch adapter's names are also
reachable here, as ``snapstore.engine.TorchAdapter`` and so on (their home before the integrations
had folders), loaded on first use: importing this package imports no torch and no runtime.
"""

from __future__ import annotations

from . import torch as _torch  # the adapter's package: no torch until one of its names is used
from ._lazy import lazy_names

# the adapter's names as public here before the integrations had folders; the ones it gained for the
# other integrations (the shared staging buffer, TokenIds, tensors_sha256) only from snapstore.engine.torch
__all__ = sorted(set(_torch.__all__) - {"TokenIds", "shared_staging", "tensors_sha256"})

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, ".torch"), __all__)
