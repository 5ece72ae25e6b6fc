"""Prototype: snapshot / restore a transformers 5.x DynamicCache byte-exactly.

Self-contained (torch + transformers only).  Run:
    /work/hfvenv/bin/python proto.py              # all models, prints PASS/FAIL per model+case
    /work/hfvenv/bin/python proto.py lfm2 bamba   # a subset
    PROTO_DTYPE=bfloat16 /work/hfvenv/bin/python proto.py   # same checks in bf16

Test per model and (P, S) split:
  A (uninterrupted): prefill P tokens -> cache; feed S tokens; greedy-decode N tokens, one per forward.
  B (restored):      prefill P tokens -> cache; snapshot (clone + serialise to bytes in "parts" form);
                     build a fresh DynamicCache(config=...) from the bytes; feed the same S tokens; greedy-decode N.
  PASS iff every logits tensor of B is torch.equal to A's (and the decoded tokens match).
Also checked: the attention row stream at P is a bitwise prefix of the one at P+S+N (so rows can be appended),
in-place mutation of recurrent/conv tensors by forward, and a negative control (snapshot without clone).
"""
from __future__ import annotations

import os
import sys
import time
import logging

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache
from transformers import (LlamaConfig, MistralConfig, Qwen3NextConfig, BambaConfig, GraniteMoeHybridConfig,
                          FalconH1Config, Zamba2Config, Lfm2Config)
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer,
                                      LinearAttentionAndFullAttentionLayer, LinearAttentionCacheLayerMixin,
                                      CacheLayerMixin, DummyLayer)

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()  # hides the one-time "falling back to reference PyTorch kernel" notes

V = 256
DTYPE = getattr(torch, os.environ.get("PROTO_DTYPE", "float32"))

# Smallest configs that construct + run on CPU in a few ms (64 tokens).  All kernels fall back to pure torch.
CONFIGS = {
    "llama": lambda: LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=V),
    # extra: sliding-window attention layers (DynamicSlidingWindowLayer) - window smaller than the prompt
    "mistral_sliding": lambda: MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=V, sliding_window=8),
    # gated DeltaNet ("linear_attention") x3 + full attention x1 (full_attention_interval=4 default); MoE MLP
    "qwen3_next": lambda: Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=V, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    # Mamba2 layer 0 + attention layer 1
    "bamba": lambda: BambaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=V, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, mamba_n_groups=1),
    # layer_types accepts legacy "mamba"/"attention" (remapped to linear_attention/full_attention)
    "granitemoehybrid": lambda: GraniteMoeHybridConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=V, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64),
    # every layer is "hybrid": attention KV + Mamba2 conv/ssm state in ONE cache layer
    "falcon_h1": lambda: FalconH1Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=V, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16),
    # mamba, hybrid (shared transformer + mamba), mamba
    "zamba2": lambda: Zamba2Config(
        hidden_size=64, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, vocab_size=V, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, n_mamba_heads=4, chunk_size=16, adapter_rank=8, use_mem_rope=True),
    # short-conv layer (conv state only) + attention layer
    "lfm2": lambda: Lfm2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=V, layer_types=["conv", "full_attention"], conv_L_cache=3, block_auto_adjust_ff_dim=False),
}


def build(name: str):
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE).eval()
    return model


# ----------------------------------------------------------------------------------------------------------
# Snapshot format: list (one entry per cache layer) of dicts
#   {"cls": <layer class name>,
#    "meta": {scalar metadata},
#    "parts": {part_name: {"kind": "fixed"|"rows", "dtype": str, "shape": (...)  # stored shape
#                          "data": bytes}}}
# "rows" parts are stored token-axis-outermost: KV [B,H,T,D] -> [T,B,H,D]; row shape = (B,H,D).
# ----------------------------------------------------------------------------------------------------------

