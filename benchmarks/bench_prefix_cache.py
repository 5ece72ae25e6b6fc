"""Time to first token with and without PrefixCache, for long system prompts on tiny random models.

    .venv/bin/python benchmarks/bench_prefix_cache.py                 # 4K and 16K prompts, llama + bamba
    .venv/bin/python benchmarks/bench_prefix_cache.py --quick         # 4K only, one repeat

Per model and prompt length T: the prompt is a T-token system prompt + a 32-token question,
``cache_prefix=T``, greedy, ``max_new_tokens=1`` (so the call's time is the time to first token).

- plain:    ``model.generate`` (one-shot prefill; no store)
- uncached: ``PrefixCache.uncached_generate`` (the same split as the cache: pieces at the cuts; no store)
- miss:     ``PrefixCache.generate`` on an empty store (reads everything and saves the snapshots)
- hit:      ``PrefixCache.generate`` of the same system prompt + a new question, through a freshly
            opened PrefixCache (a new Store, RAM tier off: the snapshot is read from its chunk files)

Medians of ``--repeat`` (a fresh store per repetition). ``exact`` says whether the hit's output
(tokens and scores) is byte-identical to ``uncached``; ``speed-up`` is plain / hit.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, BambaConfig, LlamaConfig  # noqa: E402

import snapstore as ss  # noqa: E402
from snapstore.engine.hf import PrefixCache  # noqa: E402

VOCAB = 4096
QUESTION = 32


def build(name: str) -> Any:
    if name == "llama":
        cfg: Any = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                               intermediate_size=768, vocab_size=VOCAB, max_position_embeddings=32768)
    else:
        cfg = BambaConfig(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                          intermediate_size=768, vocab_size=VOCAB, attn_layer_indices=[2, 5], mamba_n_heads=8,
                          mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, mamba_n_groups=1,
                          max_position_embeddings=32768)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def ids(system: int, seed: int) -> torch.Tensor:
    s = torch.randint(1, VOCAB, (1, system), generator=torch.Generator().manual_seed(1))
    q = torch.randint(1, VOCAB, (1, QUESTION), generator=torch.Generator().manual_seed(seed))
    return torch.cat([s, q], dim=1)


GEN = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)


def timed(fn: Any, *a: Any, **kw: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


def same(a: Any, b: Any) -> bool:
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def one(model: Any, system: int, work: str) -> dict[str, Any]:
    first, second = ids(system, 2), ids(system, 3)
    shutil.rmtree(work, ignore_errors=True)
    budget = ss.Budget(ram_bytes=0, reserve_bytes=0)
    _, plain = timed(model.generate, second, **GEN)
    with PrefixCache(model, work, budget=budget) as pc:
        ref, uncached = timed(pc.uncached_generate, second, cache_prefix=system, **GEN)
        _, miss = timed(pc.generate, first, cache_prefix=system, session="c1", **GEN)
        stored = pc.stats().store.stored_bytes
    with PrefixCache(model, work, budget=budget) as pc:  # a new Store: nothing in memory
        out, hit = timed(pc.generate, second, cache_prefix=system, session="c2", **GEN)
        st = pc.stats()
    assert st.restored_tokens == system, st
    return {"plain": plain, "uncached": uncached, "miss": miss, "hit": hit, "restore": st.restore_seconds,
            "stored_mib": stored / 2**20, "exact": same(out, ref)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384", help="system prompt lengths")
    ap.add_argument("--models", default="llama,bamba")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4096 tokens, one repeat")
    ap.add_argument("--dir", default=os.environ.get("SNAPSTORE_BENCH_DIR"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeat = "4096", 1
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    root = tempfile.mkdtemp(prefix="bench-prefix-", dir=args.dir)
    print(f"snapstore {ss.__version__} PrefixCache benchmark | {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__} ({args.threads} threads), transformers "
          f"{transformers.__version__} | medians of {args.repeat} | work dir {root}")
    print(f"{'model':<7}{'prompt':>8}  {'plain':>8}{'uncached':>10}{'miss':>8}{'hit':>8}{'restore':>9}"
          f"{'speed-up':>10}{'stored':>10}  exact")
    try:
        for name in args.models.split(","):
            model = build(name)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            for system in (int(t) for t in args.tokens.split(",")):
                runs = [one(model, system, os.path.join(root, name)) for _ in range(args.repeat)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "exact"}
                exact = all(r["exact"] for r in runs)
                print(f"{name:<7}{system + QUESTION:>8}  {med['plain']:>7.2f}s{med['uncached']:>9.2f}s"
                      f"{med['miss']:>7.2f}s{med['hit']:>7.3f}s{med['restore'] * 1000:>7.1f}ms"
                      f"{med['plain'] / med['hit']:>9.1f}x{med['stored_mib']:>7.1f}MiB  {exact}"
                      f"   ({params:.1f}M params)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
