"""What identifies a transformers model's cache state: hashes of its config and weights, and its Identity.

A snapshot is only served to the identity that saved it, so everything that changes the numbers
or the state dtypes goes into it: versions, model type, config, dtype, device type, attention
implementation and the optional kernel packages that were importable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from snapstore import Identity

from ..torch._copy import copy_range, flat_bytes, same_width, sync_copy
from ..torch._device import CUDA
from ..torch._dtypes import dtype_name

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


@torch.no_grad()
def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]], chunk: int = 64 << 20) -> str:
    """SHA-256 over named tensors, in the order given (name, dtype, shape, C-order bytes).

    Contiguous CPU tensors are hashed in place; anything else (device, strided) is copied through
    one reused host buffer of ``chunk`` bytes (page-locked for CUDA), so memory stays bounded.
    """
    h = hashlib.sha256()
    buf: torch.Tensor | None = None
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        c = same_width(t.detach().resolve_conj().resolve_neg())
        if c.device.type == "cpu" and (c.dim() == 0 or c.is_contiguous()):
            h.update(flat_bytes(c).numpy().data)
            continue
        n = c.numel() * c.element_size()
        if buf is None or (c.device.type == "cuda" and not buf.is_pinned()):
            buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=c.device.type == "cuda" and CUDA.available())
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            copy_range(c, a, b, buf[:b - a], False, sync_copy)
            h.update(buf[:b - a].numpy().data)
    return h.hexdigest()


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
