"""vLLM with the snapstore connector vs without vs vLLM's ExampleConnector (issue 17).

Runs real vLLM processes (CPU build, .venv-vllm from scripts/vllm_venv.sh) on the tiny random
Llama of tests/vllm_driver.py and reports:

1. time to first token of long prompts: prefill (no connector), restored by snapstore (a second
   process serving what the first saved), restored by the ExampleConnector (same two processes);
   the restoring processes of the two connectors alternate for ``--rounds`` rounds (default 4),
   in ABBA order (snapstore first in even rounds, the ExampleConnector first in odd ones), and the
   figure is the median over all their prompts; beside it, the median of the time the snapstore
   connector's scheduler lookup and worker load took for each of those requests, inside vLLM;
2. eight conversations sharing a 2K-token system prompt: bytes in the snapstore store vs in the
   ExampleConnector's folders, for the same prompts.

``--model hybrid`` runs part 1 on the tiny random Qwen3-Next (gated delta net + attention,
bfloat16, 544-token blocks, prefix caching on, prefill in 544-token chunks) instead: prefill vs
restored by snapstore (attention rows and the recurrent state pages at the prompt's last stored
boundary); the ExampleConnector does not take hybrids. ``--model gemma3`` does the same on a tiny
Gemma 3 text model (sliding window 64 + full attention, prefix caching on: full-attention rows and
the window's blocks), ``--model tp2`` on the tiny Llama at ``tensor_parallel_size=2`` (each rank
restores its own shard), ``--model deepseek`` on a tiny DeepSeek-V2 (MLA; vLLM's own prefix cache
is off on a CPU).

``python benchmarks/bench_vllm.py [--model llama|hybrid|gemma3|tp2|deepseek] [--long 3000] [--n 5] [--rounds 4]
[--json out.json]``.
The model is tiny, so TTFT here is dominated by vLLM's per-request overhead and the K/V copy, not by attention FLOPs:
read the ratios, not the absolute figures, and on a loaded machine run it twice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "tests" / "vllm_driver.py"


def _serve(tmp: Path, name: str, model: str, prompts: list[list[int]], **spec: Any) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    (tmp / f"{name}.spec.json").write_text(json.dumps({"model": model, "prompts": prompts, "out": str(out),
                                                       "max_tokens": 1, **spec}))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"))
    proc = subprocess.run([str(VPY), str(DRIVER), "serve", str(tmp / f"{name}.spec.json")], capture_output=True,
                          text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: vLLM failed:\n{proc.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.read_text())
    return res


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _ttfts(res: dict[str, Any]) -> list[float]:
    return [r["seconds"] for r in res["results"][1:]]  # the first prompt warms the process up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=3000, help="tokens of each long prompt")
    ap.add_argument("--n", type=int, default=5, help="long prompts timed (medians)")
    ap.add_argument("--rounds", type=int, default=4,
                    help="restoring processes per connector, in ABBA order (TTFT: the median over all their prompts)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--model", choices=("llama", *MODELS), default="llama",
                    help="the tiny Llama (every part), or another tiny model / TP = 2 (TTFT only)")
    args = ap.parse_args()
    if args.model in MODELS:
        ttft_only(args)
        return
    subprocess.run([str(ROOT / "scripts" / "vllm_venv.sh")], check=True)
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as d:
        tmp = Path(d)
        model = str(tmp / "model")
        subprocess.run([str(VPY), str(DRIVER), "build", model], check=True, capture_output=True)
        warm = [rng.randrange(4, 512) for _ in range(64)]
        longs = [[rng.randrange(4, 512) for _ in range(args.long)] for _ in range(args.n)]
        prompts = [warm, *longs]
        fig: dict[str, Any] = {"long_tokens": args.long, "n": args.n, "load": os.getloadavg()}

        base = _serve(tmp, "prefill", model, prompts)
        snap = {"connector": "snapstore", "extra": {"path": str(tmp / "store")}}
        _serve(tmp, "snap1", model, prompts, **snap)
        ex = {"connector": "example", "example_path": str(tmp / "example")}
        _serve(tmp, "ex1", model, prompts, **ex)
        # the restoring processes alternate, round by round: a neighbour's burst hits both alike
        each: dict[str, list[float]] = {"snapstore": [], "example": []}
        per_request: dict[str, list[int]] = {"lookup_us": [], "load_us": []}  # the snapstore connector's, inside vLLM
        snap2: dict[str, Any] = {}
        ex2: dict[str, Any] = {}
        # each round's warm-up prompt is new to both connectors (its own first token): prefilled, it gives the
        # snapstore connector its prefill rate, so every lookup of the round is weighed, as in a serving engine
        firsts = [t for t in range(4, 512) if t != warm[0]]
        for r in range(args.rounds):  # ABBA: neither connector always runs first, after the other
            warm_r = [firsts[r % len(firsts)], *warm[1:]]
            for who in (("snapstore", "example") if r % 2 == 0 else ("example", "snapstore")):
                if who == "snapstore":
                    snap2 = _serve(tmp, f"snap2-{r}", model, [warm_r, *longs], **snap)
                    each["snapstore"] += _ttfts(snap2)
                    for k, v in per_request.items():  # the restored requests (all of them, on this store)
                        v += [res[k] for res in snap2["results"][1:] if k in res and res["num_cached_tokens"]]
                else:
                    ex2 = _serve(tmp, f"ex2-{r}", model, [warm_r, *longs], **ex)
                    each["example"] += _ttfts(ex2)
        fig["ttft_s"] = {"prefill": statistics.median(_ttfts(base)),
                         "snapstore_restored": statistics.median(each["snapstore"]),
                         "example_restored": statistics.median(each["example"])}
        fig["ttft_each_ms"] = {k: [round(v * 1e3, 2) for v in vs] for k, vs in each.items()}
        fig["snapstore_connector"] = snap2["stats"]
        if per_request["lookup_us"]:  # p50 of each restored request's own lookup and load (tests/vllm_driver.py)
            fig["snapstore_per_request_us"] = {"requests": len(per_request["lookup_us"]),
                                               **{f"{k[:-3]}_p50": statistics.median(v)
                                                  for k, v in per_request.items()},
                                               **{f"{k[:-3]}_each": v for k, v in per_request.items()}}
        fig["cached_tokens"] = {"snapstore": [r["num_cached_tokens"] for r in snap2["results"][1:]],
                                "example": [r["num_cached_tokens"] for r in ex2["results"][1:]]}

        system = [rng.randrange(4, 512) for _ in range(2048)]
        convs = [[*system, *(rng.randrange(4, 512) for _ in range(200))] for _ in range(8)]
        _serve(tmp, "conv-snap", model, convs, connector="snapstore", extra={"path": str(tmp / "conv-store")})
        _serve(tmp, "conv-ex", model, convs, connector="example", example_path=str(tmp / "conv-example"))
        stats = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(tmp / "conv-store"), "stats",
                                "--json"], capture_output=True, text=True, check=True)
        st = json.loads(stats.stdout)["stats"]
        block = 2 * 2 * 32 * 64 * 4  # 2 layers x (2 heads x 32 tokens x 64 floats) per block
        fig["eight_conversations"] = {
            "prompt_tokens": len(convs[0]), "snapstore_stored_bytes": st["stored_bytes"],
            "snapstore_logical_bytes": st["logical_bytes"], "snapstore_dir_bytes": _du(tmp / "conv-store" / "blobs"),
            "example_dir_bytes": _du(tmp / "conv-example"),
            "one_prefix_plus_8_deltas_bytes": (2048 // 32 + 8 * ((2248 // 32) - 2048 // 32)) * block}
    print(json.dumps(fig, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2))


HYBRID = {"dtype": "bfloat16", "prefix_cache": True, "chunked": 544, "max_len": 8192, "kv_mib": 512}
#: --model: (description, build arguments, serve settings)
MODELS: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "hybrid": ("tiny Qwen3-Next (3 GDN + 1 attention layer, bf16)", ["--hybrid"], HYBRID),
    "gemma3": ("tiny Gemma 3 text (2 sliding-window-64 + 2 full-attention layers)", ["--gemma3", "64"],
               {"prefix_cache": True, "kv_mib": 256}),
    "tp2": ("tiny Llama, tensor_parallel_size=2 (one core per rank)", [], {"tp": 2, "kv_mib": 256}),
    "deepseek": ("tiny DeepSeek-V2 (MLA, 576-wide latent, CPU_MLA)", ["--deepseek-v2"],
                 {"block_size": None, "kv_mib": 256}),
}


def ttft_only(args: argparse.Namespace) -> None:
    """TTFT of long prompts on ``--model``: prefill vs restored by snapstore (a second process)."""
    subprocess.run([str(ROOT / "scripts" / "vllm_venv.sh")], check=True)
    desc, build, spec = MODELS[args.model]
    if spec.get("tp"):  # the workers' OpenMP threads, one core each (a one-NUMA-node machine)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(int(spec["tp"]))))
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix=f"bench-vllm-{args.model}-") as d:
        tmp = Path(d)
        model = str(tmp / "model")
        subprocess.run([str(VPY), str(DRIVER), "build", model, *build], check=True, capture_output=True)
        warm = [rng.randrange(4, 512) for _ in range(64)]
        longs = [[rng.randrange(4, 512) for _ in range(args.long)] for _ in range(args.n)]
        fig: dict[str, Any] = {"model": desc, "long_tokens": args.long, "n": args.n, "load_before": os.getloadavg()}
        base = _serve(tmp, "prefill", model, [warm, *longs], **spec)
        snap = {"connector": "snapstore", "extra": {"path": str(tmp / "store")}, **spec}
        _serve(tmp, "snap1", model, [warm, *longs], **snap)
        snap2 = _serve(tmp, "snap2", model, [[5, *warm[1:]], *longs], **snap)
        fig["ttft_s"] = {"prefill": statistics.median(_ttfts(base)),
                         "snapstore_restored": statistics.median(_ttfts(snap2))}
        fig["cached_tokens"] = [r["num_cached_tokens"] for r in snap2["results"][1:]]
        fig["same_output"] = [r["tokens"] for r in snap2["results"][1:]] == [r["tokens"] for r in base["results"][1:]]
        fig["snapstore_connector"] = snap2["stats"]
        fig["load_after"] = os.getloadavg()
    print(json.dumps(fig, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2))


if __name__ == "__main__":
    main()
