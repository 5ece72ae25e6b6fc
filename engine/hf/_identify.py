"""What identifies a transformers model's cache state: hashes of its config and weights, and its Identity.

A snapshot is only served to the identity that saved it, so everything that changes the numbers
or the state dtypes goes into it: versions, model type, config, dtype, device type, attention
implementation and the optional kernel packages that were importable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from snapstore import Identity

from ..torch import dtype_name, tensors_sha256

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["config_sha256", "identity", "tensors_sha256", "weights_sha256"]

_KERNELS = ("fla", "mamba_ssm", "causal_conv1d")


def config_sha256(config: PretrainedConfig) -> str:
    """SHA-256 of the model config's canonical JSON (every field, sorted keys)."""
    d = config.to_dict()
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def weights_sha256(model: PreTrainedModel, chunk: int = 64 << 20) -> str:
    """SHA-256 over every parameter and buffer of the state dict (name, dtype, shape, C-order bytes)."""
    return tensors_sha256(sorted(model.state_dict().items()), chunk)


def identity(model: PreTrainedModel, *, build: str | None = None, pack: str | None = None, kv: str | None = None,
             extra: Mapping[str, Any] | None = None) -> Identity:
    """An Identity for a transformers model's cache state.

    build: default ``transformers-<v>+torch-<v>``. pack: the checkpoint's hash (pass it; e.g.
    ``"sha256:" + weights_sha256(model)``); default the config hash, which does NOT tell two
    checkpoints of one architecture apart. extra always records transformers/torch versions, model
    type, config hash, dtype, device type, attention implementation and which optional kernel
    packages were importable (they change the numbers and the state dtypes).
    """
    import transformers

    cfg = model.config
    csha = config_sha256(cfg)
    dt = dtype_name(model.dtype)
    dev = next(model.parameters()).device.type
    kernels = ",".join(k for k in _KERNELS if importlib.util.find_spec(k) is not None) or "none"
    ex: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_type": str(getattr(cfg, "model_type", "")),
        "config_sha256": csha,
        "dtype": dt,
        "device": dev,
        "attn_implementation": str(getattr(cfg, "_attn_implementation", None)),
        "kernels": kernels,
    }
    ex.update(extra or {})
    return Identity(build=build or f"transformers-{transformers.__version__}+torch-{torch.__version__}",
                    pack=pack or f"config-sha256:{csha}", kv=kv or dt, mtp=False, extra=ex)
