"""A hybrid model's KV cache groups as snapstore parts: which groups, what is stored, the alignment
(no vLLM import: the specs are read by their class names and fields, so this runs in any venv).

vLLM's hybrid memory allocator gives each *KV cache group* (layers that share one block table) its
own block ids. The connector stores, per group:

- a **full-attention** group: a row stream ``g<i>.kv``, one row per block holding that block of
  every layer of the group (opaque bytes, as the single-group path);
- a **sliding-window** group (``SlidingWindowSpec``: vLLM frees the blocks that leave the window
  during a request, and a restore at a boundary needs only the blocks inside the window there): a
  fixed part ``g<i>.win``, the last ``window_blocks`` blocks of every layer of the group *below the
  snapshot's boundary* — what vLLM's own prefix cache keeps for a hit there — so, like a state,
  valid only at its boundary (the store matches such a layout at exact saved boundaries);
- a **Mamba** group (``MambaSpec``: conv + SSM / gated-delta-net state, one fixed-size page per
  block): a fixed part ``g<i>.state``, the page of every layer of the group *at the snapshot's
  boundary*. A recurrent state is valid only where it was captured, so a snapshot holds exactly
  one state page per layer, and the store matches such a layout at exact saved boundaries only.

A draft (EAGLE / MTP) group is saved and restored with the target as the ``draft`` component.
Accepted: every group full attention, sliding window or Mamba in vLLM's ``align`` cache mode (prefix caching on:
vLLM then keeps the state at block boundaries, in the block that ends there), one block size for
all groups, no speculative state blocks. A model without attention (Mamba2) stores the states
alone. Everything else raises ``ss.LayoutError`` naming the
group. :func:`describe_groups` is the group layout for the identity: spec kinds, block sizes,
dtypes, shapes and page sizes, so a store never serves one layout's pages to another.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import snapstore as ss

__all__ = ["GroupPart", "HybridLayout", "describe_groups", "hybrid_layout", "state_block_index"]

_ATTN = ("FullAttentionSpec",)
_WINDOW = ("SlidingWindowSpec",)
_STATE = ("MambaSpec",)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        raise ss.LayoutError(f"cannot tell the element size of dtype {dtype!r}")
    return int(size)


@dataclass(frozen=True)
class GroupPart:
    """One KV cache group as one store part."""

    group: int  # vLLM's group index: the position in ``get_block_ids()``
    kind: str  # "attn" (a row stream of blocks), "window" (a fixed part: the window's blocks below the
    # boundary) or "state" (a fixed part: the page at the boundary)
    layers: tuple[str, ...]  # the group's layer names, in vLLM's order
    unit_bytes: int  # bytes of one layer's block (attn, window) or one layer's state page, padding excluded
    draft: bool  # an EAGLE / MTP group: the "draft" component
    window_blocks: int = 0  # "window": the blocks a restore at a boundary needs (the window's, below it)

    @property
    def name(self) -> str:
        """The store part name: ``g<i>.kv``, ``g<i>.win`` or ``g<i>.state``."""
        return f"g{self.group}.{ {'attn': 'kv', 'window': 'win'}.get(self.kind, 'state')}"

    def spec(self) -> ss.Rows | ss.Fixed:
        """The part's layout entry: ``(layers, unit_bytes)`` opaque bytes (a window: ``window_blocks`` of them)."""
        shape = (len(self.layers), self.unit_bytes)
        component = "draft" if self.draft else None
        if self.kind == "attn":
            return ss.Rows("uint8", shape, component=component)
        if self.kind == "window":
            return ss.Fixed("uint8", (self.window_blocks, *shape), component=component)
        return ss.Fixed("uint8", shape, component=component)

    def blocks_at(self, ids: Sequence[int], boundary: int, block_size: int) -> list[int]:
        """The ids (of the request's block list ``ids`` in this group) of the blocks a snapshot at
        ``boundary`` holds: every block below it (attn), the window's blocks below it (window),
        the block that ends there (state). ``IndexError`` when the list is too short for it."""
        n = boundary // block_size
        if self.kind == "attn":
            out = [int(b) for b in ids[:n]]
        elif self.kind == "window":
            out = [int(b) for b in ids[max(0, n - self.window_blocks):n]]
            if len(out) != self.window_blocks:
                raise IndexError(f"{len(out)} window blocks below token {boundary}, not {self.window_blocks}")
            return out
        else:
            return [int(ids[state_block_index(boundary, block_size)])]
        if len(out) != n:
            raise IndexError(f"{len(out)} blocks below token {boundary}, not {n}")
        return out