def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(b: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(shape)


def _part(kind: str, t: torch.Tensor) -> dict:
    return {"kind": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": tuple(t.shape), "data": _to_bytes(t)}


def _unpart(p: dict) -> torch.Tensor:
    return _from_bytes(p["data"], getattr(torch, p["dtype"]), p["shape"])


def snapshot(cache: DynamicCache) -> list[dict]:
    out = []
    for layer in cache.layers:
        parts, meta = {}, {}
        if isinstance(layer, DummyLayer):
            out.append({"cls": "DummyLayer", "meta": meta, "parts": parts})
            continue
        if isinstance(layer, CacheLayerMixin):  # DynamicLayer / DynamicSlidingWindowLayer / hybrid's attention half
            if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
                # [B, H, T, D] -> rows [T, B, H, D]
                parts["k"] = _part("rows", layer.keys.permute(2, 0, 1, 3))
                parts["v"] = _part("rows", layer.values.permute(2, 0, 1, 3))
            if isinstance(layer, DynamicSlidingWindowLayer):
                meta["cumulative_length"] = int(layer.cumulative_length)  # != rows once the window is full
                meta["sliding_window"] = int(layer.sliding_window)
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            assert not layer.record_past, "snapshot only in the normal (non-speculative) mode"
            meta["number_of_states"] = layer.number_of_states
            for i in range(layer.number_of_states):
                if not layer.has_previous_state[i]:
                    continue  # nothing seen yet (or after reset): restore leaves it uninitialised
                if layer.is_conv_states_initialized[i]:
                    parts[f"conv{i}"] = _part("fixed", layer.conv_states[i])  # [B, C, K]
                if layer.is_recurrent_states_initialized[i]:
                    parts[f"rec{i}"] = _part("fixed", layer.recurrent_states[i])  # mamba2 [B,H,Dh,N]; GDN [B,Hv,Dk,Dv]
        out.append({"cls": type(layer).__name__, "meta": meta, "parts": parts})
    return out


def restore(config, snap: list[dict]) -> DynamicCache:
    cache = DynamicCache(config=config)
    assert len(cache.layers) == len(snap), (len(cache.layers), len(snap))
    for idx, (layer, s) in enumerate(zip(cache.layers, snap)):
        assert type(layer).__name__ == s["cls"], (idx, type(layer).__name__, s["cls"])
        p = s["parts"]
        if "k" in p:
            k = _unpart(p["k"]).permute(1, 2, 0, 3)  # rows [T,B,H,D] -> [B,H,T,D] (a view; update() cats -> contiguous)
            v = _unpart(p["v"]).permute(1, 2, 0, 3)
            # Dispatches to DynamicLayer.update (also for the hybrid class): lazy init + cat.
            layer.update(k, v)
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = s["meta"]["cumulative_length"]  # update() set it to rows count
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for i in range(layer.number_of_states):
                if f"conv{i}" in p:
                    conv = _unpart(p[f"conv{i}"])
                    # fresh layer: lazy-init zeros [..., K], has_previous_state False -> copy_ whole state, flag -> True
                    layer.update_conv_state(conv, state_idx=i, conv_kernel_size=conv.shape[-1])
                if f"rec{i}" in p:
                    layer.update_recurrent_state(_unpart(p[f"rec{i}"]), state_idx=i)  # zeros_like + copy_
                if f"conv{i}" in p or f"rec{i}" in p:
                    layer.has_previous_state[i] = True  # (update_conv_state already set it; rec-only layers need it)
    return cache


# ----------------------------------------------------------------------------------------------------------

@torch.no_grad()
def continue_run(model, cache, s_ids, n_decode):
    """Feed S tokens in one forward, then greedy decode n tokens one at a time. Returns list of logits, tokens."""
    logits, toks = [], []
    out = model(s_ids, past_key_values=cache, use_cache=True)
    logits.append(out.logits.clone())
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(n_decode):
        toks.append(nxt)
        out = model(nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits.clone())
        nxt = out.logits[:, -1:].argmax(-1)
    return logits, torch.cat(toks, 1) if toks else None


def rows_of(snap):
    return [(_unpart(s["parts"]["k"]), _unpart(s["parts"]["v"])) if "k" in s["parts"] else None for s in snap]


@torch.no_grad()
def check(name, model, P, S, N=4, B=1):
    g = torch.Generator().manual_seed(1000 + P * 31 + S)
    ids = torch.randint(0, V, (B, P + S), generator=g)
    p_ids, s_ids = ids[:, :P], ids[:, P:]

    # --- A: uninterrupted (with a snapshot taken in the middle, which must not disturb it)
    cache_a = model(p_ids, use_cache=True).past_key_values
    snap = snapshot(cache_a)
    # references (no clone) for the in-place-mutation probe and the negative control
    refs = [{k: getattr(l, k) for k in ("conv_states", "recurrent_states") if hasattr(l, k)} for l in cache_a.layers]
    refs = [{k: dict(d) for k, d in r.items()} for r in refs]
    before = [{k: {i: (t.clone() if t is not None else None) for i, t in d.items()} for k, d in r.items()} for r in refs]
    logits_a, toks_a = continue_run(model, cache_a, s_ids, N)

    # in-place probe: same tensor object still in the cache, and its contents changed?
    inplace = []
    for l, r, b in zip(cache_a.layers, refs, before):
        for k, d in r.items():
            for i, t in d.items():
                if t is None:
                    continue
                same_obj = getattr(l, k)[i] is t
                changed = not torch.equal(t, b[k][i])
                inplace.append(f"{k[:4]}{i}:{'same-obj' if same_obj else 'new-obj'}/{'mutated' if changed else 'unchanged'}")

    # --- B: restore from bytes into a fresh cache built from config
    cache_b = restore(model.config, snap)
    logits_b, toks_b = continue_run(model, cache_b, s_ids, N)
    ok = len(logits_a) == len(logits_b) and all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))
    ok = ok and (toks_a is None or torch.equal(toks_a, toks_b))

    # rows prefix property: rows at P are a prefix of rows at P+S+N (not for sliding layers past the window)
    prefix_ok = True
    for rs0, rs1, l in zip(rows_of(snap), rows_of(snapshot(cache_a)), cache_a.layers):
        if rs0 is None or isinstance(l, DynamicSlidingWindowLayer):
            continue
        prefix_ok &= torch.equal(rs1[0][:P], rs0[0]) and torch.equal(rs1[1][:P], rs0[1])

    # seq length bookkeeping after restore
    seq_ok = cache_b.get_seq_length() == P + S + N

    # negative control: restore from the *uncloned* references (mutated by run A) -> must differ if any state mutated
    neg = None
    if any(r for r in refs):
        bad = [dict(s, parts=dict(s["parts"])) for s in snap]
        for s, r in zip(bad, refs):
            for k, d in r.items():
                for i, t in d.items():
                    key = ("conv" if k == "conv_states" else "rec") + str(i)
                    if t is not None and key in s["parts"]:
                        s["parts"][key] = _part("fixed", t)
        lb, _ = continue_run(model, restore(model.config, bad), s_ids, N)
        neg = "differs(expected)" if not all(torch.equal(x, y) for x, y in zip(logits_a, lb)) else "SAME(?)"

    return ok and prefix_ok and seq_ok, dict(prefix=prefix_ok, seq=seq_ok, inplace=sorted(set(inplace)), neg=neg)


