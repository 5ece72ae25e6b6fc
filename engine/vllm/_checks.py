"""Which KV caches the connector saves exactly, and the kernel facts of the identity: the single
full-attention (or MLA latent) group check, the hybrid plan of several groups, the backend and K/V dtype."""

from __future__ import annotations

from typing import Any

import torch

import snapstore as ss

from ._blocks import BlockGeometry
from ._groups import HybridLayout, hybrid_layout

__all__ = ["attn_backend", "exact_layout", "hybrid_geometry", "kv_dtype", "plan_groups", "single_geometry",
           "spec_name"]


def attn_backend(vllm_config: Any, geo: BlockGeometry) -> str:
    """The attention backend and kernel variant that pack a block's bytes (MLA on a CPU: the
    backend vLLM's CPU platform picks, ``CPU_MLA`` or ``AMX_MLA``, by the same rule)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and geo.latent:
        chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        amx = current_platform.get_cpu_architecture().name == "X86" and bool(torch.cpu._is_amx_tile_supported())
        return "AMX_MLA" if amx and getattr(chosen, "name", None) != "CPU_MLA" else "CPU_MLA"
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache = vllm_config.cache_config.cache_dtype
        return f"CPU_ATTN:{_get_attn_isa(geo.dtype, geo.block_size, geo.entry // 2, cache)}"
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return f"{current_platform.device_name}:{chosen or 'auto'}"


def kv_dtype(vllm_config: Any) -> torch.dtype:
    cache = vllm_config.cache_config.cache_dtype
    if cache in (None, "auto"):
        dtype: torch.dtype = vllm_config.model_config.dtype
        return dtype
    return {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cache, torch.uint8)


def spec_name(spec: Any) -> str:
    window = getattr(spec, "sliding_window", None)
    return f"{type(spec).__name__}" + (f" (sliding window {window})" if window is not None else "")


def _plain_latent(spec: Any) -> bool:
    """An ``MLAAttentionSpec`` of DeepSeek V2/V3's kind: one latent vector per token, no
    padding or compression (DeepSeek V4's sparse / aligned caches are not)."""
    return (type(spec).__name__ == "MLAAttentionSpec" and getattr(spec, "alignment", None) is None
            and getattr(spec, "model_version", None) is None
            and getattr(spec, "cache_dtype_str", None) in (None, "auto"))


def exact_layout(model_config: Any, kv_cache_config: Any) -> None:
    """Accept only caches the connector saves exactly: one KV cache group of full attention (or
    of MLA latents, where every layer of the group is ``MLAAttentionSpec`` and the model uses
    MLA), where vLLM keeps every block of a request until it finishes. ``ss.LayoutError``
    naming the group otherwise: a sliding-window (or chunked-local, Mamba…) group frees or
    overwrites blocks that leave the window while the connector saves the block ids it planned with."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    mla = bool(getattr(model_config, "use_mla", False))
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        raise ss.LayoutError("vLLM gave the connector no KV cache config: the connector cannot check that it "
                             "can save the cache exactly")
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        specs = dict(spec.kv_cache_specs) if isinstance(spec, UniformTypeKVCacheSpecs) else \
            {name: spec for name in g.layer_names}
        bad = {name: s for name, s in specs.items() if not (_plain_latent(s) if mla else type(s) is FullAttentionSpec)}
        if bad:
            name, s = next(iter(bad.items()))
            raise ss.LayoutError(
                f"KV cache group {i} ({len(g.layer_names)} layer(s), e.g. {name}) is {spec_name(s)}: vLLM frees or "
                "reuses its blocks during a request, so the connector cannot save it exactly; only models whose "
                "layers all use full attention (one KV cache group) are supported")
    if len(groups) != 1:
        raise ss.LayoutError(f"{len(groups)} KV cache groups ({', '.join(spec_name(g.kv_cache_spec) for g in groups)})"
                             ": only models with one full-attention KV cache group are supported")


def single_geometry(vllm_config: Any, block_size: int) -> tuple[BlockGeometry, dict[str, str]]:
    """The block geometry of a one-group cache and the identity keys it adds: full attention's
    ``[kv_heads, block_size, 2 * head_size]`` blocks, or MLA's ``[block_size, latent]`` (one
    latent per token, keyed by its layout: ``kv_lora_rank`` and the rope dim)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layers, dtype = int(mc.get_num_layers(pc)), kv_dtype(vllm_config)
    if not getattr(mc, "use_mla", False):
        return BlockGeometry(layers=layers, kv_heads=int(mc.get_num_kv_heads(pc)), block_size=block_size,
                             entry=2 * int(mc.get_head_size()), dtype=dtype), {}
    hf = mc.hf_text_config
    rank, rope = int(hf.kv_lora_rank), int(hf.qk_rope_head_dim)
    geo = BlockGeometry(layers=layers, kv_heads=1, block_size=block_size, entry=rank + rope, dtype=dtype, latent=True)
    return geo, {"mla_latent": f"kv_lora_rank={rank},rope={rope}"}


def plan_groups(model_config: Any, kv_cache_config: Any) -> HybridLayout | None:
    """None for a cache of one full-attention group (the single-group path, :func:`exact_layout`);
    the hybrid parts for several groups or a Mamba group; ``ss.LayoutError`` for what neither
    saves exactly."""
    try:
        exact_layout(model_config, kv_cache_config)
        return None
    except ss.LayoutError:
        if getattr(kv_cache_config, "kv_cache_groups", None) is None:
            raise
    return hybrid_layout(kv_cache_config, use_mla=bool(getattr(model_config, "use_mla", False)))


def hybrid_geometry(hy: HybridLayout, kv_cache_config: Any) -> BlockGeometry:
    """The target's first attention group as a block geometry (the identity's kernel fields)."""
    part = hy.parts[hy.main]
    spec = kv_cache_config.kv_cache_groups[part.group].kv_cache_spec
    if part.kind == "state":  # a model without attention: no kernel packs its blocks
        return BlockGeometry(layers=len(part.layers), kv_heads=0, block_size=hy.block_size, entry=0,
                             dtype=spec.dtypes[0])
    return BlockGeometry(layers=len(part.layers), kv_heads=int(spec.num_kv_heads), block_size=hy.block_size,
                         entry=2 * int(spec.head_size), dtype=spec.dtype)
