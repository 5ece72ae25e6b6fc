"""Run inside .venv-vllm (scripts/vllm_venv.sh): build a tiny random Llama, or serve prompts with vLLM.

``python vllm_driver.py build DIR`` writes a 2-layer random Llama (head size 32, the smallest the
CPU attention backend takes) with a word-level tokenizer built locally: nothing is downloaded.

``python vllm_driver.py serve SPEC.json`` starts one vLLM (``LLM``), serves the prompts of the
spec one after another (greedy) and writes, per prompt, the output token ids,
``num_cached_tokens`` and the seconds the request took (with ``max_tokens=1``: the time to first
token) to the spec's ``out`` path as JSON, with the connector's counters. The spec says which
connector (``snapstore``, ``example`` or none), the prefix cache and chunked prefill settings.
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
    llm = LLM(model=spec["model"], dtype="float32", block_size=spec.get("block_size", 32),
              enable_prefix_caching=bool(spec.get("prefix_cache", False)), max_model_len=4096,
              kv_transfer_config=kv, seed=0, kv_cache_memory_bytes=int(spec.get("kv_mib", 64)) << 20,
              compilation_config={"mode": 0}, **kw)  # eager: starts faster, writes no compile cache
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 8)), ignore_eos=True)
    results = []
    for prompt in spec["prompts"]:  # one at a time: a later prompt finds what an earlier one saved
        t0 = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        results.append({"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": int(o.num_cached_tokens or 0),
                        "seconds": time.perf_counter() - t0})
    stats = _connector_stats()
    del llm
    with open(spec["out"], "w") as f:
        json.dump({"results": results, "stats": stats}, f)


def _connector_stats() -> Any:
    """The in-process connector's counters, when the connector module was loaded."""
    mod = sys.modules.get("snapstore.engine.vllm")
    return getattr(mod, "LAST_STATS", None) if mod is not None else None


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        serve(sys.argv[2])