@dataclass(frozen=True)
class HybridLayout:
    """The parts of a multi-group cache, its block size and the alignment of every hit."""

    parts: tuple[GroupPart, ...]
    block_size: int  # tokens per block, the same in every group
    alignment: int  # a stored boundary (and so a hit) is a multiple of this

    def layout(self) -> ss.Layout:
        """Row streams for attention groups, fixed parts for window and state groups (exact boundaries)."""
        return ss.Layout(fixed={p.name: p.spec() for p in self.parts if p.kind != "attn"},  # type: ignore[misc]
                         rows={p.name: p.spec() for p in self.parts if p.kind == "attn"})  # type: ignore[misc]

    @property
    def main(self) -> int:
        """The index (in ``parts``) of the part whose blocks name a load or save in logs and
        checks: the target's first attention group, else its first sliding-window group, else
        the first group (a pure Mamba model)."""
        for kind in ("attn", "window"):
            found = next((i for i, p in enumerate(self.parts) if p.kind == kind and not p.draft), None)
            if found is not None:
                return found
        return 0

    @property
    def has_state(self) -> bool:
        """Whether a group keeps a recurrent state: vLLM holds one only where a chunk ends, so
        saves are planned there; without one, any block boundary of a step can be saved."""
        return any(p.kind == "state" for p in self.parts)

    @property
    def min_boundary(self) -> int:
        """The shortest boundary a snapshot can have: a window part holds ``window_blocks`` whole blocks."""
        return max((p.window_blocks for p in self.parts if p.kind == "window"), default=1) * self.block_size

    def rows(self, n_tokens: int) -> dict[str, int]:
        """Rows per stream of a snapshot at ``n_tokens`` (an aligned boundary)."""
        return {p.name: n_tokens // self.block_size for p in self.parts if p.kind == "attn"}

    def boundary(self, n_tokens: int) -> int:
        """The last stored boundary at or below ``n_tokens``: rounded down to the alignment."""
        return max(0, n_tokens) // self.alignment * self.alignment


def state_block_index(boundary: int, block_size: int) -> int:
    """Where vLLM (align mode) keeps the state after ``boundary`` tokens in a request's block list
    of a Mamba group: the block that ends there, index ``boundary // block_size - 1``. A hit of
    ``boundary`` tokens is restored into that block; a save at ``boundary`` copies it."""
    if boundary <= 0 or boundary % block_size:
        raise ss.InvalidInputError(f"a state boundary must be a positive multiple of {block_size}, got {boundary}")
    return boundary // block_size - 1


def _spec_desc(spec: Any) -> dict[str, Any]:
    """The fields of a spec that change its pages' bytes, for the identity."""
    kind = type(spec).__name__
    out: dict[str, Any] = {"kind": kind, "block_size": int(spec.block_size),
                           "page_size": int(getattr(spec, "page_size_bytes", 0) or 0)}
    if kind in _STATE:
        out.update(shapes=[list(map(int, s)) for s in spec.shapes], dtypes=[_dtype_name(d) for d in spec.dtypes],
                   mamba_type=str(getattr(spec, "mamba_type", "")), cache_mode=str(spec.mamba_cache_mode),
                   spec_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0))
    else:
        for name in ("num_kv_heads", "head_size", "head_size_v", "sliding_window", "attention_chunk_size",
                     "extra_retained_tokens"):
            if getattr(spec, name, None) is not None:
                out[name] = int(getattr(spec, name))
        out["dtype"] = _dtype_name(getattr(spec, "dtype", None))
    return out