def describe(cache):
    rows = []
    for i, l in enumerate(cache.layers):
        d = [type(l).__name__]
        if isinstance(l, CacheLayerMixin) and l.keys is not None:
            d.append(f"keys{tuple(l.keys.shape)} values{tuple(l.values.shape)} {l.keys.dtype}")
        if isinstance(l, DynamicSlidingWindowLayer):
            d.append(f"cumulative_length={l.cumulative_length} window={l.sliding_window}")
        if isinstance(l, LinearAttentionCacheLayerMixin):
            for j in range(l.number_of_states):
                c, r = l.conv_states[j], l.recurrent_states[j]
                d.append(f"conv{j}{tuple(c.shape) if c is not None else None}"
                         f"{'' if c is None else ' ' + str(c.dtype)[6:]} "
                         f"rec{j}{tuple(r.shape) if r is not None else None}"
                         f"{'' if r is None else ' ' + str(r.dtype)[6:]}")
        rows.append(f"    [{i}] " + " ".join(d))
    return "\n".join(rows)


def main(names):
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  dtype {DTYPE}")
    all_ok = True
    for name in names:
        t0 = time.time()
        model = build(name)
        with torch.no_grad():
            t1 = time.time()
            c = model(torch.randint(0, V, (1, 64)), use_cache=True).past_key_values
            fwd = time.time() - t1
        print(f"== {name}: {type(model).__name__} layer_types={getattr(model.config, 'layer_types', None)} "
              f"build {t1 - t0:.2f}s fwd64 {fwd * 1000:.1f}ms")
        print(describe(c))
        # P=1 and P=2 are below the conv kernel (state zero-padded); 37 > chunk size 16 (multi-chunk SSD scan)
        for (P, S, B) in [(1, 1, 1), (2, 3, 1), (37, 1, 1), (37, 5, 1), (64, 7, 1), (20, 4, 2)]:
            ok, info = check(name, model, P, S, B=B)
            all_ok &= ok
            print(f"  {'PASS' if ok else 'FAIL'} {name} P={P} S={S} B={B} {info}")
    print("ALL PASS" if all_ok else "SOME FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(CONFIGS)))
