"""Restore into paged K/V blocks vs into a contiguous buffer of the same bytes.

    .venv/bin/python benchmarks/bench_paged.py            # 256 MiB of K/V, 5 repeats
    .venv/bin/python benchmarks/bench_paged.py --quick    # 64 MiB, 3 repeats

One snapshot of one row stream (row = 2 x 8 x 128 float16 = 4 KiB, 16 rows per block, so a block
is 64 KiB) is restored, page cache warm, into (a) a contiguous numpy array and (b) the blocks of a
sequence in a pool whose free list is shuffled (``snapstore.PagedRows``), alternating, medians of
``--repeat``; with the RAM tier off (every chunk read from its file) and on (chunks served from
memory after their second restore). The ratio is paged / contiguous throughput. Numbers on a
shared machine move with the neighbours: compare the ratio, not the GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import snapstore

ROW = (2, 8, 128)
BS = 16


def run(mib: int, repeat: int, ram: bool) -> tuple[float, float]:
    """(contiguous GB/s, paged GB/s), medians."""
    row_bytes = int(np.prod(ROW)) * 2
    n = mib * (1 << 20) // row_bytes
    layout = snapstore.Layout(rows={"kv": snapstore.Rows("float16", ROW)})
    ident = snapstore.Identity(build="bench-paged", pack="p")
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 1 << 16, (n, *ROW), dtype=np.uint16).view(np.float16)
    n_blocks = -(-n // BS)
    pool = np.zeros((n_blocks * 2, BS, *ROW), np.float16)
    table = rng.permutation(n_blocks * 2)[:n_blocks]
    flat = np.zeros_like(kv)
    pool[table] = 1  # touch every page first: both destinations are preallocated engine memory
    flat[:] = 1
    budget = snapstore.Budget(ram_bytes=(2 * mib << 20) if ram else 0)
    with tempfile.TemporaryDirectory() as d, snapstore.Store.open(d, identity=ident, layout=layout,
                                                                   budget=budget) as st:
        r = st.save(list(range(n)), {"kv": kv})
        paged = snapstore.PagedRows(pool, table)
        for _ in range(2):  # warm the page cache (and admit the chunks to the RAM tier)
            st.restore(r, into={"kv": flat})
            st.restore(r, into={"kv": paged})
        tc, tp = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            st.restore(r, into={"kv": flat})
            tc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            st.restore(r, into={"kv": paged})
            tp.append(time.perf_counter() - t0)
        got = np.concatenate([pool[b] for b in table])[:n]
        assert got.tobytes() == kv.tobytes() and flat.tobytes() == kv.tobytes()
    nbytes = n * row_bytes
    return nbytes / statistics.median(tc) / 1e9, nbytes / statistics.median(tp) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mib", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=None)
    a = ap.parse_args()
    mib = a.mib or (64 if a.quick else 256)
    repeat = a.repeat or (3 if a.quick else 5)
    print(f"{mib} MiB of K/V, rows of {int(np.prod(ROW)) * 2} B, {BS}-row blocks, medians of {repeat}")
    print(f"{'RAM tier':<10}{'contiguous GB/s':>17}{'paged GB/s':>12}{'paged/contig':>14}")
    for ram in (False, True):
        c, p = run(mib, repeat, ram)
        print(f"{'on' if ram else 'off':<10}{c:>17.2f}{p:>12.2f}{p / c:>14.2f}")


if __name__ == "__main__":
    main()
