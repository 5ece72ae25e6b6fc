"""What an MLX PrefixCache's identity is computed from: the weights (hashed once), the config, the cache settings.

The weights are hashed once at open (SHA-256 over every parameter's name, dtype, shape and bytes)
and again when a cheap per-call :class:`Look` sees that a parameter was replaced (``model.update``,
``load_weights``, quantizing, a LoRA layer swapped in: new array objects) or the config changed.
The look also reads every module's plain attributes — numbers, strings and flags that change the
numbers without an array changing: an adapter's ``scale`` (mlx_lm's LoRA and DoRA layers), a
dropout's probability and the training flag, a quantized layer's ``bits``, ``group_size`` and
``mode`` — and their hash enters the identity (``modules_sha256``), as the transformers side's
adapter state does. A model in training mode with an active dropout is not served (it draws anew
each forward: :func:`training_dropout`).
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

__all__ = ["CacheSettings", "Look", "config_of", "draft_key", "identity", "module_settings", "modules_sha256",
           "training_dropout", "weights_sha256"]


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


_PLAIN = (bool, int, float, str, type(None))


def _plain(v: Any) -> Any:
    """``v`` if it is a plain value (or a tuple/list of them) that a module's forward may read; else None
    (arrays and submodules are parameters or modules of their own; callables and objects are code)."""
    if isinstance(v, _PLAIN):
        return repr(v) if isinstance(v, float) else v  # repr: every float exactly (and NaN equal to itself)
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return tuple(repr(x) if isinstance(x, float) else x for x in v)
    return None


def module_settings(model: Any) -> tuple[Any, ...]:
    """Every module's plain attributes, in module order: (path, class, ((name, value), ...)). The
    adapter scales, dropout probabilities, training flags and quantization settings among them
    change the numbers without changing an array."""
    out = []
    for path, m in model.named_modules():
        attrs = tuple(sorted((k, pv) for k, v in vars(m).items() if k != "_no_grad" and (pv := _plain(v)) is not None))
        out.append((path, type(m).__qualname__, attrs))
    return tuple(out)


def modules_sha256(settings: tuple[Any, ...]) -> str:
    return hashlib.sha256(json.dumps(settings, separators=(",", ":")).encode()).hexdigest()


def draft_key(draft: Any, weights: str | None = None, settings: tuple[Any, ...] | None = None) -> str:
    """A draft model's key (its snapshots' component is ``draft-`` and its first 16 hex digits): the
    SHA-256 of its weights hash and its modules' plain attributes (``weights``, ``settings``: the
    ones already computed)."""
    weights = weights or weights_sha256(draft)
    mods = modules_sha256(settings if settings is not None else module_settings(draft))
    return hashlib.sha256(f"{weights}:{mods}".encode()).hexdigest()


def training_dropout(model: Any) -> bool:
    """Whether a module in training mode drops out (mlx's dropout layers keep ``_p_1 = 1 - p``)."""
    return any(getattr(m, "training", False) and float(vars(m).get("_p_1", 1.0)) < 1.0
               for _, m in model.named_modules())


class Look:
    """One cheap look at the model: each parameter's array object (weakly held), the config hash and
    every module's plain attributes."""

    def __init__(self, model: Any):
        self.params = [(name, weakref.ref(a)) for name, a in _params(model)]
        self.config = config_sha256(model)
        self.modules = module_settings(model)

    def same_params(self, seen: Look) -> bool:
        """Every parameter is the array object ``seen`` saw (none replaced)."""
        return len(self.params) == len(seen.params) and all(
            a[0] == b[0] and a[1]() is not None and a[1]() is b[1]() for a, b in zip(self.params, seen.params))

    def same(self, seen: Look) -> bool:
        """No parameter replaced, the config and every module's plain attributes unchanged."""
        return self.config == seen.config and self.modules == seen.modules and self.same_params(seen)


def identity(model: Any, pack: str, kv: str, settings: CacheSettings, extra: dict[str, Any]) -> Identity:
    """The store identity: mlx and mlx_lm versions, the weights, the KV dtype, the config, every
    module's plain attributes and the cache settings."""
    cfg = config_of(model)
    return Identity(build=f"mlx-{getattr(mx, '__version__', '?')}+mlx_lm-{mlx_lm.__version__}", pack=pack, kv=kv,
                    extra={**extra, "engine": "mlx_lm", "model_type": str(cfg.get("model_type", cfg["class"])),
                           "config_sha256": config_sha256(model), "device": str(mx.default_device()),
                           "modules_sha256": modules_sha256(module_settings(model)), **settings.extra()})