def describe_groups(kv_cache_config: Any) -> str:
    """Canonical JSON of the group layout (each group: spec kind, block size, dtypes, shapes, page
    size, layer count, draft flag): a field of the identity."""
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        groups.append({"layers": len(g.layer_names), "draft": bool(getattr(g, "is_eagle_group", False)),
                       **_spec_desc(g.kv_cache_spec)})
    return json.dumps(groups, sort_keys=True, separators=(",", ":"))


def _spec_name(spec: Any) -> str:
    window = getattr(spec, "sliding_window", None)
    return type(spec).__name__ + (f" (sliding window {window})" if window is not None else "")


def _group_part(i: int, g: Any) -> GroupPart:
    spec = g.kv_cache_spec
    kind = type(spec).__name__
    layers = tuple(g.layer_names)
    draft = bool(getattr(g, "is_eagle_group", False))
    where = f"KV cache group {i} ({len(layers)} layer(s), e.g. {layers[0] if layers else '-'})"
    if kind in _ATTN or kind in _WINDOW:
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            raise ss.LayoutError(f"{where} has value heads of another size than its keys: not supported")
        unit = 2 * int(spec.block_size) * int(spec.num_kv_heads) * int(spec.head_size) * _itemsize(spec.dtype)
        if kind in _ATTN:
            return GroupPart(i, "attn", layers, unit, draft)
        # vLLM skips the tokens before (H - window + 1 - extra_retained) for the token after H: the
        # blocks from there to H are what a hit at H needs (SlidingWindowManager.get_num_skipped_tokens)
        keep = int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return GroupPart(i, "window", layers, unit, draft, max(1, -(-keep // int(spec.block_size))))
    if kind in _STATE:
        if spec.mamba_cache_mode != "align":
            raise ss.LayoutError(
                f"{where} is a MambaSpec in vLLM's {spec.mamba_cache_mode!r} cache mode: vLLM keeps a recurrent "
                "state at block boundaries only in 'align' mode — enable prefix caching (enable_prefix_caching=True)")
        if int(getattr(spec, "num_speculative_blocks", 0) or 0):
            raise ss.LayoutError(f"{where} keeps {spec.num_speculative_blocks} speculative state block(s) (MTP/EAGLE "
                                 "on a recurrent model): the connector cannot tell which block holds a boundary's "
                                 "state, so it is not supported")
        unit = sum(math.prod(int(d) for d in s) * _itemsize(t) for s, t in zip(spec.shapes, spec.dtypes))
        return GroupPart(i, "state", layers, unit, draft)
    raise ss.LayoutError(f"{where} is {_spec_name(spec)}: vLLM frees or reuses its blocks during a request, so the "
                         "connector cannot save it exactly; supported: full attention, sliding window and Mamba "
                         "(align mode) groups")


def hybrid_layout(kv_cache_config: Any, *, use_mla: bool = False) -> HybridLayout:
    """The parts of a cache with more than one KV cache group (or a Mamba one), or
    ``ss.LayoutError`` naming the group the connector cannot save exactly."""
    if use_mla:
        raise ss.LayoutError("the model uses MLA: only full-attention and Mamba caches are supported")
    groups: Sequence[Any] = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if not groups:
        raise ss.LayoutError("vLLM gave the connector no KV cache groups: the connector cannot check that it can "
                             "save the cache exactly")
    parts = tuple(_group_part(i, g) for i, g in enumerate(groups))
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(sizes) != 1:
        raise ss.LayoutError(f"KV cache groups with block sizes {sorted(sizes)}: the connector needs one block size "
                             "for every group (vLLM aligns them when prefix caching is on)")
    bs = sizes.pop()
    align = bs
    for g in groups:  # vLLM may checkpoint recurrent states at a coarser alignment than the block
        extra = getattr(g.kv_cache_spec, "prefill_checkpoint_alignment", None)
        if extra:
            align = math.lcm(align, int(extra))
    return HybridLayout(parts, bs, align)
