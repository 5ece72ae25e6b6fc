#!/usr/bin/env python3
"""SGLang HiCache storage: the snapstore backend's ``batch_get_v1`` vs SGLang's own file backend, on CPU.

The same pages (random bf16 K/V in a host pool laid out as SGLang's ``MHATokenToKVPoolHost``) are
written through each backend as SGLang's cache controller writes them, then read back into the host
pool as the controller reads them: snapstore through ``batch_get_v1`` (the zero-copy path,
``interface_v1: 1``), the file backend through its ``batch_get`` into dummy pages plus
``set_from_flat_data_page`` (``_generic_page_get``, the path SGLang uses for it). Warm reads (the page
cache holds the files; one untimed read first), batches of 128 pages (SGLang's STORAGE_BATCH_SIZE),
median of ``--reps``, both backends alternated on one file system. Every read is checked byte-exact.

    .venv/bin/python benchmarks/bench_sglang.py [--dir DIR] [--reps 5] [--json out.json]

``--server TOKENS`` (GPU, scripts/gpu_check.sh) instead starts real SGLang servers on a tiny random
Llama and times a TOKENS-token prompt after a restart: restored by snapstore, by SGLang's file
backend, and recomputed (no storage tier); the first output token is compared across the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from test_sglang_hicache import HostPages, config, keys_of  # noqa: E402  (the tests' host pool)

SHAPES = {  # name -> (layers, kv heads, head dim, tokens per page, pages)
    "1.75 MiB pages (28 layers x 8 heads x 128, 16 tokens)": (28, 8, 128, 16, 64),
    "64 KiB pages (2 layers x 8 heads x 64, 16 tokens)": (2, 8, 64, 16, 512),
}


def batches(keys: list[str]) -> list[tuple[int, list[str]]]:
    return [(i, keys[i:i + STORAGE_BATCH_SIZE]) for i in range(0, len(keys), STORAGE_BATCH_SIZE)]


def slots(pool: HostPages, first: int, n: int) -> torch.Tensor:
    return torch.arange(first * pool.page_size, (first + n) * pool.page_size, dtype=torch.int64)


def snap_read(b: Any, pool: HostPages, keys: list[str]) -> int:
    got = 0
    for i, ks in batches(keys):
        got += sum(b.batch_get_v1(ks, slots(pool, i, len(ks)), HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
    return got


def file_read(b: Any, pool: HostPages, keys: list[str]) -> int:
    got = 0
    for i, ks in batches(keys):  # the cache controller's _generic_page_get
        data = b.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
        for j, page in enumerate(data):
            if page is None:
                break
            pool.set_from_flat_data_page((i + j) * pool.page_size, page)
            got += 1
    return got


def run_shape(root: Path, name: str, shape: tuple[int, int, int, int, int], reps: int) -> dict[str, Any]:
    layers, heads, dim, page, n = shape
    src = HostPages(n, layer_num=layers, head_num=heads, head_dim=dim, page_size=page)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    keys = keys_of(name, n)
    page_bytes = src.get_dummy_flat_data_page().numel() * 2
    backends: dict[str, Any] = {}
    for label, extra in (("snapstore", {"ram_mib": 0}), ("snapstore, RAM tier", {})):
        d = root / f"snap-{len(backends)}"
        b = StorageBackendFactory.create_backend("dynamic", config(str(d), **extra), src)
        b.register_mem_pool_host(src)
        for i, ks in batches(keys):
            assert all(b.batch_set_v1(ks, slots(src, i, len(ks)), HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
        backends[label] = (b, snap_read)
    fcfg = config("", file_storage_path=str(root / "file"))
    fb = StorageBackendFactory.create_backend("file", fcfg, src)
    for i, ks in batches(keys):  # the cache controller's _generic_page_set
        assert fb.batch_set(ks, [src.get_data_page((i + j) * page) for j in range(len(ks))])
    backends["SGLang HiCacheFile"] = (fb, file_read)
    secs: dict[str, list[float]] = {k: [] for k in backends}
    dst = HostPages(n, layer_num=layers, head_num=heads, head_dim=dim, page_size=page)
    for b, _ in backends.values():
        b.register_mem_pool_host(dst)  # reads land in the host pool the backend was given
    for rep in range(reps + 1):
        for label, (b, read) in backends.items():
            dst.kv_buffer.zero_()
            t0 = time.perf_counter()
            got = read(b, dst, keys)
            dt = time.perf_counter() - t0
            assert got == n and torch.equal(dst.kv_buffer, src.kv_buffer), (label, got, n)
            if rep:  # rep 0 warms the page cache (and admits snapstore's RAM tier)
                secs[label].append(dt)
    out = {}
    for label, s in secs.items():
        med = statistics.median(s)
        out[label] = {"pages_per_s": n / med, "gb_per_s": n * page_bytes / med / 1e9, "median_s": med,
                      "spread_s": [min(s), max(s)]}
    for b, _ in backends.values():
        if hasattr(b, "close"):
            b.close()
    return {"page_bytes": page_bytes, "pages": n, "results": out}


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> Any:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _serve(model: Path, port: int, storage: list[str], env: dict[str, str]) -> Any:
    """Start ``sglang.launch_server`` on the tiny model with HiCache (and ``storage``); wait for /health."""
    import subprocess
    import urllib.request

    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
           "--skip-tokenizer-init", "--skip-server-warmup", "--disable-cuda-graph", "--page-size", "16",
           "--mem-fraction-static", "0.5", "--enable-hierarchical-cache", "--hicache-ratio", "2",
           "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete", *storage]
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"sglang exited with {proc.returncode} before it served: {cmd}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("sglang did not serve within 300 s")


def server_run(root: Path, tokens: int) -> dict[str, Any]:
    """GPU only: TTFT of a prompt after a restart, restored by snapstore vs SGLang's file backend vs recomputed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = root / "tiny-llama"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=tokens + 64,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model)
    prompt = torch.randint(10, 32000, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    ec = {"backend_name": "snapstore", "module_path": "snapstore.engine.sglang", "class_name": "SnapstoreHiCache",
          "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, "path": str(root / "snap"),
          "model_revision": "bench-seed0"}  # the weights written above (a run writes them anew)
    modes = {"recomputed (no L3)": ([], {}),
             "SGLang HiCacheFile": (["--hicache-storage-backend", "file"],
                                    {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(root / "file")}),
             "snapstore": (["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                            json.dumps(ec)], {})}
    out: dict[str, Any] = {}
    for label, (storage, env) in modes.items():
        ttft, first = [], []
        for _start in range(2):  # the second server is a restart: its GPU and host caches are empty
            proc = _serve(model, 30111, storage, env)
            try:
                t0 = time.perf_counter()
                r = _post("http://127.0.0.1:30111/generate",
                          {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                ttft.append(time.perf_counter() - t0)
                first.append(r["output_ids"][-1])
                time.sleep(5)  # write-through to the storage tier lands
            finally:
                proc.terminate()
                proc.wait(60)
        out[label] = {"ttft_first_s": ttft[0], "ttft_after_restart_s": ttft[1], "same_token": first[0] == first[1]}
        print(label, out[label], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--server", type=int, default=0, metavar="TOKENS",
                    help="GPU only: a real SGLang server on a tiny random Llama, TTFT of a TOKENS-token prompt after a "
                         "restart (snapstore vs HiCacheFile vs recomputed) instead of the CPU figures")
    args = ap.parse_args()
    if args.server:
        root = Path(tempfile.mkdtemp(prefix="bench-sglang-server-", dir=args.dir))
        try:
            res = server_run(root, args.server)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return
    root = Path(tempfile.mkdtemp(prefix="bench-sglang-", dir=args.dir))
    try:
        load0 = os.getloadavg()
        report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load0,
                                  "shapes": {}}
        for name, shape in SHAPES.items():
            report["shapes"][name] = run_shape(root, name, shape, args.reps)
        report["load_after"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{report['when']}, load average {report['load_before'][0]:.2f} before, {report['load_after'][0]:.2f} after")
    print("| pages | backend | pages/s | GB/s | vs HiCacheFile |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in report["shapes"].items():
        base = r["results"]["SGLang HiCacheFile"]["pages_per_s"]
        for label, v in r["results"].items():
            ratio = v["pages_per_s"] / base
            print(f"| {name} | {label} | {v['pages_per_s']:,.0f} | {v['gb_per_s']:.2f} | {ratio:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
