"""Benchmark: save/restore a set of bf16 torch tensors through the snapstore adapter vs the naive ways.

    python examples/bench_adapter.py [--size-mib 1024] [--dir DIR] [--repeat 3]

Every method runs in its own subprocess (so peak RSS is its own), on the same tensors, in one run:

- snapstore adapter, canonical layout ``[T, H, D]`` (zero-copy: chunks are hashed/written straight
  from the tensors and read straight into the destinations)
- snapstore adapter, engine layout ``[B, H, T, D]`` (token axis 2: strided copies through the
  store's staging slots)
- safetensors.torch ``save_file`` + fsync / ``load_file`` + ``copy_`` into the destinations
- ``torch.save`` + fsync / ``torch.load`` + ``copy_``

Save includes fsync of the data. Restore is timed warm (page cache) and cold (after
``posix_fadvise(DONTNEED)`` on the files; no root needed). Peak RSS is reported above the baseline of
a process that already holds the source and destination tensors (touched). Medians of --repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MIB = 1 << 20


def _tensors(size_mib: int, engine_layout: bool) -> tuple[dict[str, Any], dict[str, int]]:
    import torch

    h, d = 8, 128
    per = 32 * MIB
    n = max(1, size_mib * MIB // per)
    t = per // (h * d * 2)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        x = torch.randn((t, h, d), generator=g, dtype=torch.float32).to(torch.bfloat16)
        out[f"layer{i}.kv"] = x.permute(1, 0, 2).unsqueeze(0).contiguous() if engine_layout else x
    return out, ({k: 2 for k in out} if engine_layout else {})


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _drop_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _warm_up_disk(root: str) -> None:
    """Write + fsync 256 MiB once before timing: on this VM the first large write after idle runs
    at a fraction of the disk's speed whatever writes it (raw baselines show it too)."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "warmup")
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(256):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def child(method: str, size_mib: int, root: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    src, token_dims = _tensors(size_mib, method == "snapstore-strided")
    dst = {k: torch.empty_like(v).fill_(0) for k, v in src.items()}
    nbytes = sum(v.numel() * v.element_size() for v in src.values())
    _warm_up_disk(root)
    base = _rss_kib()
    res: dict[str, Any] = {"method": method, "bytes": nbytes}
    if method.startswith("snapstore"):
        import snapstore as ss
        from snapstore.engine import TorchAdapter, layout_of

        layout = layout_of(rows=src, token_dims=token_dims)
        store = ss.Store.open(root, identity=ss.Identity(build="bench", pack="bench"), layout=layout,
                              budget=ss.Budget(disk_bytes=4 * nbytes, ram_bytes=0, reserve_bytes=0))
        ad = TorchAdapter(store, token_dims=token_dims)
        n_tok = next(iter(src.values())).shape[token_dims.get("layer0.kv", 0)]
        toks = list(range(n_tok))
        t0 = time.perf_counter()
        r = ad.save(toks, src)
        res["save_s"] = time.perf_counter() - t0
        assert r.ok, r
        res["rss_save_mib"] = (_rss_kib() - base) / 1024
        m = store.match(toks)
        t0 = time.perf_counter()
        ad.restore(m, dst)
        res["restore_warm_s"] = time.perf_counter() - t0
        _drop_cache(root)
        t0 = time.perf_counter()
        ad.restore(m, dst)
        res["restore_cold_s"] = time.perf_counter() - t0
        store.close()
    elif method == "safetensors":
        from safetensors.torch import load_file, save_file

        path = os.path.join(root, "state.safetensors")
        os.makedirs(root, exist_ok=True)
        t0 = time.perf_counter()
        save_file(src, path)
        _fsync_file(path)
        res["save_s"] = time.perf_counter() - t0
        res["rss_save_mib"] = (_rss_kib() - base) / 1024
        for tag in ("warm", "cold"):
            if tag == "cold":
                _drop_cache(root)
            t0 = time.perf_counter()
            loaded = load_file(path)
            for k, v in loaded.items():
                dst[k].copy_(v)
            del loaded
            res[f"restore_{tag}_s"] = time.perf_counter() - t0
    elif method == "torch.save":
        path = os.path.join(root, "state.pt")
        os.makedirs(root, exist_ok=True)
        t0 = time.perf_counter()
        torch.save(src, path)
        _fsync_file(path)
        res["save_s"] = time.perf_counter() - t0
        res["rss_save_mib"] = (_rss_kib() - base) / 1024
        for tag in ("warm", "cold"):
            if tag == "cold":
                _drop_cache(root)
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            for k, v in loaded.items():
                dst[k].copy_(v)
            del loaded
            res[f"restore_{tag}_s"] = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown method {method}")
    res["rss_peak_mib"] = (_rss_kib() - base) / 1024
    ok = all(torch.equal(dst[k].view(torch.int16), src[k].view(torch.int16)) for k in src)
    res["exact"] = ok
    return res


METHODS = ["snapstore-canonical", "snapstore-strided", "safetensors", "torch.save"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.size_mib, args.child[1])))
        return 0
    scratch = tempfile.mkdtemp(prefix="snapbench-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        for method in METHODS:
            runs = []
            for _ in range(args.repeat):
                root = os.path.join(scratch, method)
                out = subprocess.run([sys.executable, __file__, "--size-mib", str(args.size_mib), "--child", method,
                                      root], capture_output=True, text=True)
                shutil.rmtree(root, ignore_errors=True)
                if out.returncode:
                    print(out.stderr, file=sys.stderr)
                    return 1
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            agg = {"method": method, "bytes": runs[0]["bytes"], "exact": all(r["exact"] for r in runs)}
            for k in ("save_s", "restore_warm_s", "restore_cold_s", "rss_save_mib", "rss_peak_mib"):
                agg[k] = statistics.median(r[k] for r in runs)
            rows.append(agg)
            print(json.dumps(agg), file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gb = rows[0]["bytes"] / 1e9
    print(f"\n{rows[0]['bytes'] / MIB:.0f} MiB of bf16 tensors, medians of {args.repeat}, 2 torch threads\n")
    print("| method | save + fsync | restore warm | restore cold | peak RSS over tensors | exact |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['save_s']:.2f} s ({gb / r['save_s']:.2f} GB/s) "
              f"| {r['restore_warm_s']:.2f} s ({gb / r['restore_warm_s']:.2f} GB/s) "
              f"| {r['restore_cold_s']:.2f} s ({gb / r['restore_cold_s']:.2f} GB/s) "
              f"| {r['rss_peak_mib']:.0f} MiB | {r['exact']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
