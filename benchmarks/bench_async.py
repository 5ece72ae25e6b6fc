"""Engine-visible latency of an asynchronous boundary save, by context length (issue 30, item 1).

    .venv/bin/python benchmarks/bench_async.py            # 1K, 8K, 32K tokens, 7 turns each
    .venv/bin/python benchmarks/bench_async.py --quick    # 1K, 8K, 3 turns

A paged engine (one row stream of 16 KiB a token in a shuffled block pool, read through
``snapstore.PagedRows``, so nothing is read in place later; a 64 KiB fixed part) holds a context
of N tokens whose boundary [0, N) is saved. Each turn adds 64 tokens and saves the new boundary
with ``save(..., wait=False)``; the figure is how long that call holds the engine's thread
(median over the turns), with ``copied_bytes``:

- ``auto``: ``parent="auto"`` after the previous save finished (one catalog read at the call);
- ``handle``: ``parent=<previous SaveHandle>``, the previous save still in flight;
- ``whole``: ``parent=None``, the whole sequence — what every async save over a parent copied
  before issue 30.

The first two must not grow with N; the third does.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import snapstore

ROW = (2, 8, 512)  # float16: 16 KiB a token
BS = 16
STEP = 64


def run(n: int, turns: int, mode: str, root: str) -> tuple[float, int]:
    """(median seconds the save call took, copied bytes of the last call)."""
    layout = snapstore.Layout(fixed={"rec": snapstore.Fixed("float32", (16384,))},
                              rows={"kv": snapstore.Rows("float16", ROW)})
    ident = snapstore.Identity(build="bench-async", pack="sha256:0", kv="f16")
    total = n + STEP * turns
    blocks = -(-total // BS)
    rng = np.random.default_rng(n)
    pool = rng.integers(0, 2**16, (blocks + 8, BS, *ROW), dtype=np.uint16).view(np.float16)
    table = rng.permutation(blocks + 8)[:blocks]
    tokens = np.arange(total, dtype="<u8") + 7
    rec = np.zeros(16384, dtype=np.float32)
    times: list[float] = []
    copied = 0
    with snapstore.Store.open(tempfile.mkdtemp(dir=root), identity=ident, layout=layout,
                              async_copy_bytes=4 << 30) as s:
        prev: object = s.save(tokens[:n], {"kv": snapstore.PagedRows(pool, table), "rec": rec}, parent=None)
        for t in range(1, turns + 1):
            m = n + STEP * t
            rec[:] = t  # the next decode step overwrites the fixed part
            parts = {"kv": snapstore.PagedRows(pool, table), "rec": rec}
            parent = {"auto": "auto", "handle": prev, "whole": None}[mode]
            t0 = time.perf_counter()
            h = s.save(tokens[:m], parts, parent=parent, wait=False)
            times.append(time.perf_counter() - t0)
            copied = h.copied_bytes
            if mode == "handle":
                prev = h  # the next turn chains on it while it is in flight
            else:
                assert h.result().ok
        s.flush()
    return statistics.median(times), copied


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    args = ap.parse_args()
    sizes = [1024, 8192] if args.quick else [1024, 8192, 32768]
    turns = 3 if args.quick else 7
    print(f"{'context':>8} {'mode':>7} {'call ms':>9} {'copied':>12}")
    for n in sizes:
        for mode in ("auto", "handle", "whole"):
            sec, copied = run(n, turns, mode, args.dir or tempfile.gettempdir())
            print(f"{n:>8} {mode:>7} {sec * 1e3:>9.2f} {copied:>12,}")


if __name__ == "__main__":
    main()
