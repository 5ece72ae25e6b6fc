"""Snapshot and restore a transformers ``DynamicCache`` (transformers 5.23) as snapstore parts.

One ``DynamicCache`` class serves every model family in transformers 5.x; its layers are
``DynamicLayer`` (full attention), ``DynamicSlidingWindowLayer`` (sliding/chunked attention),
``LinearAttentionLayer`` (Mamba2 / gated DeltaNet / short-conv state), the two hybrids
``LinearAttentionAndFullAttentionLayer`` / ``LinearAttentionAndSlidingWindowAttentionLayer``, and
``DummyLayer`` (no state). Parts, per cache layer ``i``:

============================  =======  ==============================================  =========
part                          kind     stored as (canonical, token axis outermost)     from
============================  =======  ==============================================  =========
``layers.i.keys`` / ``values``  rows     row ``(B, H_kv, D)`` of ``keys[B, H_kv, T, D]``  full attn
``layers.i.keys`` / ``values``  fixed    ``(W-1, B, H_kv, D)`` window, zero padded        sliding
``layers.i.conv{j}``            fixed    ``conv_states[j]`` ``[B, C, K]`` (model dtype)   linear
``layers.i.rec{j}``             fixed    ``recurrent_states[j]`` (float32 on CPU paths)   linear
``hf.meta``                     fixed    int64 ``(L, 4)``: kind, seq_len, kv_rows, flags  all
============================  =======  ==============================================  =========

``hf.meta`` holds what is not a tensor: per layer the class code, the token count the layer has
seen (``cumulative_length`` for sliding layers — it drives positions and masks), the valid rows of
a sliding window, and the ``has_previous_state`` bits of linear layers. It is a tiny fixed part, so
it is saved whole in every snapshot, checked on restore, and covered by the same checksums.
Full-attention K/V are append-only rows, so a snapshot over a parent stores only new rows plus the
fixed parts (recurrent state, conv state, windows, meta).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np

# first: the torch adapter's names check torch (without it, TorchMissingError says what to install)
from ..torch import Staging, TokenIds, TorchAdapter, dtype_name, shared_staging, torch_dtype

# isort: split
import torch

from snapstore import (
    DestinationError,
    Fixed,
    IdentityError,
    Layout,
    LayoutError,
    Match,
    RestoreResult,
    Rows,
    SaveResult,
    SnapshotUnavailableError,
    Store,
    UnsupportedCacheError,
)

from ._identify import config_sha256, identity, weights_sha256

if TYPE_CHECKING:
    from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

__all__ = [
    "CachePart",
    "CacheSnapshot",
    "config_sha256",
    "identity",
    "layout_for",
    "open_store",
    "restore",
    "save",
    "snapshot",
    "weights_sha256",
]

META = "hf.meta"
KIND_DUMMY, KIND_FULL, KIND_SLIDING, KIND_LINEAR, KIND_LINEAR_FULL, KIND_LINEAR_SLIDING = range(6)
_PART = re.compile(r"^layers\.(\d+)\.(keys|values|conv\d+|rec\d+)$")

CachePart = Union[torch.Tensor, np.ndarray]
"""One part of a cache snapshot: a live cache tensor, or the int64 ``hf.meta`` array."""


def _cache_classes() -> dict[type, int]:
    from transformers import cache_utils as cu

    return {cu.DummyLayer: KIND_DUMMY, cu.DynamicLayer: KIND_FULL, cu.DynamicSlidingWindowLayer: KIND_SLIDING,
            cu.LinearAttentionLayer: KIND_LINEAR, cu.LinearAttentionAndFullAttentionLayer: KIND_LINEAR_FULL,
            cu.LinearAttentionAndSlidingWindowAttentionLayer: KIND_LINEAR_SLIDING}


def _kind(layer: Any, i: int) -> int:
    kind = _cache_classes().get(type(layer))
    if kind is None:
        raise UnsupportedCacheError(f"cache layer {i} is a {type(layer).__name__}; supported: DynamicLayer, "
                                  "DynamicSlidingWindowLayer, LinearAttention*Layer, DummyLayer")
    return kind


def _has_attention(kind: int) -> bool:
    return kind in (KIND_FULL, KIND_SLIDING, KIND_LINEAR_FULL, KIND_LINEAR_SLIDING)


def _sliding(kind: int) -> bool:
    return kind in (KIND_SLIDING, KIND_LINEAR_SLIDING)


def _linear(kind: int) -> bool:
    return kind in (KIND_LINEAR, KIND_LINEAR_FULL, KIND_LINEAR_SLIDING)


@dataclass
class CacheSnapshot:
    """A cache described as snapstore parts (references to the live tensors, not copies).

    Save it (``save()`` / ``TorchAdapter.save``) before the next forward: linear-attention state is
    updated in place, so a snapshot held across a forward would describe the new state.
    """

    layout: Layout
    parts: dict[str, CachePart]
    n_tokens: int
    token_dims: dict[str, int] = field(default_factory=dict)
    pad_rows: dict[str, int] = field(default_factory=dict)

    def clone(self) -> CacheSnapshot:
        """A snapshot that owns copies of every tensor (safe to keep across forwards)."""
        parts = {k: (v.clone() if isinstance(v, torch.Tensor) else np.array(v, copy=True))
                 for k, v in self.parts.items()}
        return CacheSnapshot(self.layout, parts, self.n_tokens, dict(self.token_dims), dict(self.pad_rows))


def snapshot(cache: DynamicCache) -> CacheSnapshot:
    """Describe a transformers ``DynamicCache`` as a layout and parts (no copy).

    The cache must have seen at least one token, have at least one attention layer (a transformers
    5.23 limitation), and not be in ``record_past`` (speculative rollback) mode.
    """
    layers: list[Any] = list(cache.layers)  # the layer classes' own attributes differ (see _kind)
    meta = np.zeros((len(layers), 4), dtype=np.int64)
    fixed: dict[str, Fixed] = {}
    rows: dict[str, Rows] = {}
    parts: dict[str, CachePart] = {META: meta}
    token_dims: dict[str, int] = {}
    pad_rows: dict[str, int] = {}
    seq: int | None = None
    for i, layer in enumerate(layers):
        kind = _kind(layer, i)
        meta[i, 0] = kind
        if _has_attention(kind):
            if getattr(layer, "record_past", False):
                raise UnsupportedCacheError(f"layer {i} records its past (speculative mode); snapshot after crop()")
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
                raise LayoutError(f"layer {i} has no tokens yet; snapshot after at least one forward")
            k, v = layer.keys, layer.values
            n = int(k.shape[-2])
            b = int(k.shape[0])
            for name, t in ((f"layers.{i}.keys", k), (f"layers.{i}.values", v)):
                token_dims[name] = 2
                parts[name] = t
                if _sliding(kind):
                    cap = int(layer.sliding_window) - 1
                    if n > cap:
                        raise LayoutError(f"layer {i}: {n} window rows exceed the window of {cap}")
                    fixed[name] = Fixed(dtype_name(t.dtype), (cap, b, t.shape[1], t.shape[3]))
                    pad_rows[name] = cap
                else:
                    rows[name] = Rows(dtype_name(t.dtype), (b, t.shape[1], t.shape[3]))
            layer_seq = int(layer.cumulative_length) if _sliding(kind) else n
            meta[i, 1], meta[i, 2] = layer_seq, n
            if seq is None:
                seq = layer_seq
            elif seq != layer_seq:
                raise LayoutError(f"layer {i} has seen {layer_seq} tokens, an earlier layer {seq}")
        if _linear(kind):
            if layer.record_past:
                raise UnsupportedCacheError(f"layer {i} records its past (speculative mode); snapshot after crop()")
            flags = 0
            for j in range(layer.number_of_states):
                if not layer.has_previous_state[j]:
                    raise LayoutError(f"layer {i} state {j} has seen no tokens; snapshot after a forward")
                flags |= 1 << j
                conv = layer.conv_states.get(j) if layer.is_conv_states_initialized[j] else None
                rec = layer.recurrent_states.get(j) if layer.is_recurrent_states_initialized[j] else None
                for name, t in ((f"layers.{i}.conv{j}", conv), (f"layers.{i}.rec{j}", rec)):
                    if t is not None:
                        fixed[name] = Fixed(dtype_name(t.dtype), tuple(t.shape))
                        parts[name] = t
            meta[i, 3] = flags
    if seq is None:
        raise LayoutError("the cache has no attention layer (transformers 5.23 cannot run such a cache)")
    meta[:, 1] = np.where(meta[:, 1] == 0, seq, meta[:, 1])
    fixed[META] = Fixed("int64", meta.shape)
    return CacheSnapshot(Layout(fixed=fixed, rows=rows), parts, seq, token_dims, pad_rows)


@torch.no_grad()
def layout_for(model: PreTrainedModel, batch: int = 1) -> Layout:
    """The layout of ``model``'s cache for ``batch`` sequences (one 1-token probe forward).

    Open the store with it before the first prefill, in every process that saves or restores.
    """
    device = next(model.parameters()).device
    ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
    cache = model(ids, use_cache=True).past_key_values
    return snapshot(cache).layout


def save(adapter: TorchAdapter | Store, cache: DynamicCache, tokens: TokenIds, **kwargs: Any) -> SaveResult:
    """Save the cache's state after ``tokens`` (``len(tokens)`` must equal the cache's length).

    kwargs go to ``Store.save`` (session, parent='auto', commit, namespace). Full-attention rows
    below the parent's boundary are not written again (delta); fixed parts are written whole.
    """
    ad = _adapter(adapter)
    snap = snapshot(cache)
    if snap.layout != ad.layout:
        raise LayoutError("the cache's layout differs from the store's: open the store with "
                          "hf.layout_for(model, batch) of this model and batch size")
    if len(tokens) != snap.n_tokens:
        raise LayoutError(f"{len(tokens)} tokens given, the cache has seen {snap.n_tokens}")
    return ad.save(tokens, snap.parts, token_dims=snap.token_dims, pad_rows=snap.pad_rows, **kwargs)


def _adapter(adapter: TorchAdapter | Store) -> TorchAdapter:
    """The adapter to use; a bare Store gets the process-wide shared staging (no pinned buffer per call)."""
    return adapter if isinstance(adapter, TorchAdapter) else TorchAdapter(adapter, staging=shared_staging())


DeviceSpec = str | int | torch.device


def _layer_devices(device: DeviceSpec | Mapping[int, DeviceSpec] | Sequence[DeviceSpec] | None,
                   n_layers: int) -> list[torch.device]:
    """One device per cache layer: one device for all, or a per-layer map / list (a split model)."""
    if device is None:
        return [torch.device("cpu")] * n_layers
    if isinstance(device, (str, int, torch.device)):
        return [torch.device(device)] * n_layers
    if isinstance(device, Mapping):
        missing = [i for i in range(n_layers) if i not in device]
        if missing:
            raise DestinationError(f"the device map has no entry for cache layer(s) {missing}; give every layer "
                                   f"0..{n_layers - 1} its device (the device of that decoder layer's weights)")
        return [torch.device(device[i]) for i in range(n_layers)]
    devs = list(device)
    if len(devs) != n_layers:
        raise DestinationError(f"{len(devs)} devices given for {n_layers} cache layers")
    return [torch.device(d) for d in devs]


def _numel(t: Any) -> int:
    return int(t.numel()) if isinstance(t, torch.Tensor) else 0


def _parse(name: str) -> tuple[int, str] | None:
    m = _PART.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def restore(cache_or_config: DynamicCache | PretrainedConfig, adapter: TorchAdapter | Store,
            match: Match | SaveResult, *,
            device: DeviceSpec | Mapping[int, DeviceSpec] | Sequence[DeviceSpec] | None = None,
            components: Iterable[str] | None = None, session: str | None = None) -> tuple[DynamicCache, RestoreResult]:
    """Restore snapshot ``match`` into a fresh cache; returns ``(cache, RestoreResult)``.

    cache_or_config: an empty ``DynamicCache`` to fill, or the model config (a new
    ``DynamicCache(config=...)`` is built). device: where the state goes (default CPU): one device,
    or per cache layer a map ``{layer: device}`` / a list, for a model split across devices (each
    layer's state on the device of that layer's weights). Destination tensors are allocated once,
    at their final size, and the chunks stream into them through the staging buffer; the cache
    then adopts them. The cache is not
    modified unless the whole restore succeeded. Continue with ``model(rest, past_key_values=cache)``.
    session: the caller's session key, as for ``Store.restore``.
    """
    from transformers import DynamicCache

    ad = _adapter(adapter)
    layout = ad.layout
    if META not in layout.fixed:
        raise LayoutError("this store's layout was not made by snapstore.engine.hf")
    if isinstance(cache_or_config, DynamicCache):
        cache = cache_or_config
        if any(_has_attention(_kind(la, i)) and _numel(getattr(la, "keys", None))
               for i, la in enumerate(cache.layers)):
            raise DestinationError("restore() needs an empty cache")
    else:
        want = ad.store.identity.extra.get("config_sha256")
        if want is not None and config_sha256(cache_or_config) != want:
            raise IdentityError("the config differs from the one this store's identity was made for "
                                "(config_sha256); restore into the model the snapshot was saved from")
        cache = DynamicCache(config=cache_or_config)
    n_layers = layout.fixed[META].shape[0]
    layers = list(cache.layers)
    if len(layers) != n_layers:
        raise LayoutError(f"the cache has {len(layers)} layers, the snapshot layout {n_layers}")
    kinds = [_kind(la, i) for i, la in enumerate(layers)]
    devs = _layer_devices(device, n_layers)
    n = int(getattr(match, "n_tokens", 0))
    if n <= 0:
        raise DestinationError("restore() needs a Match (or an object with n_tokens) to size the K/V tensors")
    into: dict[str, Any] = {META: np.zeros(layout.fixed[META].shape, dtype=np.int64)}
    token_dims: dict[str, int] = {}
    for name, spec in layout.parts.items():
        if name == META:
            continue
        parsed = _parse(name)
        if parsed is None:
            raise LayoutError(f"unexpected part {name!r} in an hf layout")
        i, what = parsed
        if i >= n_layers:
            raise LayoutError(f"part {name!r} names layer {i}; the cache has {n_layers}")
        kind, dev = kinds[i], devs[i]
        dt = torch_dtype(spec.dtype)
        if what in ("keys", "values"):
            if not _has_attention(kind) or isinstance(spec, Fixed) != _sliding(kind):
                raise LayoutError(f"part {name!r} does not fit cache layer {i} ({type(layers[i]).__name__})")
            if isinstance(spec, Rows):
                b, h, d = spec.row_shape
                into[name] = torch.empty((b, h, n, d), dtype=dt, device=dev)
            else:
                cap, b, h, d = spec.shape
                into[name] = torch.empty((b, h, cap, d), dtype=dt, device=dev)
            token_dims[name] = 2
        else:
            if not _linear(kind):
                raise LayoutError(f"part {name!r} does not fit cache layer {i} ({type(layers[i]).__name__})")
            assert isinstance(spec, Fixed)
            into[name] = torch.empty(spec.shape, dtype=dt, device=dev)
    res = ad.restore(match, into, components, token_dims=token_dims, session=session)
    meta = into[META]
    _check_meta(meta, kinds, res.n_tokens, res)
    _install(layers, kinds, meta, into)
    return cache, res


def _check_meta(meta: np.ndarray, kinds: list[int], n_tokens: int, res: RestoreResult) -> None:
    for i, kind in enumerate(kinds):
        if int(meta[i, 0]) != kind:
            raise SnapshotUnavailableError(f"layer {i} was saved as kind {int(meta[i, 0])}, the cache has {kind}; "
                                           "the model config differs", snapshot_id=res.chain[-1])
        if _has_attention(kind) and int(meta[i, 1]) != n_tokens:
            raise SnapshotUnavailableError(f"layer {i} saw {int(meta[i, 1])} tokens, the snapshot holds {n_tokens}",
                                           snapshot_id=res.chain[-1])


def _install(layers: list[Any], kinds: list[int], meta: np.ndarray, into: Mapping[str, Any]) -> None:
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        if _has_attention(kind):
            k, v = into[f"layers.{i}.keys"], into[f"layers.{i}.values"]
            if _sliding(kind):
                rows = int(meta[i, 2])
                k, v = k[:, :, :rows].contiguous(), v[:, :, :rows].contiguous()
            layer.lazy_initialization(k, v)  # dtype/device bookkeeping (hybrids dispatch to the attention half)
            layer.keys, layer.values = k, v  # adopt the restored tensors: no second copy
            if _sliding(kind):
                layer.cumulative_length = int(meta[i, 1])
        if _linear(kind):
            flags = int(meta[i, 3])
            for j in range(layer.number_of_states):
                conv = into.get(f"layers.{i}.conv{j}")
                rec = into.get(f"layers.{i}.rec{j}")
                if conv is not None:
                    layer.update_conv_state(conv, state_idx=j, conv_kernel_size=conv.shape[-1])
                if rec is not None:
                    layer.update_recurrent_state(rec, state_idx=j)
                layer.has_previous_state[j] = bool(flags >> j & 1)


def open_store(model: PreTrainedModel, path: str | os.PathLike[str] | None = None, *, batch: int = 1,
               pack: str | None = None, staging: Staging | int | None = None, extra: Mapping[str, Any] | None = None,
               **kwargs: Any) -> TorchAdapter:
    """Open a Store for ``model`` (identity + probed layout) and wrap it in a TorchAdapter.

    kwargs go to ``Store.open`` (budget, drop_stale, chunk_bytes, codec, staging_bytes, check_rows).
    The store is ``adapter.store``; close it when done.
    """
    store = Store.open(path, identity=identity(model, pack=pack, extra=extra), layout=layout_for(model, batch),
                       **kwargs)
    return TorchAdapter(store, staging=staging)

