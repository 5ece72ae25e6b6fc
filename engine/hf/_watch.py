"""What a PrefixCache's identity is computed from, looked at per call: weights as they are now, config, adapters.

The identity is hashed once (the weights take seconds); a cheap look per call tells whether any of
its inputs may have changed since: every parameter and buffer (the tensor object, its ``_version``
counter, which every in-place write through the tensor bumps, and its storage pointer), the config
hash and attention implementation, the adapter state of PEFT tuner layers (active, merged,
disabled, scaling: switched without writing a tensor) and the process's matmul numerics. Only a
changed look re-hashes; docs/engine.md section 9 has the table of inputs.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ._identify import config_sha256, tensors_sha256

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Look"]

_TensorKey = tuple[int, str, "weakref.ref[torch.Tensor]", int, int]


def _walk(model: torch.nn.Module) -> tuple[list[_TensorKey], tuple[Any, ...]]:
    """One pass over the modules: every parameter and buffer (tied ones once per owning module) as
    (module, attribute, weak reference, version, storage pointer), and every PEFT tuner layer's state."""
    tensors: list[_TensorKey] = []
    adapters = []
    for i, m in enumerate(model.modules()):  # positions, not dotted names: no string is built per call
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    tensors.append((i, name, weakref.ref(t), _version(t), _ptr(t)))
        if _tuner(type(m)):
            adapters.append((i, *_adapter_state(m)))
    return tensors, tuple(adapters)


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter; -1 for an inference-mode tensor (it keeps none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.data_ptr())
    except RuntimeError:  # a tensor subclass without one storage
        return 0


_TUNERS: dict[type, bool] = {}


def _tuner(cls: type) -> bool:
    """Whether a module class is a PEFT tuner layer (its class declares the adapter state; checked once per
    class: an instance ``hasattr`` on a torch module raises and catches per module)."""
    known = _TUNERS.get(cls)
    if known is None:
        known = _TUNERS[cls] = hasattr(cls, "merged_adapters") and hasattr(cls, "active_adapters")
    return known


def _adapter_state(m: torch.nn.Module) -> tuple[Any, ...]:
    """A PEFT tuner layer's switchable state (duck-typed: peft need not be installed): active, merged,
    disabled, and the scale of each adapter."""
    scaling = getattr(m, "scaling", None)
    scales = tuple(sorted((str(k), float(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else ()
    active: Any = m.active_adapters
    return (tuple(map(str, [active] if isinstance(active, str) else active)),
            tuple(map(str, getattr(m, "merged_adapters", ()))), bool(getattr(m, "disable_adapters", False)), scales)


def _numerics(model: PreTrainedModel) -> tuple[Any, ...]:
    """Process-wide settings that change kernel numerics: matmul precision, reduced-precision reductions,
    TF32, deterministic algorithms, and on CPU the intra-op thread count (it changes reduction order)."""
    cuda = torch.backends.cuda.matmul
    threads = torch.get_num_threads() if next(model.parameters()).device.type == "cpu" else 0
    return (torch.get_float32_matmul_precision(), bool(cuda.allow_tf32),
            bool(cuda.allow_fp16_reduced_precision_reduction), bool(cuda.allow_bf16_reduced_precision_reduction),
            bool(torch.backends.cudnn.allow_tf32), torch.are_deterministic_algorithms_enabled(), threads)


class Look:
    """One look at the model; comparing it with the look its identity was computed from decides a re-hash."""

    def __init__(self, model: PreTrainedModel):
        self.tensors, self.adapters = _walk(model)
        cfg = model.config
        self.config = (config_sha256(cfg), str(getattr(cfg, "_attn_implementation", None)))
        self.numerics = _numerics(model)

    def same_tensors(self, seen: Look) -> bool:
        """Every parameter and buffer is the tensor ``seen`` saw (a dead weak reference: replaced), at the
        same storage, with no in-place write since."""
        return len(self.tensors) == len(seen.tensors) and all(
            a[:2] == b[:2] and a[2]() is not None and a[2]() is b[2]() and a[3:] == b[3:]
            for a, b in zip(self.tensors, seen.tensors))

    def same(self, seen: Look) -> bool:
        """Nothing the identity is computed from changed since ``seen``."""
        return (self.config, self.adapters, self.numerics) == (seen.config, seen.adapters, seen.numerics) \
            and self.same_tensors(seen)

    def identity_extra(self, model: PreTrainedModel) -> dict[str, str]:
        """The identity's extra keys for what this look saw beyond the weights and config (hf.identity has those)."""
        adapters = json.dumps(self.adapters, separators=(",", ":"))
        return {"prefix_cache.adapters_sha256": hashlib.sha256(adapters.encode()).hexdigest(),
                "prefix_cache.buffers_sha256": _volatile_buffers_sha256(model),
                "prefix_cache.numerics": json.dumps(self.numerics, separators=(",", ":"))}


def _volatile_buffers_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the non-persistent buffers (rotary ``inv_freq``, ...): not in the state dict, but read by forward."""
    persistent = set(model.state_dict().keys())
    return tensors_sha256((n, b) for n, b in model.named_buffers() if n not in persistent)
