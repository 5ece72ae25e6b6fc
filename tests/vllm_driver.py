"""Run inside .venv-vllm (scripts/vllm_venv.sh): build a tiny random Llama, or serve prompts with vLLM.

``python vllm_driver.py build DIR`` writes a 2-layer random Llama (head size 32, the smallest the
CPU attention backend takes) with a word-level tokenizer built locally: nothing is downloaded.

``python vllm_driver.py build DIR --sliding-window N`` writes a tiny random Mistral whose layers
all attend within a window of N tokens; ``--gemma2 N`` / ``--gemma3 N`` a tiny Gemma 2 / Gemma 3
text model whose layers alternate a window of N tokens and full attention; ``--deepseek-v2`` /
``--deepseek-v3`` a tiny DeepSeek with MLA (the 576-wide latent the CPU MLA kernel takes).

``python vllm_driver.py serve SPEC.json`` starts one vLLM (``LLM``), serves the prompts of the
spec one after another (greedy) and writes, per prompt, the output token ids,
``num_cached_tokens`` and the seconds the request took (with ``max_tokens=1``: the time to first
token) and, for the snapstore connector, the microseconds its scheduler's lookup and its worker's load
took for that request, to the spec's ``out`` path as JSON, with the connector's counters and the
attention block size vLLM chose (``block_size``: a hybrid model's is raised to fit its state pages). The spec says which
connector (``snapstore``, ``example`` or none), the prefix cache and chunked prefill settings,
``hf_overrides``, ``idle_s`` (seconds the engine idles between prompts), ``tp`` (tensor parallel
size; the workers are other processes, so only the scheduler's counters come back); a prompt is a list of
token ids or ``{"tokens": [...], "salt": "..."}``.

``python vllm_driver.py keys OUT.json`` checks the connector's keys against vLLM's own classes
without a model: real ``Request`` objects (LoRA, multimodal items, ``cache_salt``, prompt
embeddings) hashed by vLLM's block hasher and keyed by the connector, and ``exact_layout`` on
real KV cache configs; the findings go to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

VOCAB = 512


def build(path: str) -> None:
    """The tiny model: random weights from a fixed seed, saved as safetensors, and its tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger logits: greedy choices far from ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(path)


def build_sliding(path: str, window: int) -> None:
    """A tiny random Mistral (same sizes as :func:`build`) with a sliding window on every layer."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    build(path)  # the tokenizer (and a Llama, replaced below)
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=window,
                        max_position_embeddings=4096, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    for f in os.listdir(path):
        if f.endswith((".safetensors", "config.json")) and "tokenizer" not in f:
            os.remove(os.path.join(path, f))
    MistralForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)


def _replace_model(path: str, model: Any) -> None:
    """Swap the Llama :func:`build` wrote for ``model`` (same tokenizer): its weights and config."""
    for f in os.listdir(path):
        if f.endswith((".safetensors", "config.json")) and "tokenizer" not in f:
            os.remove(os.path.join(path, f))
    model.save_pretrained(path, safe_serialization=True)


def build_mla(path: str, version: int) -> None:
    """A tiny random DeepSeek-V2 (``version`` 2) or V3 (3): MLA with the latent the CPU MLA kernel
    takes (``kv_lora_rank`` 512 + rope 64 = one 576-wide head per token), one dense layer and one
    4-expert MoE layer, and the same tokenizer."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    build(path)
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512,
                              q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
                              topk_group=1, max_position_embeddings=4096, tie_word_embeddings=False,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if version == 3:
        model: Any = DeepseekV3ForCausalLM(DeepseekV3Config(topk_method="noaux_tc", **kw))
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(topk_method="greedy", **kw))
    model = model.to(torch.float32)
    with torch.no_grad():  # larger logits: greedy choices far from ties
        model.lm_head.weight.mul_(8.0)
    _replace_model(path, model)


