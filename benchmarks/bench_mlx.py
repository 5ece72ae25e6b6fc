"""MLX PrefixCache: time to first token after a restart, with and without the store.

    .venv/bin/python benchmarks/bench_mlx.py                # 4K and 16K system prompts, llama + falcon_h1
    .venv/bin/python benchmarks/bench_mlx.py --quick        # 4K only, one repeat

Per model and prompt length T: process 1 (a subprocess) answers a T-token system prompt + a
32-token question through ``PrefixCache`` on a fresh store (``cache_prefix=T``). Process 2, the
restart, times the first token of the same system prompt + a new question:

- plain:  ``mlx_lm.generate_step`` on the whole prompt (no store)
- hit:    ``PrefixCache.generate_step`` through a freshly opened PrefixCache (RAM tier off: the
          snapshot is read from its chunk files); ``restore`` is the time spent restoring
- open:   opening the PrefixCache (weights hash + cache probe), paid once per process

``exact``: the hit's first token and log-probabilities equal mlx_lm's run with the same split.
Medians of ``--repeat``; speed-up is plain / hit.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
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
