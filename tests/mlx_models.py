"""Tiny mlx_lm models built from configs at test time (random weights, seeded; no downloads)."""

from __future__ import annotations

from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256,
              "tie_word_embeddings": False},
    # sliding window 16 on 5 of every 6 layers: RotatingKVCache (prompts longer than the window rotate it)
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 256,
                    "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 3},
    # gated DeltaNet hybrid: ArraysCache (conv + recurrent state) and KVCache layers
    "qwen3_next": {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
                   "num_attention_heads": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
                   "rms_norm_eps": 1e-6, "vocab_size": 256, "num_key_value_heads": 2, "rope_theta": 10000.0,
                   "partial_rotary_factor": 0.25, "max_position_embeddings": 4096, "head_dim": 16,
                   "full_attention_interval": 2},
    # Mamba2 hybrid: every layer a CacheList(ArraysCache(conv, ssm), KVCache)
    "falcon_h1": {"model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                  "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_d_conv": 4,
                  "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_n_heads": 4,
                  "mamba_n_groups": 1, "mamba_chunk_size": 16, "vocab_size": 256},
}


def build(arch: str, *, seed: int = 0, dtype: str | None = None) -> Any:
    """The tiny model of ``arch`` with seeded random weights (``dtype``: e.g. "bfloat16")."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    model = mod.Model(mod.ModelArgs.from_dict(CONFIGS[arch]))
    mx.random.seed(seed)
    params = tree_flatten(model.parameters())
    new = []
    for name, p in params:
        v = mx.random.normal(p.shape, dtype=mx.float32) * 0.2
        if name.endswith("A_log"):
            v = mx.abs(v)
        new.append((name, v.astype(getattr(mx, dtype) if dtype else p.dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    model.eval()
    return model
