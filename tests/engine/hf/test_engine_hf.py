"""The proof on real transformers models: save in one process, restore in a NEW process, continue.

Per model (randomly initialised from a tiny config, no downloads): prompt A is prefilled to
boundary b1 (saved: the root), then to boundary P (saved: a delta over the root); the
uninterrupted run feeds S more tokens and decodes N. A child process (sys.executable) opens the
store, matches A, restores root+delta, feeds the same S tokens and decodes: every logits tensor and
greedy token is byte-identical, and the SHA-256 of every state part is equal cold vs restored.
Prompt B shares only the first b1 tokens with A: it matches the root (the branch) and continues
exactly as a run that prefilled b1 tokens. One child process serves every model (torch +
transformers import once).

Run as a script (``python tests/engine/hf/test_engine_hf.py child <dir> <device> <models...>``) it is the child.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import snapstore as ss  # noqa: E402
from snapstore.engine import TensorSource, hf  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # transformers models built at test time: the slow tier

V = 256
THREADS = 1
P, B1, S, S2, N = 24, 11, 5, 6, 3  # boundaries b1 < P; S tokens after P; prompt B adds S2 after b1; N decodes


def _configs() -> dict[str, Any]:
    from transformers import (
        BambaConfig,
        FalconH1Config,
        GraniteMoeHybridConfig,
        Lfm2Config,
        LlamaConfig,
        MistralConfig,
        Qwen3NextConfig,
        Zamba2Config,
    )

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=V)
    mamba = dict(mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)
    return {
        "llama": lambda: LlamaConfig(**base, num_hidden_layers=2),
        "mistral_sliding": lambda: MistralConfig(**base, num_hidden_layers=2, sliding_window=8),
        "qwen3_next": lambda: Qwen3NextConfig(
            **base, num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "bamba": lambda: BambaConfig(**base, **mamba, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_groups=1),
        "granitemoehybrid": lambda: GraniteMoeHybridConfig(
            **base, **mamba, num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=64),
        "falcon_h1": lambda: FalconH1Config(**base, **mamba, num_hidden_layers=2, head_dim=16, mamba_d_ssm=64),
        "zamba2": lambda: Zamba2Config(
            **{**base, "num_key_value_heads": 4}, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=4, chunk_size=16, adapter_rank=8,
            use_mem_rope=True),
        "lfm2": lambda: Lfm2Config(**base, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3,
                                   block_auto_adjust_ff_dim=False),
    }


# model key -> (config name, dtype)
MODELS = {
    "llama": ("llama", "float32"),
    "llama_bf16": ("llama", "bfloat16"),
    "mistral_sliding": ("mistral_sliding", "float32"),
    "qwen3_next": ("qwen3_next", "float32"),
    "qwen3_next_bf16": ("qwen3_next", "bfloat16"),
    "bamba": ("bamba", "float32"),
    "granitemoehybrid": ("granitemoehybrid", "float32"),
    "falcon_h1": ("falcon_h1", "float32"),
    "zamba2": ("zamba2", "float32"),
    "lfm2": ("lfm2", "float32"),
}


def build(key: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    cfg_name, dt = MODELS[key]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_configs()[cfg_name](), dtype=getattr(torch, dt)).to(device).eval()


def prompts(key: str) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    a = torch.randint(0, V, (P + S,), generator=g).tolist()
    b = a[:B1] + torch.randint(0, V, (S2,), generator=g).tolist()
    if b[B1] == a[B1]:
        b[B1] = (b[B1] + 1) % V
    return a, b


def _ids(toks: list[int], device: str) -> Any:
    return torch.tensor([toks], dtype=torch.long, device=device)


@torch.no_grad()
def continue_run(model: Any, cache: Any, toks: list[int], device: str) -> dict[str, Any]:
    """Feed ``toks`` in one forward, then greedy-decode N tokens one at a time."""
    h = hashlib.sha256()
    out = model(_ids(toks, device), past_key_values=cache, use_cache=True)
    h.update(out.logits.float().cpu().numpy().tobytes())
    greedy = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(N):
        greedy.append(nxt)
        out = model(_ids([nxt], device), past_key_values=cache, use_cache=True)
        h.update(out.logits.float().cpu().numpy().tobytes())
        nxt = int(out.logits[0, -1].argmax())
    return {"logits_sha256": h.hexdigest(), "greedy": greedy}


def part_hashes(cache: Any) -> dict[str, str]:
    """SHA-256 of every state part in canonical bytes (meta, fixed parts, valid rows of each stream)."""
    snap = hf.snapshot(cache)
    out = {}
    for name, t in snap.parts.items():
        if isinstance(t, torch.Tensor):
            src = TensorSource(t, snap.token_dims.get(name), pad_rows=snap.pad_rows.get(name))
            buf = bytearray(src.nbytes)
            src.read_into(0, memoryview(buf))
            out[name] = hashlib.sha256(buf).hexdigest()
        else:
            out[name] = hashlib.sha256(t.tobytes()).hexdigest()
    return out


def open_store(model: Any, root: str, key: str) -> Any:
    return hf.open_store(model, os.path.join(root, key), budget=ss.Budget(reserve_bytes=0), check_rows=True,
                         pack="sha256:" + hf.weights_sha256(model))


@torch.no_grad()
def parent_side(key: str, root: str, device: str) -> dict[str, Any]:
    """Prefill, save root (b1) and delta (P), record the uninterrupted runs and the cold part hashes."""
    model = build(key, device)
    a, b = prompts(key)
    ad = open_store(model, root, key)
    store = ad.store
    cache = model(_ids(a[:B1], device), use_cache=True).past_key_values
    r1 = hf.save(ad, cache, a[:B1], session="A")
    cold_b1 = part_hashes(cache)
    model(_ids(a[B1:P], device), past_key_values=cache, use_cache=True)
    r2 = hf.save(ad, cache, a[:P], session="A-2")
    cold_p = part_hashes(cache)
    run_a = continue_run(model, cache, a[P:], device)
    cache_b = model(_ids(a[:B1], device), use_cache=True).past_key_values
    run_b = continue_run(model, cache_b, b[B1:], device)
    infos = {s.snapshot_id: s for s in store.snapshots()}
    layout = store.layout
    delta_bytes = infos[r2.snapshot_id].segment_bytes
    expect_delta = layout.fixed_bytes + (P - B1) * layout.bytes_per_token
    store.close()
    return {"r1": r1.snapshot_id, "r2": r2.snapshot_id, "r2_parent": r2.parent_id, "cold_b1": cold_b1,
            "cold_p": cold_p, "run_a": run_a, "run_b": run_b, "delta_bytes": delta_bytes,
            "expect_delta": expect_delta, "has_rows": bool(layout.rows)}


@torch.no_grad()
def child_side(key: str, root: str, device: str) -> dict[str, Any]:
    """In a new process: match, restore, continue; for prompt A (chain) and prompt B (branch at the root)."""
    model = build(key, device)
    a, b = prompts(key)
    ad = open_store(model, root, key)
    store = ad.store
    out: dict[str, Any] = {}
    for tag, toks in (("a", a), ("b", b)):
        m = store.match(toks)
        assert m is not None
        cache, res = hf.restore(model.config, ad, m, device=device)
        out[tag] = {"n_tokens": m.n_tokens, "snapshot": m.snapshot_id, "chain": res.chain,
                    "hashes": part_hashes(cache), "run": continue_run(model, cache, toks[m.n_tokens:], device)}
    out["verify_ok"] = store.verify(deep=True).ok
    store.close()
    return out


def _child_main(argv: list[str]) -> None:
    root, device, keys = argv[0], argv[1], argv[2:]
    torch.set_num_threads(THREADS)
    print(json.dumps({k: child_side(k, root, device) for k in keys}))


def run_proof(root: str, device: str, keys: list[str]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        parents = {k: parent_side(k, root, device) for k in keys}
    finally:
        torch.set_num_threads(threads)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "child", root, device, *keys],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    children = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: (parents[k], children[k]) for k in keys}


@pytest.fixture(scope="module")
def proof_cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_proof(str(tmp_path_factory.mktemp("hfproof")), "cpu", list(MODELS))


def check(parent: dict[str, Any], child: dict[str, Any]) -> None:
    # chain: the delta is over the root, and A restores root + delta
    assert parent["r2_parent"] == parent["r1"]
    assert child["a"]["n_tokens"] == P and child["a"]["chain"] == [parent["r1"], parent["r2"]]
    # the delta stores only the new rows plus the fixed parts (recurrent/conv state, windows, meta)
    assert parent["delta_bytes"] == parent["expect_delta"]
    # every part byte-identical cold vs restored, through the chain and at the branch point
    assert child["a"]["hashes"] == parent["cold_p"]
    assert child["b"]["hashes"] == parent["cold_b1"]
    # continuation byte-identical to the uninterrupted run with the same prefill split
    assert child["a"]["run"] == parent["run_a"]
    # branch: prompt B shares only b1 tokens and continues from the root
    assert child["b"]["n_tokens"] == B1 and child["b"]["snapshot"] == parent["r1"]
    assert child["b"]["chain"] == [parent["r1"]]
    assert child["b"]["run"] == parent["run_b"]
    assert child["verify_ok"]


@pytest.mark.parametrize("key", list(MODELS))
def test_restore_in_new_process_is_byte_identical(proof_cpu: dict[str, Any], key: str) -> None:
    parent, child = proof_cpu[key]
    check(parent, child)


@pytest.mark.gpu
def test_restore_in_new_process_on_cuda(tmp_path: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    keys = ["llama_bf16", "qwen3_next", "bamba", "falcon_h1", "lfm2"]
    for key, (parent, child) in run_proof(str(tmp_path), "cuda", keys).items():
        check(parent, child)


def test_layout_guards(tmp_path: Any) -> None:
    """Wrong token count, a cache from another model, and a restore into a store of another layout."""
    with torch.no_grad():
        model = build("bamba", "cpu")
        ad = open_store(model, str(tmp_path), "bamba")
        cache = model(_ids([1, 2, 3], "cpu"), use_cache=True).past_key_values
        with pytest.raises(ss.LayoutError):
            hf.save(ad, cache, [1, 2])
        other = build("lfm2", "cpu")
        with pytest.raises(ss.LayoutError):
            hf.save(ad, other(_ids([1, 2, 3], "cpu"), use_cache=True).past_key_values, [1, 2, 3])
        assert hf.save(ad, cache, [1, 2, 3]).ok
        m = ad.store.match([1, 2, 3, 4])
        with pytest.raises(ss.IdentityError):
            hf.restore(other.config, ad, m)  # another model's config
        from transformers import DynamicCache

        with pytest.raises(ss.LayoutError):
            hf.restore(DynamicCache(config=build("llama", "cpu").config), ad, m)  # layer kinds differ
        ident = hf.identity(model)
        assert ident.extra["transformers"] == transformers.__version__
        assert ident.extra["config_sha256"] == hf.config_sha256(model.config) and ident.kv == "float32"
        ad.store.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    _child_main(sys.argv[2:])
