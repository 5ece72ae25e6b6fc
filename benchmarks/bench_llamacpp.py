"""llama.cpp benchmark: time to first token after a restart, three ways, and the proxy's own cost.

    .venv/bin/python benchmarks/bench_llamacpp.py [--quick] [--system-tokens N] [--repeat R] [--arch A]

A random-weight GGUF (written here, no downloads: ``--arch llama``, 8 layers x 256, or
``granitehybrid``, a Mamba2 + attention hybrid ``mamamama`` x 64, whose system-prompt boundary the
proxy captures exactly) is served by the real llama-server
(xllamacpp, one process per run, 1 thread). A chat with an N-token system prompt is run once
through ``snapstore llama-proxy``'s app (which stores the system prompt), then the server is
restarted and a new chat with the same system prompt is timed (time to first token, streaming):

- re-prefill: the new server reads the whole prompt;
- llama-server slot restore: POST /slots/0?action=restore of the file the first server saved,
  then the request (restore time + request time);
- proxy: the request through the proxy, which restores the stored system prompt first.

Then the proxy's added latency: a request with a tiny prompt and max_tokens=1 straight to the
server vs through the proxy (slot already warm), median of R. Medians of R runs; figures in
docs/benchmarks.md ("llama.cpp").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import LlamaBridge  # noqa: E402


def ttft(url: str, system: str, user: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the request's cache_n (from the final chunk)."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4, "temperature": 0, "stream": True, "timings_per_token": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    cache_n = -1
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            doc = json.loads(line[6:])
            if "timings" in doc:
                cache_n = int(doc["timings"].get("cache_n", cache_n))
    return (first if first is not None else time.perf_counter() - t0), cache_n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 2K-token system prompt, 3 runs")
    ap.add_argument("--system-tokens", type=int, default=0, help="system prompt length (default 8000; quick 2000)")
    ap.add_argument("--repeat", type=int, default=0, help="runs per figure (default 5; quick 3)")
    ap.add_argument("--arch", choices=("llama", "granitehybrid"), default="llama",
                    help="the model: plain attention, or a Mamba2 + attention hybrid")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    n_sys = a.system_tokens or (2000 if a.quick else 8000)
    reps = a.repeat or (3 if a.quick else 5)
    d = tempfile.mkdtemp(prefix="bench-llamacpp-")
    if a.arch == "llama":
        model = h.write_llama(os.path.join(d, "m.gguf"), n_layer=8, n_embd=256, n_head=8, n_head_kv=4, n_ff=512,
                              n_ctx=16384)
    else:  # the GGUF says 8192 tokens of context; the server's 16384 is cut to it
        model = h.write_granitehybrid(os.path.join(d, "m.gguf"), layers="mamamama")
    slots = os.path.join(d, "slots")
    system = h.text_of(n_sys // 7 + 1, seed=3)  # about 7 tokens per word with this vocabulary
    res: dict[str, list[float]] = {"reprefill": [], "slot_restore": [], "proxy": []}
    cache: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for rep in range(reps):
        store = os.path.join(d, f"store{rep}")
        with h.server_process(model, slots, n_ctx=16384) as s1:
            b = LlamaBridge(s1.url, slots, model, store_dir=store, build="bench")
            b.start()
            with h.proxy(b) as (url, _):
                ttft(url, system, "hello")
            b.close()
            s1.post("/slots/0?action=save", {"filename": "own.bin"})
            sizes["slot_file"] = os.path.getsize(os.path.join(slots, "own.bin"))
        with h.server_process(model, slots, n_ctx=16384) as s:
            t, cache["reprefill"] = ttft(s.url, system, f"question {rep}")
            res["reprefill"].append(t)
        with h.server_process(model, slots, n_ctx=16384) as s:
            t0 = time.perf_counter()
            s.post("/slots/0?action=restore", {"filename": "own.bin"})
            t_restore = time.perf_counter() - t0
            t, cache["slot_restore"] = ttft(s.url, system, f"question {rep}")
            res["slot_restore"].append(t_restore + t)
        with h.server_process(model, slots, n_ctx=16384) as s:
            b = LlamaBridge(s.url, slots, model, store_dir=store, build="bench")
            t0 = time.perf_counter()
            b.start()
            with h.proxy(b) as (url, _):
                t1 = time.perf_counter()
                t, cache["proxy"] = ttft(url, system, f"question {rep}")
                res["proxy"].append(t)
                start_s = t1 - t0
            sizes["store"] = b.slots.store.stats().stored_bytes if b.slots.store else 0
            b.close()
    # the proxy's added latency on a warm slot and a tiny request
    direct: list[float] = []
    via: list[float] = []
    with h.server_process(model, slots, n_ctx=16384) as s:
        b = LlamaBridge(s.url, slots, model, store_dir=os.path.join(d, "store-lat"), build="bench")
        b.start()
        with h.proxy(b) as (url, _):
            for i in range(reps * 4):
                for target, out in ((s.url, direct), (url, via)):
                    t0 = time.perf_counter()
                    h.post(target, "/completion", {"prompt": "hello world", "n_predict": 1, "id_slot": 0,
                                                   "cache_prompt": True})
                    out.append(time.perf_counter() - t0)
        b.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    doc = {"arch": a.arch, "system_tokens_approx": n_sys, "repeat": reps, "ttft_s": med, "cache_n": cache,
           "bytes": sizes,
           "proxy_start_s": start_s, "added_latency_ms": 1e3 * (statistics.median(via) - statistics.median(direct)),
           "direct_ms": 1e3 * statistics.median(direct), "via_proxy_ms": 1e3 * statistics.median(via)}
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"llama.cpp: {n_sys}-token system prompt (approx), {a.arch} 8 layers f32, 1 thread, median of {reps}")
    for k, label in (("reprefill", "re-prefill (new server)"), ("slot_restore", "llama-server slot restore + request"),
                     ("proxy", "through the proxy (restore from store)")):
        print(f"  {label:<40} TTFT {med[k] * 1e3:8.1f} ms   cache_n {cache[k]}")
    print(f"  slot file {sizes['slot_file']} bytes; store {sizes['store']} bytes")
    print(f"  proxy added latency (tiny request, warm slot): {doc['added_latency_ms']:.1f} ms "
          f"({doc['direct_ms']:.1f} ms direct, {doc['via_proxy_ms']:.1f} ms via proxy)")


if __name__ == "__main__":
    main()
