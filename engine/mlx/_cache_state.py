"""mlx_lm prompt caches <-> the store's parts: every cache kind mlx_lm's models make, exactly.

A prompt cache is a list with one entry per layer; each entry is described by a :class:`Node`
(its kind and settings) and stored as named parts under the layer's index (``"3.k"``, ``"0.1.0"``):

- ``KVCache``: keys and values as row streams, one row ``(kv_heads, head_dim)`` per token. Rows
  below the offset never change (the cache writes each position once), so a capture's rows are a
  delta over its parent's.
- ``QuantizedKVCache`` (``kv_bits``): the packed values, scales and biases of keys and values, each
  a row stream (token axis 2, like the K/V rows).
- ``RotatingKVCache`` (sliding window, ``max_kv_size``): a window, not an append-only stream: the
  keys and values are fixed parts of capacity ``max_size`` plus ``meta`` (valid rows, write index).
  A window in temporal order (after a prefill chunk) is stored as its ``keep`` first rows and its
  last ``max_size - keep``: exactly the rows the cache's next update reads, whether it appends a
  chunk or writes one token in place; a rotated window (after one-token steps) is stored as it is.
- ``ArraysCache`` (SSM, linear-attention, conv state): each array a fixed part (stored whole).
- ``CacheList``: its caches, each under ``"<layer>.<j>"``.

Other kinds (``ChunkedKVCache``, batch caches, a model's own class) are refused with
:class:`UnsupportedCacheError`; a batch of more than one sequence too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from snapstore import Fixed, Layout, LayoutError, Rows

from ._arrays import dtype_name, from_numpy, numpy_dtype, to_numpy

__all__ = ["Node", "UnsupportedCacheError", "describe", "held_tokens", "parts_of", "rebuild"]

Parts = dict[str, np.ndarray]


class UnsupportedCacheError(LayoutError, NotImplementedError):
    """A prompt cache holds a kind of cache (or a batch) this integration does not store."""


@dataclass(frozen=True)
class Node:
    """One cache entry's kind and the settings a fresh one is made with (``children``: a CacheList's)."""

    kind: str  # "kv", "qkv", "rot", "arrays", "list"
    settings: tuple[Any, ...] = ()
    children: tuple[Node, ...] = ()


def _kind(c: Any) -> str:
    for cls, kind in ((KVCache, "kv"), (QuantizedKVCache, "qkv"), (RotatingKVCache, "rot"),
                      (ArraysCache, "arrays"), (CacheList, "list")):
        if type(c) is cls:  # exact: subclasses and look-alikes (ChunkedKVCache, ...) may keep other state
            return kind
    raise UnsupportedCacheError(f"{type(c).__name__} is not a cache kind snapstore.engine.mlx stores (KVCache, "
                                "QuantizedKVCache, RotatingKVCache, ArraysCache, CacheList)")


def _one(a: Any, what: str) -> None:
    if a is not None and a.shape[0] != 1:
        raise UnsupportedCacheError(f"{what} holds a batch of {a.shape[0]} sequences; PrefixCache serves one")


def node_of(c: Any) -> Node:
    """The :class:`Node` describing cache entry ``c``."""
    kind = _kind(c)
    if kind == "qkv":
        return Node(kind, (c.group_size, c.bits, len(c.keys), len(c.values)))
    if kind == "rot":
        return Node(kind, (c.max_size, c.keep))
    if kind == "arrays":
        if c.left_padding is not None or c.lengths is not None:
            raise UnsupportedCacheError("an ArraysCache prepared for a padded batch; PrefixCache serves one sequence")
        return Node(kind, tuple(a is not None for a in c.cache))
    if kind == "list":
        return Node(kind, (), tuple(node_of(x) for x in c.caches))
    return Node(kind)


def describe(cache: list[Any]) -> tuple[tuple[Node, ...], Layout]:
    """The schema (one Node per layer) and the store Layout of a prompt cache that has read >= 1 token."""
    fixed: dict[str, Fixed] = {}
    rows: dict[str, Rows] = {}
    for i, c in enumerate(cache):
        _layout(str(i), c, fixed, rows)
    return tuple(node_of(c) for c in cache), Layout(fixed=fixed, rows=rows)


def _layout(p: str, c: Any, fixed: dict[str, Fixed], rows: dict[str, Rows]) -> None:
    kind = _kind(c)
    if kind == "kv":
        if c.keys is None:
            raise LayoutError(f"layer {p}: the KV cache is empty; describe a cache that has read a token")
        _one(c.keys, f"layer {p}")
        for s, a in (("k", c.keys), ("v", c.values)):
            rows[f"{p}.{s}"] = Rows(dtype_name(a.dtype), (a.shape[1], a.shape[3]))
    elif kind == "qkv":
        for s, group in (("k", c.keys), ("v", c.values)):
            for j, a in enumerate(group):
                _one(a, f"layer {p}")
                rows[f"{p}.{s}{j}"] = Rows(dtype_name(a.dtype), (a.shape[1], a.shape[3]))
    elif kind == "rot":
        _one(c.keys, f"layer {p}")
        for s, a in (("k", c.keys), ("v", c.values)):
            fixed[f"{p}.{s}"] = Fixed(dtype_name(a.dtype), (c.max_size, a.shape[1], a.shape[3]))
        fixed[f"{p}.meta"] = Fixed("int64", (2,))
    elif kind == "arrays":
        node_of(c)  # refuses a padded batch
        for j, a in enumerate(c.cache):
            if a is not None:
                _one(a, f"layer {p}")
                fixed[f"{p}.{j}"] = Fixed(dtype_name(a.dtype), tuple(a.shape))
    else:
        for j, x in enumerate(c.caches):
            _layout(f"{p}.{j}", x, fixed, rows)


def parts_of(cache: list[Any], n: int, *, prefix: bool = False) -> Parts:
    """The cache's state after ``n`` tokens as host arrays named like :func:`describe`'s layout (copies:
    the cache may go on reading while they are saved). ``prefix``: a KV layer may hold more than
    ``n`` tokens (its first ``n`` rows are the state after ``n``; other kinds must hold exactly ``n``)."""
    out: Parts = {}
    for i, c in enumerate(cache):
        _parts(str(i), c, n, out, prefix)
    return out


def held_tokens(cache: list[Any]) -> int | None:
    """The fewest tokens a KV layer of ``cache`` holds (None: no KV layer): a prefix every KV layer
    has. After speculative decoding the target's and the draft's caches differ by a token."""
    held: list[int] = []

    def walk(c: Any) -> None:
        kind = _kind(c)
        if kind in ("kv", "qkv"):
            held.append(int(c.offset))
        elif kind == "list":
            for x in c.caches:
                walk(x)

    for c in cache:
        walk(c)
    return min(held) if held else None


def _rows(a: mx.array, n: int) -> np.ndarray:
    """Rows [0, n) of a (1, heads, tokens, dim) array as (n, heads, dim)."""
    return to_numpy(mx.contiguous(a[0, :, :n, :].transpose(1, 0, 2)))


def _parts(p: str, c: Any, n: int, out: Parts, prefix: bool = False) -> None:
    kind = _kind(c)
    if kind in ("kv", "qkv"):
        if c.offset != n and not (prefix and c.offset > n):
            raise LayoutError(f"layer {p} holds {c.offset} tokens, the capture names {n}")
        if kind == "kv":
            out[f"{p}.k"], out[f"{p}.v"] = _rows(c.keys, n), _rows(c.values, n)
        else:
            for s, group in (("k", c.keys), ("v", c.values)):
                for j, a in enumerate(group):
                    out[f"{p}.{s}{j}"] = _rows(a, n)
    elif kind == "rot":
        if c.offset != n:
            raise LayoutError(f"layer {p} holds {c.offset} tokens, the capture names {n}")
        keys, values, n_valid, idx = _window(c)
        for s, a in (("k", keys), ("v", values)):
            buf = np.zeros((c.max_size, a.shape[1], a.shape[3]), numpy_dtype(dtype_name(a.dtype)))
            buf[:n_valid] = _rows(a, n_valid)
            out[f"{p}.{s}"] = buf
        out[f"{p}.meta"] = np.array([n_valid, idx], np.int64)
    elif kind == "arrays":
        for j, a in enumerate(c.cache):
            if a is not None:
                out[f"{p}.{j}"] = to_numpy(a)
    else:
        for j, x in enumerate(c.caches):
            _parts(f"{p}.{j}", x, n, out, prefix)


def _window(c: Any) -> tuple[mx.array, mx.array, int, int]:
    """A RotatingKVCache's keys, values, valid rows and write index, in at most ``max_size`` rows that
    the cache's next update reads exactly as it would read the cache's own arrays."""
    size, idx, ms, keep = c.keys.shape[2], c._idx, c.max_size, c.keep
    if idx == size:  # temporal order (after a chunk): keep the first `keep` rows and the last ms - keep
        if size <= ms:
            return c.keys, c.values, size, size
        def cut(a: mx.array) -> mx.array:
            return mx.concatenate([a[..., :keep, :], a[..., size - (ms - keep):, :]], axis=2)

        return cut(c.keys), cut(c.values), ms, ms
    if c.offset < ms and idx == c.offset:  # growing one token at a time: the first `offset` rows are valid
        return c.keys, c.values, idx, idx
    if size == ms:  # rotated: stored as it is, write index and all
        return c.keys, c.values, ms, idx
    raise UnsupportedCacheError(f"a RotatingKVCache in a state this integration does not store "
                                f"(rows {size}, index {idx}, offset {c.offset}, max_size {ms})")


def rebuild(schema: tuple[Node, ...], layout: Layout, arrays: Parts, n: int) -> list[Any]:
    """A fresh prompt cache holding ``n`` tokens of restored state (``arrays``: the restored host parts)."""
    return [_build(str(i), node, layout, arrays, n) for i, node in enumerate(schema)]


def _dt(layout: Layout, name: str) -> str:
    spec = layout.fixed.get(name) or layout.rows[name]
    return spec.dtype


def _kv(a: np.ndarray, name: str) -> mx.array:
    """(n, heads, dim) host rows as a (1, heads, n, dim) array."""
    return mx.contiguous(from_numpy(a, name).transpose(1, 0, 2)[None])


def _build(p: str, node: Node, layout: Layout, arrays: Parts, n: int) -> Any:
    if node.kind == "kv":
        c = KVCache()
        c.keys, c.values = (_kv(arrays[f"{p}.{s}"][:n], _dt(layout, f"{p}.{s}")) for s in ("k", "v"))
        c.offset = n
        return c
    if node.kind == "qkv":
        group_size, bits, nk, nv = node.settings
        q = QuantizedKVCache(group_size=group_size, bits=bits)
        q.keys, q.values = (tuple(_kv(arrays[f"{p}.{s}{j}"][:n], _dt(layout, f"{p}.{s}{j}")) for j in range(m))
                            for s, m in (("k", nk), ("v", nv)))
        q.offset = n
        return q
    if node.kind == "rot":
        max_size, keep = node.settings
        r = RotatingKVCache(max_size=max_size, keep=keep)
        n_valid, idx = (int(x) for x in arrays[f"{p}.meta"])
        r.keys, r.values = (_kv(arrays[f"{p}.{s}"][:n_valid], _dt(layout, f"{p}.{s}")) for s in ("k", "v"))
        r.offset, r._idx = n, idx
        return r
    if node.kind == "arrays":
        a = ArraysCache(len(node.settings))
        for j, present in enumerate(node.settings):
            if present:
                a[j] = from_numpy(arrays[f"{p}.{j}"], _dt(layout, f"{p}.{j}"))
        return a
    return CacheList(*(_build(f"{p}.{j}", ch, layout, arrays, n) for j, ch in enumerate(node.children)))


def destinations(layout: Layout, n: int) -> Parts:
    """Empty host arrays a restore of ``n`` tokens into ``layout`` writes (row streams: ``n`` rows)."""
    out: Parts = {}
    for name, f in layout.fixed.items():
        out[name] = np.empty(f.shape, numpy_dtype(f.dtype))
    for name, r in layout.rows.items():
        out[name] = np.empty((n, *r.row_shape), numpy_dtype(r.dtype))
    return out
