"""Restore or recompute (issue 32, part 1): ``Store.estimate_restore`` against the measured restore, per tier.

    .venv/bin/python benchmarks/bench_recompute.py              # 64 MiB snapshots, 5 restores a tier
    .venv/bin/python benchmarks/bench_recompute.py --quick      # 16 MiB, 3 restores

For each tier it can produce on this machine — "cold" (chunk files evicted from the page cache with
POSIX_FADV_DONTNEED), "warm" (read once), "ram" (the store's RAM tier holds every chunk) — it saves
snapshots of ``--mib`` MiB (and a quarter and four times that: the sizes vary, so the model separates
a fixed cost from a rate), restores each a few times, and prints per restore the estimate made just
before it (and whether it was measured or the default guess) next to the measured time, and the
ratio. A fresh store first (guesses), then the same store reopened (the rates kept in the catalog).
The check the issue asks for: once a tier has been seen, every estimate within 2x of the
measurement (``--check`` exits 1 otherwise). The shared tier ("remote") needs a bucket and is not run
here (benchmarks/bench_remote.py has the fleet setup).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import snapstore as ss  # noqa: E402

ROW = 4096
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (ROW,))})
IDENT = ss.Identity(build="bench-recompute", pack="bench", kv="u8", mtp=False)
MIB = 1 << 20


def drop_cache(root: str) -> None:
    """Evict the store's chunk files from the page cache (clean pages go with POSIX_FADV_DONTNEED)."""
    for d, _, files in os.walk(os.path.join(root, "blobs")):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def open_store(path: str, ram: int) -> ss.Store:
    return ss.Store.open(path, identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0, ram_bytes=ram),
                         chunk_bytes=4 * MIB)


def one_tier(s: ss.Store, path: str, tier: str, phase: str, prompts: list[tuple[list[int], int]],
             repeat: int) -> list[float]:
    """Restore each snapshot ``repeat`` times from ``tier``, printing estimate vs measurement; the
    ratios (the larger over the smaller) of the measured estimates."""
    ratios: list[float] = []
    for toks, n in prompts:
        dest = {"kv": np.empty((n, ROW), np.uint8)}
        m = s.match(toks)
        assert m is not None
        for _ in range(repeat):
            if tier == "cold":
                drop_cache(path)
            elif tier == "ram":
                for _ in range(50):  # a chunk is admitted at its second sighting, in the background
                    if set(s.estimate_restore(m).tiers) == {"ram"}:
                        break
                    s.restore(m, dest)
                    time.sleep(0.02)
            else:
                s.restore(m, dest)  # read once: in the page cache
            e = s.estimate_restore(m)
            t0 = time.perf_counter()
            s.restore(m, dest)
            took = time.perf_counter() - t0
            seen = "/".join(sorted(e.tiers))
            ratio = max(e.seconds / took, took / e.seconds)
            if e.measured:
                ratios.append(ratio)
            print(f"{phase:<9} {seen:<5} {n * ROW // MIB:>5} {e.seconds * 1e3:>12.2f} "
                  f"{'measured' if e.measured else 'guess':<8} {took * 1e3:>12.2f} {ratio:>6.2f}", flush=True)
    return ratios


def run(args: argparse.Namespace) -> int:
    root = tempfile.mkdtemp(prefix="bench-recompute-", dir=args.dir)
    path = os.path.join(root, "s")
    sizes = [args.mib // 4, args.mib, args.mib * 4]
    ram = sum(sizes) * MIB * 3  # room for every chunk in the RAM tier (and its admission's slack)
    rng = np.random.default_rng(0)
    prompts: list[tuple[list[int], int]] = []
    with open_store(path, ram) as s:
        for k, mib in enumerate(sizes):
            n = mib * MIB // ROW
            toks = [k + 1] + list(range(1000 + k * 10_000_000, 1000 + k * 10_000_000 + n - 1))
            s.save(toks, {"kv": rng.integers(0, 255, (n, ROW), dtype=np.uint8)})
            prompts.append((toks, n))
    print(f"# {platform.node()} {platform.machine()} python {platform.python_version()}; snapshots of "
          f"{', '.join(f'{m} MiB' for m in sizes)}; {args.repeat} restores a tier and size")
    print(f"{'pass':<9} {'tier':<5} {'MiB':>5} {'estimate ms':>12} {'kind':<8} {'measured ms':>12} {'ratio':>6}")
    ratios: dict[str, list[float]] = {}
    for phase in ("fresh", "reopened"):  # reopened: the first pass's rates, from the catalog
        for tier in ("cold", "warm", "ram"):
            with open_store(path, ram if tier == "ram" else 0) as s:  # no RAM tier: cold and warm are the disk's
                ratios.setdefault(tier, []).extend(one_tier(s, path, tier, phase, prompts, args.repeat))
                rates = s.stats().restore_rates
        print("# rates (GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(rates.items())))
    shutil.rmtree(root, ignore_errors=True)
    print("# measured estimates vs measurements (the target: within 2x):")
    for tier, rs in ratios.items():
        rs.sort()
        print(f"#   {tier}: {len(rs)} restores, median {rs[len(rs) // 2]:.2f}x, within 2x: "
              f"{sum(r <= 2.0 for r in rs) / len(rs):.0%}, worst {rs[-1]:.2f}x")
    worst = max(max(rs) for rs in ratios.values())
    return 1 if args.check and worst > 2.0 else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="the middle snapshot's size (MiB)")
    p.add_argument("--repeat", type=int, default=5, help="restores a tier and size")
    p.add_argument("--quick", action="store_true", help="16 MiB, 3 restores")
    p.add_argument("--dir", default=None, help="where the store goes (default: the temp dir)")
    p.add_argument("--check", action="store_true", help="exit 1 if a measured estimate is off by more than 2x")
    args = p.parse_args()
    if args.quick:
        args.mib, args.repeat = 16, 3
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
