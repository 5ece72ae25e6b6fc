"""What an MLX PrefixCache's identity is computed from: the weights (hashed once), the config, the cache settings.

The weights are hashed once at open (SHA-256 over every parameter's name, dtype, shape and bytes)
and again when a cheap per-call :class:`Look` sees that a parameter was replaced (``model.update``,
``load_weights``, quantizing, a LoRA layer swapped in: new array objects) or the config changed.
MLX arrays keep no write counter and an in-place ``w[...] = x`` keeps the object and its buffer,
so such a write is not seen per call: :meth:`PrefixCache.refresh` re-hashes on demand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from snapstore import Identity

from ._arrays import to_numpy

__all__ = ["CacheSettings", "Look", "config_of", "identity", "weights_sha256"]


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """The generate_step arguments that change the bytes of a prompt's state, normalised (None: not used)."""

    prefill_step_size: int
    kv_bits: int | None
    kv_group_size: int | None
    quantized_kv_start: int | None
    max_kv_size: int | None

    def extra(self) -> dict[str, int | None]:
        return {f"mlx.{k}": v for k, v in dataclasses.asdict(self).items()}


def _params(model: Any) -> list[tuple[str, mx.array]]:
    leaves: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]  # a list here
    return sorted(leaves, key=lambda kv: kv[0])


def weights_sha256(model: Any) -> str:
    """SHA-256 of every parameter (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, a in _params(model):
        a = mx.contiguous(a)
        mx.eval(a)
        h.update(f"{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        h.update(to_numpy(a).data)  # the exact bytes (bfloat16 through its uint16 view)
    return h.hexdigest()


def config_of(model: Any) -> dict[str, Any]:
    """The model's arguments (``model.args``, a dataclass in mlx_lm's models) as a JSON-able dict."""
    args = getattr(model, "args", None)
    if args is None:
        return {"class": type(model).__module__ + "." + type(model).__qualname__}
    raw = dataclasses.asdict(args) if dataclasses.is_dataclass(args) and not isinstance(args, type) \
        else dict(vars(args))
    return {"class": type(model).__module__ + "." + type(model).__qualname__, **raw}


def config_sha256(model: Any) -> str:
    return hashlib.sha256(json.dumps(config_of(model), sort_keys=True, default=str).encode()).hexdigest()


class Look:
    """One cheap look at the model: each parameter's array object (weakly held) and the config hash."""

    def __init__(self, model: Any):
        self.params = [(name, weakref.ref(a)) for name, a in _params(model)]
        self.config = config_sha256(model)

    def same(self, seen: Look) -> bool:
        """Every parameter is the array object ``seen`` saw (none replaced) and the config is unchanged."""
        return self.config == seen.config and len(self.params) == len(seen.params) and all(
            a[0] == b[0] and a[1]() is not None and a[1]() is b[1]() for a, b in zip(self.params, seen.params))


def identity(model: Any, pack: str, kv: str, settings: CacheSettings, extra: dict[str, Any]) -> Identity:
    """The store identity: mlx and mlx_lm versions, the weights, the KV dtype, the config and the cache settings."""
    cfg = config_of(model)
    return Identity(build=f"mlx-{getattr(mx, '__version__', '?')}+mlx_lm-{mlx_lm.__version__}", pack=pack, kv=kv,
                    extra={**extra, "engine": "mlx_lm", "model_type": str(cfg.get("model_type", cfg["class"])),
                           "config_sha256": config_sha256(model), "device": str(mx.default_device()),
                           **settings.extra()})
