"""MLX PrefixCache: time to first token after a restart, with and without the store.

    .venv/bin/python benchmarks/bench_mlx.py                # 4K and 16K system prompts, llama + falcon_h1
    .venv/bin/python benchmarks/bench_mlx.py --quick        # 4K only, one repeat
    .venv/bin/python benchmarks/bench_mlx.py --server 2048  # mlx_lm.server after a restart, with and without the store

Per model and prompt length T: process 1 (a subprocess) answers a T-token system prompt + a
32-token question through ``PrefixCache`` on a fresh store (``cache_prefix=T``). Process 2, the
restart, times the first token of the same system prompt + a new question:

- plain:  ``mlx_lm.generate_step`` on the whole prompt (no store)
- hit:    ``PrefixCache.generate_step`` through a freshly opened PrefixCache (RAM tier off: the
          snapshot is read from its chunk files); ``restore`` is the time spent restoring
- open:   opening the PrefixCache (weights hash + cache probe), paid once per process

``exact``: the hit's first token and log-probabilities equal mlx_lm's run with the same split.
Medians of ``--repeat``; speed-up is plain / hit.

``--server T``: the same over HTTP, llama only. Server 1 (``snapstore mlx-server``) answers a chat
with a T-token system prompt and stops; then server 2 (a restart of it, same store) and a fresh
plain ``mlx_lm.server`` each answer a warm-up chat (another system prompt: the model load and, for
server 2, the weights hash) and then a new chat with the same T-token system prompt, timed
end to end with ``max_tokens`` 1 (the time to the first token as a client sees it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import mlx.core as mx  # noqa: E402
import mlx_models  # noqa: E402
import numpy as np  # noqa: E402

import snapstore as ss  # noqa: E402
from snapstore.engine.mlx import PrefixCache  # noqa: E402

G = importlib.import_module("mlx_lm.generate")
QUESTION = 32
CONFIGS = {
    "llama": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
              "vocab_size": 256, "tie_word_embeddings": False},
    "falcon_h1": {**mlx_models.CONFIGS["falcon_h1"], "hidden_size": 256, "num_hidden_layers": 4,
                  "intermediate_size": 512, "head_dim": 32, "num_attention_heads": 8, "mamba_d_ssm": 256,
                  "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_chunk_size": 128},
}


def model_of(name: str) -> Any:
    mod = importlib.import_module(f"mlx_lm.models.{CONFIGS[name]['model_type']}")
    model = mod.Model(mod.ModelArgs.from_dict(CONFIGS[name]))
    mx.random.seed(0)
    from mlx.utils import tree_flatten, tree_unflatten

    model.update(tree_unflatten([(k, (mx.random.normal(v.shape) * 0.2).astype(v.dtype))
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


def prompts(t: int) -> tuple[list[int], list[int]]:
    system = [(i * 7919) % 250 + 2 for i in range(t)]
    first = [(i * 31) % 250 + 2 for i in range(QUESTION)]
    second = [(i * 17) % 250 + 3 for i in range(QUESTION)]
    return system + first, system + second


def child(name: str, t: int, path: str) -> None:
    """Process 1: answer the first question through the cache (stores the system prompt)."""
    a, _ = prompts(t)
    with PrefixCache(model_of(name), path) as pc:
        next(iter(pc.generate_step(mx.array(a), cache_prefix=t, max_tokens=1)))


def run(name: str, t: int) -> dict[str, Any]:
    path = tempfile.mkdtemp(prefix="bench_mlx_")
    try:
        subprocess.run([sys.executable, __file__, "--child", name, str(t), path], check=True)
        _, b = prompts(t)
        model = model_of(name)
        ids = mx.array(b)
        t0 = time.perf_counter()
        ref = next(iter(G.generate_step(ids, model, max_tokens=1)))
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        pc = PrefixCache(model, path, budget=ss.Budget(ram_bytes=0))
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = next(iter(pc.generate_step(ids, cache_prefix=t, max_tokens=1)))
        hit = time.perf_counter() - t0
        st = pc.stats()
        pc.close()
        split = mlx_models.reference(model, b, sorted({*range(pc.boundary, len(b), pc.boundary), t}), {}, 1)[0]
        exact = int(got[0]) == int(split[0]) and np.array(got[1]).tobytes() == np.array(split[1]).tobytes()
        return {"plain": plain, "hit": hit, "restore": st.restore_seconds, "open": opened,
                "restored": st.restored_tokens, "exact": exact and int(ref[0]) == int(got[0])}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_dir(name: str, path: str) -> None:
    """The benchmark model as an mlx_lm model directory with the tests' word-level tokenizer and chat template."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model_of(name).parameters())))
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    tok = mlx_models.tokenizer()
    tok.chat_template = mlx_models.CHAT_TEMPLATE
    tok.save_pretrained(str(d))


