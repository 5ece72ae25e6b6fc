"""Tiny mlx_lm models built from configs at test time (random weights, seeded; no downloads)."""

from __future__ import annotations

from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    # head_dim 32: a multiple of the smallest KV quantization group mlx supports (32)
    "llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
              "vocab_size": 256, "tie_word_embeddings": False},
    # sliding window 8 on 2 of every 3 layers: RotatingKVCache (prompts longer than the window rotate it)
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 256,
                    "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 3},
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


SYSTEM = list(range(7, 31))                       # 24 tokens every conversation starts with
PROMPT_A = SYSTEM + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]    # 37 tokens
PROMPT_B = SYSTEM + [90, 91, 92, 93, 94, 95, 96, 97, 98]                    # 33 tokens
PROMPT_A2 = PROMPT_A + [60, 61, 62, 63, 64]                                 # A's next turn
BOUNDARY = 16

# name -> (arch, dtype, generate_step kwargs, extra cache_prefix positions for prompt A)
CASES: dict[str, tuple[str, str | None, dict[str, Any], list[int]]] = {
    "llama": ("llama", None, {}, []),
    "llama_bf16": ("llama", "bfloat16", {}, []),
    # a small prefill step: the pieces are read in several chunks, as mlx_lm reads them
    "llama_step5": ("llama", None, {"prefill_step_size": 5}, []),
    "llama_kv8": ("llama", None, {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}, []),
    # quantized from token 20 on: snapshots at 16 hold a KVCache, those from 24 on a QuantizedKVCache
    "llama_kv4_from20": ("llama", None, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 20}, []),
    # one-token pieces at 1, 2 (a growing window) and 35 (a rotated window: one step after a full one)
    "gemma3": ("gemma3_text", None, {}, [1, 2, 35]),
    "gemma3_bf16": ("gemma3_text", "bfloat16", {}, []),
    "qwen3_next": ("qwen3_next", None, {}, []),
    "falcon_h1_bf16": ("falcon_h1", "bfloat16", {}, []),  # (qwen3_next's MoE gather runs float32 only on CPU)
    "falcon_h1": ("falcon_h1", None, {}, []),
}

# (call name, prompt, cache_prefix, session): process 1 runs "a"; process 2 (a restart) runs the rest
CALLS_1 = [("a", PROMPT_A, [len(SYSTEM)], "conv-a")]
CALLS_2 = [("b", PROMPT_B, [len(SYSTEM)], "conv-b"), ("a_again", PROMPT_A, [len(SYSTEM)], "conv-a"),
           ("a2", PROMPT_A2, [len(SYSTEM), len(PROMPT_A) - 1], "conv-a")]


def reference(model: Any, prompt: list[int], cuts: list[int], kw: dict[str, Any], max_tokens: int) -> list[Any]:
    """mlx_lm's uncached run with the same split: plain model calls read the prompt up to each cut in
    generate_step's chunks (quantizing as it does), then mlx_lm.generate_step reads the rest and decodes."""
    import importlib

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    g = importlib.import_module("mlx_lm.generate")
    ids = mx.array(prompt)
    step = kw.get("prefill_step_size", 2048)
    cache = make_prompt_cache(model)
    pos = 0
    for c in cuts:
        for s in range(pos, c, step):
            model(ids[s:min(s + step, c)][None], cache=cache)
            g.maybe_quantize_kv_cache(cache, kw.get("quantized_kv_start", 5000), kw.get("kv_group_size", 64),
                                      kw.get("kv_bits"))
            mx.eval([x.state for x in cache])
        pos = c
    return list(g.generate_step(ids[pos:], model, prompt_cache=cache, max_tokens=max_tokens, **kw))


def split(prompt: list[int], cache_prefix: list[int], extra: list[int]) -> list[int]:
    """The cuts PrefixCache reads ``prompt`` at (boundary multiples and cache_prefix positions below the end)."""
    n = len(prompt)
    return sorted({*range(BOUNDARY, n, BOUNDARY), *(p for p in [*cache_prefix, *extra] if p < n)})


def tokenizer() -> Any:
    """A word-level tokenizer over the tiny vocabulary ("w0" ... "w255"; id 1 is "<eos>"), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256)}
    vocab["<eos>"] = vocab.pop("w1")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")


# speculative decoding: (call name, prompt, cache_prefix, speculative?) per process; B is first read by a
# plain call (prefill step 512, as speculative decoding's default) so its snapshots have no draft component
SPEC_KW: dict[str, Any] = {"num_draft_tokens": 3, "prefill_step_size": 512}
SPEC_CALLS_1 = [("a", PROMPT_A, [len(SYSTEM)], True), ("b_plain", PROMPT_B, [len(SYSTEM)], False)]
SPEC_CALLS_2 = [("a_again", PROMPT_A, [len(SYSTEM)], True), ("b", PROMPT_B, [len(SYSTEM)], True),
                ("a2", PROMPT_A2, [len(SYSTEM), len(PROMPT_A) - 1], True)]


def draft_pair() -> tuple[Any, Any]:
    """A tiny target and a draft that agrees with it often (the same weights, perturbed a little)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    target, draft = build("llama", seed=0), build("llama", seed=0)
    mx.random.seed(1)
    noisy = [(k, v + 0.01 * mx.random.normal(v.shape)) for k, v in tree_flatten(draft.parameters())]
    draft.update(tree_unflatten(noisy))
    mx.eval(draft.parameters())
    return target, draft


def spec_reference(target: Any, draft: Any, prompt: list[int], cuts: list[int], max_tokens: int) -> list[Any]:
    """mlx_lm's own speculative decoding with the same split: both caches read up to each cut in the
    prefill step's chunks, then mlx_lm.speculative_generate_step reads the rest and decodes."""
    import importlib

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    g = importlib.import_module("mlx_lm.generate")
    ids, step = mx.array(prompt), SPEC_KW["prefill_step_size"]
    tc, dc = make_prompt_cache(target), make_prompt_cache(draft)
    pos = 0
    for c in cuts:
        for m, cache in ((draft, dc), (target, tc)):
            for s in range(pos, c, step):
                m(ids[s:min(s + step, c)][None], cache=cache)
                mx.eval([x.state for x in cache])
        pos = c
    return list(g.speculative_generate_step(ids[pos:], target, draft, prompt_cache=tc + dc, max_tokens=max_tokens,
                                            **SPEC_KW))


CHAT_TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                 "{% if add_generation_prompt %}w4{% endif %}")


def write_model_dir(arch: str, path: Any, *, seed: int = 0, with_tokenizer: bool = False) -> Any:
    """Write the tiny model of ``arch`` as an mlx_lm model directory (config.json, model.safetensors; with
    ``with_tokenizer`` the word-level tokenizer and a chat template, for mlx_lm.server). Returns the model."""
    import json
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    model = build(arch, seed=seed)
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(CONFIGS[arch]))
    if with_tokenizer:
        tok = tokenizer()
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(str(d))
    return model
