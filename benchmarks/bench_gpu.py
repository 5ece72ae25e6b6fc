"""GPU benchmark: snapstore save / restore of CUDA tensors against the pinned PCIe bandwidth.

    python benchmarks/bench_gpu.py [--size-mib 1024] [--repeat 5] [--json out.json] [--dir DIR]

Prepared for a device session (``scripts/gpu_check.sh`` runs it); without CUDA it prints one
line and exits 0. One bf16 state (K/V rows of 48 x 2 x 8 x 128 = 192 KiB per token plus an 8 MiB
fixed part; ``--size-mib`` in all, default 1 GiB) lives on the GPU. In each of ``--repeat``
rounds, interleaved so ratios compare like with like, it measures:

- pinned host->device and device->host bandwidth (``copy_(non_blocking=True)`` between the GPU
  tensors and one page-locked host buffer of the same bytes, then ``synchronize``): the baseline;
- a raw cold read of the same bytes from one file into the pinned buffer (what the disk gives);
- ``TorchAdapter.save`` from the CUDA tensors into a fresh store (durable: fsynced, committed),
  and ``TorchAdapter.save_async`` into another (timed until the handle returns, i.e. the
  device->host copies are done, and until the write is durable);
- ``TorchAdapter.restore`` into preallocated CUDA tensors, cold (posix_fadvise DONTNEED on every
  chunk file first) and warm (page cache), each checked bit-exact on the device.

Then, warm, alternating, it restores the K/V rows into a paged CUDA pool
(``snapstore.engine.TorchPagedRows`` over a shuffled block table, 16-row blocks) and into a
contiguous CUDA tensor. Figures are medians; ratios are against the pinned bandwidth of the
direction (restore: host->device, save: device->host); the target is >= 0.8x warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench import blob_files, drop_cache, gbps  # noqa: E402  (the one copy of these helpers)

MIB = 1 << 20
ROW_SHAPE = (48, 2, 8, 128)  # layers x K/V x KV heads x head dim, bf16: 192 KiB per token
ROW_BYTES = 48 * 2 * 8 * 128 * 2
FIXED_BYTES = 8 * MIB  # the fixed part (recurrent / running state), bf16
BLOCK = 16  # rows per block of the paged pool
TARGET = 0.8


def no_cuda_reason() -> str | None:
    """Why there is nothing to measure here (None when torch sees a CUDA device)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per figure (median; default 5)")
    ap.add_argument("--dir", default=os.environ.get("SNAPSTORE_BENCH_DIR", tempfile.gettempdir()),
                    help="work directory on the local disk the store would use (default $SNAPSTORE_BENCH_DIR or /tmp)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()
    why = no_cuda_reason()
    if why is not None:
        print(f"bench_gpu: no CUDA ({why}); nothing measured")
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Every measurement (CUDA present); returns the exit status."""
    import torch

    import snapstore
    from snapstore import Budget, Fixed, Identity, Layout, Rows, Store
    from snapstore.engine import TorchAdapter, TorchPagedRows

    dev = torch.device("cuda")
    reps = args.repeat
    tokens_n = (args.size_mib * MIB - FIXED_BYTES) // ROW_BYTES
    if tokens_n < BLOCK:
        raise SystemExit(f"--size-mib {args.size_mib} is too small: the fixed part alone is {FIXED_BYTES // MIB} MiB")
    kv_bytes, nbytes = tokens_n * ROW_BYTES, tokens_n * ROW_BYTES + FIXED_BYTES
    layout = Layout(fixed={"fixed": Fixed("bfloat16", (FIXED_BYTES // 2,))},
                    rows={"kv": Rows("bfloat16", ROW_SHAPE)})
    ident = Identity(build="bench-gpu", pack="kv-48L-bf16", kv="bf16")
    budget = Budget(ram_bytes=0, disk_bytes=8 * nbytes + (1 << 30), reserve_bytes=256 * MIB)

    g = torch.Generator(device=dev).manual_seed(0)

    def rand_bf16(*shape: int) -> torch.Tensor:
        # random bit patterns (incompressible, NaN payloads included): the copies must be bit-exact
        return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=dev, generator=g).view(
            torch.bfloat16)

    kv = rand_bf16(tokens_n, *ROW_SHAPE)
    fixed = rand_bf16(FIXED_BYTES // 2)
    dst_kv = torch.ones_like(kv)  # preallocated, touched: an engine's own memory
    dst_fixed = torch.ones_like(fixed)
    tokens = np.arange(tokens_n, dtype=np.int64)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pin_kv = pinned[:kv_bytes].view(torch.bfloat16).view(kv.shape)
    pin_fixed = pinned[kv_bytes:].view(torch.bfloat16)
    pinned.fill_(1)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))

    def check() -> None:
        if not (same(dst_kv, kv) and same(dst_fixed, fixed)):
            raise SystemExit("bench_gpu: restore mismatch (the restored CUDA tensors differ from the saved ones)")
        dst_kv[:1].fill_(0)  # so the next restore must really write
        dst_fixed[:1024].fill_(0)
        torch.cuda.synchronize()

    def timed(fn: Callable[[], Any]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def h2d() -> None:
        dst_kv.copy_(pin_kv, non_blocking=True)
        dst_fixed.copy_(pin_fixed, non_blocking=True)

    def d2h() -> None:
        pin_kv.copy_(kv, non_blocking=True)
        pin_fixed.copy_(fixed, non_blocking=True)

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir)
    t: dict[str, list[float]] = {k: [] for k in (
        "pinned_h2d", "pinned_d2h", "raw_read_cold", "save", "save_async_return", "save_async_durable",
        "restore_cold", "restore_warm", "restore_contiguous_kv", "restore_paged_kv")}
    name = torch.cuda.get_device_name(dev)
    print(f"snapstore {snapstore.__version__} GPU benchmark | {name}, torch {torch.__version__}, "
          f"python {platform.python_version()} | work dir {work}")
    print(f"state: {nbytes / MIB:.0f} MiB bf16 on {dev} ({tokens_n} tokens x {ROW_BYTES // 1024} KiB K/V rows + "
          f"{FIXED_BYTES // MIB} MiB fixed), medians of {reps}")
    t_start = time.perf_counter()
    try:
        h2d()  # warm-up: first-touch and driver set-up costs stay out of the figures
        d2h()
        torch.cuda.synchronize()
        raw = os.path.join(work, "raw.bin")
        with open(raw, "wb") as f:
            f.write(memoryview(pinned.numpy()))
            f.flush()
            os.fsync(f.fileno())
        sid: Any = None
        sdir = ""
        for r in range(reps):
            t["pinned_h2d"].append(timed(h2d))
            t["pinned_d2h"].append(timed(d2h))
            drop_cache([raw])
            t["raw_read_cold"].append(timed(lambda: _read_file(raw, pinned.numpy())))
            sdir = os.path.join(work, f"store{r}")
            with Store.open(sdir, identity=ident, layout=layout, budget=budget,
                            async_copy_bytes=2 * nbytes) as st:
                ad = TorchAdapter(st)
                res: Any = None

                def save(ad: TorchAdapter = ad) -> None:
                    nonlocal res
                    res = ad.save(tokens, {"kv": kv, "fixed": fixed}, parent=None)

                t["save"].append(timed(save))
                assert res.ok, res
                sid = res.snapshot_id
                drop_cache(blob_files(sdir))
                t["restore_cold"].append(timed(lambda ad=ad: ad.restore(sid, {"kv": dst_kv, "fixed": dst_fixed})))
                check()
                t["restore_warm"].append(timed(lambda ad=ad: ad.restore(sid, {"kv": dst_kv, "fixed": dst_fixed})))
                check()
                ad.close()
            adir = os.path.join(work, f"async{r}")
            with Store.open(adir, identity=ident, layout=layout, budget=budget,
                            async_copy_bytes=2 * nbytes) as st:
                ad = TorchAdapter(st)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                handle = ad.save_async(tokens, {"kv": kv, "fixed": fixed}, parent=None)
                t["save_async_return"].append(time.perf_counter() - t0)
                ares = handle.result()
                t["save_async_durable"].append(time.perf_counter() - t0)
                assert ares.ok, ares
                ad.close()
            shutil.rmtree(adir)
            if r < reps - 1:
                shutil.rmtree(sdir)
        # paged pool vs contiguous tensor, same snapshot, page cache warm, alternating
        n_blocks = -(-tokens_n // BLOCK)
        pool = torch.ones((2 * n_blocks, BLOCK, *ROW_SHAPE), dtype=torch.bfloat16, device=dev)
        table = torch.randperm(2 * n_blocks, generator=torch.Generator().manual_seed(1))[:n_blocks]
        with Store.open(sdir, identity=ident, layout=layout, budget=budget) as st:
            ad = TorchAdapter(st)
            paged = TorchPagedRows(pool, table)
            for _ in range(2):  # warm
                ad.restore(sid, {"kv": paged, "fixed": dst_fixed})
                ad.restore(sid, {"kv": dst_kv, "fixed": dst_fixed})
            for _ in range(reps):
                t["restore_contiguous_kv"].append(timed(lambda ad=ad: ad.restore(sid, {"kv": dst_kv,
                                                                                      "fixed": dst_fixed})))
                t["restore_paged_kv"].append(timed(lambda ad=ad, p=paged: ad.restore(sid, {"kv": p,
                                                                                          "fixed": dst_fixed})))
            check()
            got = pool[table.to(dev)].reshape(-1, *ROW_SHAPE)[:tokens_n]
            if not same(got, kv):
                raise SystemExit("bench_gpu: paged restore mismatch (the pool's blocks differ from the saved rows)")
            ad.close()
        del pool
    finally:
        shutil.rmtree(work, ignore_errors=True)

    m = {k: gbps(nbytes, statistics.median(v)) for k, v in t.items() if v}
    ratios = {
        "restore_warm": m["restore_warm"] / m["pinned_h2d"],
        "restore_cold": m["restore_cold"] / m["pinned_h2d"],
        "save": m["save"] / m["pinned_d2h"],
        "save_async_return": m["save_async_return"] / m["pinned_d2h"],
        "save_async_durable": m["save_async_durable"] / m["pinned_d2h"],
        "raw_read_cold": m["raw_read_cold"] / m["pinned_h2d"],
        "restore_cold_vs_raw_cold": m["restore_cold"] / m["raw_read_cold"],
        "paged_vs_contiguous": m["restore_paged_kv"] / m["restore_contiguous_kv"],
    }
    rows = [
        ("pinned host->device (copy_ + sync)", "pinned_h2d", None),
        ("pinned device->host (copy_ + sync)", "pinned_d2h", None),
        ("raw file read, cold -> pinned", "raw_read_cold", "raw_read_cold"),
        ("restore -> CUDA, warm", "restore_warm", "restore_warm"),
        ("restore -> CUDA, cold (fadvise)", "restore_cold", "restore_cold"),
        ("save from CUDA, durable", "save", "save"),
        ("save_async from CUDA, until return", "save_async_return", "save_async_return"),
        ("save_async from CUDA, until durable", "save_async_durable", "save_async_durable"),
        ("restore -> contiguous CUDA tensor", "restore_contiguous_kv", None),
        ("restore -> paged CUDA pool", "restore_paged_kv", "paged_vs_contiguous"),
    ]
    print(f"\n{'':38}{'GB/s':>7}  {'ratio':>6}  min..max GB/s")
    for label, k, rk in rows:
        rates = sorted(gbps(nbytes, x) for x in t[k])
        ratio = f"{ratios[rk]:6.2f}" if rk else " " * 6
        print(f"{label:38}{m[k]:7.2f}  {ratio}  [{rates[0]:.2f}..{rates[-1]:.2f}]")
    print("ratio: vs the pinned bandwidth of that direction (restore: host->device, save: device->host); "
          f"paged: vs contiguous. Target >= {TARGET}x.")
    held = {k: ratios[k] >= TARGET for k in ("restore_warm", "restore_cold", "save", "save_async_return",
                                              "paged_vs_contiguous")}
    print("targets: " + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in held.items())
          + f" (cold restore vs the raw cold read: {ratios['restore_cold_vs_raw_cold']:.2f}x)")
    print(f"(total {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        out = {"device": name, "torch": torch.__version__, "snapstore": snapstore.__version__,
               "bytes": nbytes, "tokens": tokens_n, "repeat": reps, "GBps": m, "ratios": ratios,
               "target": TARGET, "targets_met": held, "seconds": t}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _read_file(path: str, out: np.ndarray) -> None:
    """Read the whole file into ``out`` (a uint8 array of its size)."""
    mv = memoryview(out).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], done)
            if n <= 0:
                raise SystemExit(f"bench_gpu: short read of {path}")
            done += n
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