def server_run(t: int) -> dict[str, Any]:
    """TTFT over HTTP after a restart: snapstore mlx-server (restored system prompt) vs plain mlx_lm.server."""
    from pathlib import Path

    from mlx_http import Server

    work = Path(tempfile.mkdtemp(prefix="bench_mlx_server_"))
    try:
        write_dir("llama", str(work / "model"))
        system = " ".join(f"w{(i * 7919) % 250 + 2}" for i in range(t))
        ours = [sys.executable, "-m", "snapstore", "--dir", str(work / "store"), "mlx-server",
                "--model", str(work / "model")]
        plain = [sys.executable, "-m", "mlx_lm.server", "--model", str(work / "model")]
        s = Server(ours, work / "s1.log")
        try:
            s.chat(system, "w40 w41 w42 w43", 1)
        finally:
            s.stop()
        out: dict[str, Any] = {}
        for label, argv in (("store", ours), ("plain", plain)):
            s = Server(argv, work / f"{label}.log")
            try:
                t0 = time.perf_counter()
                s.chat("w5 w6 w7", "w8", 1)  # warm-up: the model load (and the weights hash), another prompt
                warm = time.perf_counter() - t0
                t0 = time.perf_counter()
                doc = s.chat(system, "w60 w61 w62 w63", 1)
                out[label] = {"ttft": time.perf_counter() - t0, "warm": warm,
                              "cached": doc["usage"]["prompt_tokens_details"]["cached_tokens"],
                              "prompt": doc["usage"]["prompt_tokens"],
                              "answer": [(c["id"], c["logprob"]) for c in doc["choices"][0]["logprobs"]["content"]]}
            finally:
                s.stop()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--server", type=int, metavar="T", help="mlx_lm.server after a restart, T-token system prompt")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    if args.server:
        print(f"mlx {mx.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, {mx.default_device()}")
        print("| server | prompt | cached | TTFT | warm-up (load, hash) | same answer |")
        print("|---|---|---|---|---|---|")
        for _ in range(args.repeat if not args.quick else 1):
            r = server_run(args.server)
            same = r["store"]["answer"] == r["plain"]["answer"]
            for label in ("plain", "store"):
                x = r[label]
                print(f"| {label} | {x['prompt']} | {x['cached']} | {x['ttft']:.2f} s | {x['warm']:.2f} s | {same} |",
                      flush=True)
        return
    lengths, repeat = ([4096], 1) if args.quick else ([4096, 16384], args.repeat)
    print(f"mlx {mx.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, {mx.default_device()}")
    print("| model | prompt | plain | hit | restore | open | restored | speed-up | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        for t in lengths:
            rs = [run(name, t) for _ in range(repeat)]
            med = {k: statistics.median(r[k] for r in rs) for k in ("plain", "hit", "restore", "open")}
            print(f"| {name} | {t + QUESTION} | {med['plain']:.2f} s | {med['hit']:.3f} s | "
                  f"{med['restore'] * 1e3:.1f} ms | {med['open']:.2f} s | {rs[0]['restored']} | "
                  f"{med['plain'] / med['hit']:.0f}x | {all(r['exact'] for r in rs)} |", flush=True)


if __name__ == "__main__":
    main()