def build_gemma(path: str, version: int, window: int) -> None:
    """A tiny random Gemma 2 (``version`` 2) or Gemma 3 text model (3): layers alternate a sliding
    window of ``window`` tokens and full attention (two KV cache groups), and the same tokenizer."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    build(path)
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=window,
                              max_position_embeddings=4096, tie_word_embeddings=True,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model: Any = Gemma2ForCausalLM(Gemma2Config(**kw)) if version == 2 else \
        Gemma3ForCausalLM(Gemma3TextConfig(**kw))
    # unscaled: Gemma scales its (tied) embeddings itself; larger ones make the output ignore the context
    _replace_model(path, model.to(torch.float32))


def build_hybrid(path: str) -> None:
    """A tiny random Qwen3-Next (gated delta net layers 0-2, full attention layer 3, a 4-expert
    MoE), bfloat16 (the CPU gated-delta-net kernel needs it, with a linear-attention head dim of
    128), and the same tokenizer. vLLM raises its attention blocks to hold a state page: 544 tokens
    on some CPUs, 288 on others (the state's size depends on the CPU's kernels), unless pinned larger."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    build(path)  # the tokenizer (and a Llama, replaced below)
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_conv_kernel_dim=4,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                          linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64, max_position_embeddings=8192,
                          tie_word_embeddings=False, full_attention_interval=4,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    for f in os.listdir(path):
        if f.endswith((".safetensors", "config.json")) and "tokenizer" not in f:
            os.remove(os.path.join(path, f))
    model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # larger logits: greedy choices far from ties
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:  # a louder recurrent path: output depends on the state, not only K/V
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.out_proj.weight.mul_(16.0)
                layer.linear_attn.A_log.fill_(-6.0)  # slow decay: the state carries the whole prefix
    model.save_pretrained(path, safe_serialization=True)


def serve(spec_path: str) -> None:
    """Serve the spec's prompts in order with one vLLM; write the results."""
    with open(spec_path) as f:
        spec: dict[str, Any] = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec.get("connector") == "snapstore":
        kv = KVTransferConfig(kv_connector="SnapstoreConnector", kv_connector_module_path="snapstore.engine.vllm",
                              kv_role="kv_both", kv_connector_extra_config=spec.get("extra", {}))
    elif spec.get("connector") == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": spec["example_path"]})
    kw: dict[str, Any] = {}
    if spec.get("chunked"):
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=int(spec["chunked"]))
    if spec.get("hf_overrides"):
        kw["hf_overrides"] = spec["hf_overrides"]
    if spec.get("tp"):  # tensor parallel: spawned workers (the caller binds their threads: VLLM_CPU_OMP_THREADS_BIND)
        kw.update(tensor_parallel_size=int(spec["tp"]), distributed_executor_backend="mp")
    if spec.get("block_size", 32) is not None:  # None: vLLM's default
        kw["block_size"] = spec.get("block_size", 32)
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"),
              enable_prefix_caching=bool(spec.get("prefix_cache", False)), max_model_len=int(spec.get("max_len", 4096)),
              kv_transfer_config=kv, seed=0, kv_cache_memory_bytes=int(spec.get("kv_mib", 64)) << 20,
              compilation_config={"mode": 0}, **kw)  # eager: starts faster, writes no compile cache
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 8)), ignore_eos=True)
    results = []
    for i, prompt in enumerate(spec["prompts"]):  # one at a time: a later prompt finds what an earlier one saved
        if i and spec.get("idle_s"):  # the engine idles between requests, as a server does
            time.sleep(float(spec["idle_s"]))
        before = _connector_us()
        t0 = time.perf_counter()
        tp = TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else \
            TokensPrompt(prompt_token_ids=prompt["tokens"], cache_salt=prompt["salt"])
        o = llm.generate([tp], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        after = _connector_us()
        results.append({"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": int(o.num_cached_tokens or 0),
                        "seconds": seconds, **{k: after[k] - before[k] for k in after}})
    stats = _connector_stats()
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)  # what vLLM chose (hybrid: raised)
    del llm
    with open(spec["out"], "w") as f:
        json.dump({"results": results, "stats": stats, "block_size": block_size}, f)


def _connector_us() -> dict[str, int]:
    """The connector's time so far in its scheduler's lookups and its worker's loads (us): the
    difference across one prompt is that request's own (``lookup_us``, ``load_us``)."""
    stats = _connector_stats() or {}
    return {"lookup_us": int(stats.get("scheduler", {}).get("lookup_us", 0)),
            "load_us": int(stats.get("worker", {}).get("load_us", 0))}


def _connector_stats() -> Any:
    """The in-process connector's counters, when the connector module was loaded."""
    mod = sys.modules.get("snapstore.engine.vllm")
    return getattr(mod, "LAST_STATS", None) if mod is not None else None


