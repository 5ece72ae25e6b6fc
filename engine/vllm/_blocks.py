"""vLLM's paged K/V as snapstore rows: identity, layout, and whole-block copies (no vLLM import).

A vLLM layer's cache is one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(CPU backend); how a block's bytes are packed (keys transposed, values after them) belongs to the
attention kernel variant, so snapstore stores **whole blocks as opaque rows**: one row per block,
holding that block of every layer (``uint8``, shape ``(layers, block_bytes)``), and everything
that changes those bytes goes into the identity. A snapshot of ``n`` tokens then holds
``n // block_size`` rows, and ``Layout(tokens_per_row=block_size)`` lets a prompt take any
block-aligned prefix of any stored prompt (docs/api.md "Prefixes at block granularity").
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import snapstore as ss

__all__ = ["BlockGeometry", "BlockWriter", "gather_blocks", "host_pools", "weights_hash"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_hash_cache: dict[tuple[str, int, float], str] = {}


def weights_hash(model_dir: str) -> str:
    """``sha256:`` of every weight file of a local model directory (names, sizes and bytes), so
    two deployments of the same weights share a store and retrained weights never do. Cached per
    process; the hash reads the weights once (pass ``weights_hash`` in the config to skip it)."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(_WEIGHT_SUFFIXES)) if os.path.isdir(model_dir) \
        else []
    if not files:
        raise ss.ConfigError(f"no weight files (*.safetensors, *.bin) in {model_dir!r}: pass "
                             "kv_connector_extra_config={'weights_hash': ...} (a model not in a local dir)")
    stamp = (os.path.abspath(model_dir), sum(os.path.getsize(os.path.join(model_dir, f)) for f in files),
             max(os.path.getmtime(os.path.join(model_dir, f)) for f in files))
    if stamp in _hash_cache:
        return _hash_cache[stamp]
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0")
        with open(os.path.join(model_dir, name), "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    out = "sha256:" + h.hexdigest()
    _hash_cache[stamp] = out
    return out


@dataclass(frozen=True)
class BlockGeometry:
    """What one cache block of one layer is: the tensor shape vLLM allocates and its dtype."""

    layers: int
    kv_heads: int
    block_size: int
    entry: int  # last axis: 2 * head_size on the CPU backend; MLA: the latent width (kv_lora_rank + rope dim)
    dtype: torch.dtype
    latent: bool = False  # MLA: one latent vector per token (kv_heads 1, entry the latent width, no V half)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(kv_heads, block_size, entry)``: one block of one layer (MLA on the CPU: ``(1, block_size, latent)``)."""
        return (self.kv_heads, self.block_size, self.entry)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.kv_heads * self.block_size * self.entry * self.dtype.itemsize

    def layout(self) -> ss.Layout:
        """One stream ``kv``: one row per block, the block of every layer, opaque bytes."""
        return ss.Layout(rows={"kv": ss.Rows("uint8", (self.layers, self.block_bytes))},
                         tokens_per_row=self.block_size)

    def identity(self, *, build: str, pack: str, kv: str, backend: str, tp: tuple[int, int],
                 extra: Mapping[str, str] | None = None) -> ss.Identity:
        """Everything that changes a block's bytes: engine build, weights, dtype, geometry, kernel, shard."""
        keys = {"block_size": str(self.block_size), "kv_heads": str(self.kv_heads), "entry": str(self.entry),
                "layers": str(self.layers), "attn_backend": backend, "tp": f"{tp[0]}/{tp[1]}", **(extra or {})}
        return ss.Identity(build=build, pack=pack, kv=kv, mtp=False, extra=keys)


def host_pools(kv_caches: Sequence[torch.Tensor], geo: BlockGeometry) -> list[np.ndarray]:
    """Each layer's cache as a ``(num_blocks, block_bytes)`` uint8 numpy view (shared memory:
    writes land in vLLM's cache). ``ss.LayoutError`` when a tensor is not what the identity says."""
    pools = []
    for i, t in enumerate(kv_caches):
        if t.device.type != "cpu" or t.dtype != geo.dtype or tuple(t.shape[1:]) != geo.block_shape:
            raise ss.LayoutError(f"vLLM cache tensor {i} is {tuple(t.shape)} {t.dtype} on {t.device}; the connector "
                                 f"expects [blocks, {', '.join(map(str, geo.block_shape))}] {geo.dtype} on cpu")
        if not t[0].is_contiguous() or t.stride(0) != t[0].numel():
            raise ss.LayoutError(f"vLLM cache tensor {i} has non-contiguous blocks (strides {t.stride()})")
        pools.append(t.detach().view(torch.uint8).reshape(t.shape[0], -1).numpy())
    return pools


def gather_blocks(pools: Sequence[np.ndarray], block_ids: Sequence[int]) -> np.ndarray:
    """A private copy ``(len(block_ids), layers, block_bytes)`` of the named blocks of every layer:
    a save reads it later, off the forward pass, while vLLM may reuse the blocks."""
    ids = np.asarray(block_ids, dtype=np.int64)
    out = np.empty((len(ids), len(pools), pools[0].shape[1]), dtype=np.uint8)
    for layer, pool in enumerate(pools):
        np.take(pool, ids, axis=0, out=out[:, layer])
    return out


class BlockWriter:
    """A snapstore ``PartWriter``: canonical row bytes (block-major, then layer) scattered into
    the blocks ``block_ids`` of every layer's pool. Byte ranges may start or end inside a block.
    :meth:`views` lends the blocks themselves, so a restore reads each chunk straight into vLLM's
    cache and checks it there (no staging copy, no scatter: issue 31)."""

    def __init__(self, pools: Sequence[np.ndarray], block_ids: Sequence[int]):
        self._pools = list(pools)
        self._ids = [int(b) for b in block_ids]
        self._unit = int(self._pools[0].shape[1])
        self.nbytes = len(self._ids) * len(self._pools) * self._unit
        # each pool whole as flat bytes (host_pools checked that its blocks are contiguous)
        self._flat = [memoryview(p.reshape(-1)).cast("B")  # type: ignore[arg-type]
                      if p.flags.c_contiguous else None for p in self._pools]
        self._units: list[memoryview] | None = None  # built by the first views() call

    def views(self, offset: int, n: int) -> list[memoryview] | None:
        """Writable views of canonical bytes ``[offset, offset + n)`` in order — one per (block,
        layer) touched — in the pools themselves; None when a pool is not contiguous (then
        :meth:`write_from`)."""
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ss.InvalidInputError(f"bytes [{offset}, {offset + n}) are outside {self.nbytes}")
        units = self._unit_views()
        if units is None:
            return None
        if n == 0:
            return []
        unit = self._unit
        u0, w0 = divmod(offset, unit)
        u1, w1 = divmod(offset + n - 1, unit)  # the unit holding the last byte, and its offset there
        out = units[u0:u1 + 1]  # a restore asks for a chunk's rows: whole units but at its ends
        if u0 == u1:
            out[0] = out[0][w0:w1 + 1]
        else:
            out[0], out[-1] = out[0][w0:], out[-1][:w1 + 1]
        return out

    def _unit_views(self) -> list[memoryview] | None:
        """Every (block, layer) unit as a writable view, in canonical order, made once: a restore
        asks for them chunk by chunk, and slicing a ready list costs far less than locating each."""
        if self._units is None:
            if any(f is None for f in self._flat):
                return None
            flat: list[memoryview] = self._flat  # type: ignore[assignment]
            unit = self._unit
            self._units = [f[b * unit:(b + 1) * unit] for b in self._ids for f in flat]
        return self._units

    def write_from(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at byte ``offset`` of the sequence's rows."""
        src = np.frombuffer(data, dtype=np.uint8)
        if offset < 0 or offset + len(src) > self.nbytes:
            raise ss.InvalidInputError(f"bytes [{offset}, {offset + len(src)}) are outside {self.nbytes}")
        layers, unit, pos = len(self._pools), self._unit, 0
        while pos < len(src):
            u, within = divmod(offset + pos, unit)
            row, layer = divmod(u, layers)
            take = min(unit - within, len(src) - pos)
            self._pools[layer][self._ids[row], within:within + take] = src[pos:pos + take]
            pos += take


def torch_dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the identity's kv field)."""
    return str(dtype).removeprefix("torch.")