def _requests(tmp: str) -> dict[str, Any]:
    """Real vLLM requests that differ in one input each (same 200 token ids)."""
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    adapters = {}
    for name, payload in (("a", b"adapter-a"), ("a2", b"adapter-a, retrained"), ("b", b"adapter-b")):
        d = os.path.join(tmp, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
            f.write(payload)
        adapters[name] = d
    ids = [4 + (i * 7) % 500 for i in range(200)]

    def mm(ident: str, offset: int, length: int = 40) -> Any:
        return MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                     mm_position=PlaceholderRange(offset=offset, length=length))

    def req(name: str, **kw: Any) -> Any:
        return Request(name, list(kw.pop("ids", ids)), SamplingParams(max_tokens=1), None, block_hasher=hasher, **kw)

    return {
        "plain": req("plain"),
        "lora_a": req("lora_a", lora_request=LoRARequest("a", 1, adapters["a"])),
        "lora_a_other_id": req("lora_a_other_id", lora_request=LoRARequest("a", 7, adapters["a"])),
        "lora_a_retrained": req("lora_a_retrained", lora_request=LoRARequest("a", 1, adapters["a2"])),
        "lora_b": req("lora_b", lora_request=LoRARequest("b", 2, adapters["b"])),
        "salt_t1": req("salt_t1", cache_salt="t1"),
        "salt_t2": req("salt_t2", cache_salt="t2"),
        "img_x_at_64": req("img_x_at_64", mm_features=[mm("x", 64)]),
        "img_y_at_64": req("img_y_at_64", mm_features=[mm("y", 64)]),
        "img_x_at_80": req("img_x_at_80", mm_features=[mm("x", 80)]),
        "img_x_y": req("img_x_y", mm_features=[mm("x", 64), mm("y", 150)]),
        "embeds": req("embeds", ids=[0] * 200, prompt_embeds=torch.zeros(200, 8)),
        "lora_remote": req("lora_remote", lora_request=LoRARequest("r", 3, "some-org/some-adapter")),
    }


def keys(out_path: str) -> None:
    """The connector's request keys against vLLM's block hashes, and exact_layout on real configs."""
    import tempfile

    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from snapstore.engine.vllm import exact_layout
    from snapstore.engine.vllm._key import request_key

    found: dict[str, Any] = {"declined": {}, "first_diff": {}, "violations": [], "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        reqs = _requests(tmp)
        keyed = {name: request_key(r) for name, r in reqs.items()}
    for name, k in keyed.items():
        found["declined"][name] = k.declined
    names = [n for n, k in keyed.items() if k.declined is None]
    for a in names:
        for b in names:
            ha, hb = reqs[a].block_hashes, reqs[b].block_hashes
            vllm_diff = next((j for j, (x, y) in enumerate(zip(ha, hb)) if x != y), None)
            ka, kb = keyed[a], keyed[b]
            ours = 0 if ka.namespace != kb.namespace else \
                next((i for i, (x, y) in enumerate(zip(ka.tokens, kb.tokens)) if x != y), None)
            found["first_diff"][f"{a}|{b}"] = [vllm_diff, ours]
            # where vLLM's block j differs, a prefix match must stop at or before block j's start + 16
            if vllm_diff is not None and (ours is None or ours > (vllm_diff + 1) * 16 - 1):
                found["violations"].append([a, b, vllm_diff, ours])

    def cfg(*groups: Any) -> Any:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))
    layouts = {"full": cfg(KVCacheGroupSpec(["l0", "l1"], full)),
               "sliding": cfg(KVCacheGroupSpec(["l0", "l1"], swa)),
               "hybrid": cfg(KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], swa)),
               "mamba": cfg(KVCacheGroupSpec(["l0", "l1"], mamba)),
               "none": None}
    mc = type("MC", (), {"use_mla": False})()
    for name, c in layouts.items():
        try:
            exact_layout(mc, c)
            found["layouts"][name] = None
        except Exception as e:  # the test reads the message
            found["layouts"][name] = f"{type(e).__name__}: {e}"
    with open(out_path, "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if sys.argv[1] == "build":
        if len(sys.argv) > 3 and sys.argv[3] == "--hybrid":
            build_hybrid(sys.argv[2])
        elif len(sys.argv) > 3 and sys.argv[3] in ("--deepseek-v2", "--deepseek-v3"):
            build_mla(sys.argv[2], int(sys.argv[3][-1]))
        elif len(sys.argv) > 4 and sys.argv[3] in ("--gemma2", "--gemma3"):
            build_gemma(sys.argv[2], int(sys.argv[3][-1]), int(sys.argv[4]))
        elif len(sys.argv) > 3 and sys.argv[3] == "--sliding-window":
            build_sliding(sys.argv[2], int(sys.argv[4]))
        else:
            build(sys.argv[2])
    elif sys.argv[1] == "keys":
        keys(sys.argv[2])
    else:
        serve(sys.argv[2])
