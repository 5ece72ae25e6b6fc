"""What the vLLM connector's per-request calls cost, counted (issue 31): no timing noise.

The connector-shaped case outside vLLM: the tiny Llama's blocks (one 32-token block a row, 2 layers
x 16 KiB), four 2,976-token prompts each saved as a 12-link chain (a link every 256 tokens, as the
connector saves), then per call — ``Store.lookup``, ``Store.lookup(prefill_tokens_per_s=)`` (the
scheduler once it measured vLLM's prefill rate) and ``Store.restore`` into a ``BlockWriter`` (the
worker's load, in a burst) — SQL statements (apsw's profile hook), write transactions, mincore
probes of chunk files, and Python function calls (cProfile's count: deterministic, unlike times).
Times of the same calls are printed too, medians of 200 (these move with the machine).

``python benchmarks/bench_connector_calls.py [TREE]``: TREE (default: this checkout) is a source
tree whose ``snapstore`` and ``engine`` are measured — an older checkout gives the "before" column.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else HERE
import torch  # noqa: E402  (before the tree's paths: its engine/ holds a package named torch too)

sys.path[:0] = [TREE]
try:
    from snapstore.engine.vllm._blocks import BlockGeometry, BlockWriter, gather_blocks, host_pools  # noqa: E402
except ImportError:  # a tree from before the integrations moved under engine/ (issue 51)
    sys.path.insert(1, os.path.join(TREE, "engine"))
    from vllm._blocks import BlockGeometry, BlockWriter, gather_blocks, host_pools  # type: ignore[no-redef]  # noqa: E402

import snapstore as ss  # noqa: E402

TOKENS = 2976


def counted(store: Any, fn: Callable[[], object]) -> tuple[int, int, int, int]:
    """(SQL statements, write transactions, mincore probes, Python function calls) of one call."""
    from snapstore.restore import stream
    from snapstore.restore import tier_probe as tiers

    stmts: list[str] = []
    probes = [0]
    mods = [m for m in (tiers, stream) if hasattr(m, "resident")]
    real = [m.resident for m in mods]

    def probe(*a: Any, _real: Any = real[0]) -> bool:
        probes[0] += 1
        return bool(_real(*a))

    conn = store._repo.db.conn()
    conn.set_profile(lambda sql, _ns: stmts.append(sql))
    for m in mods:
        m.resident = probe
    prof = cProfile.Profile()
    try:
        prof.enable()
        fn()
        prof.disable()
    finally:
        for m, r in zip(mods, real):
            m.resident = r
        conn.set_profile(None)
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]
    return len(stmts), sum(s.startswith("BEGIN IMMEDIATE") for s in stmts), probes[0], calls


def main() -> None:
    geo = BlockGeometry(layers=2, kv_heads=2, block_size=32, entry=64, dtype=torch.float32)
    ident = geo.identity(build="bench", pack="tiny-llama", kv="float32", backend="cpu", tp=(0, 1))
    pools = host_pools([torch.randn(400, 2, 32, 64) for _ in range(2)], geo)
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 512) for _ in range(3000)] for _ in range(4)]
    work = tempfile.mkdtemp(prefix="bench-connector-")
    path = os.path.join(work, "s")
    try:
        with ss.Store.open(path, identity=ident, layout=geo.layout()) as s:
            for i, p in enumerate(prompts):
                rows = gather_blocks(pools, list(range(i * 93, i * 93 + 93)))
                parent: str | None = None
                for b in [*range(256, TOKENS, 256), TOKENS]:
                    s.save(p[:b], {"kv": rows}, rows=b // 32, parent=parent)
                    parent = "auto"
        with ss.Store.open(path, identity=ident, layout=geo.layout(), budget=ss.Budget(ram_bytes=0)) as s:
            q = prompts[1][:TOKENS]
            d = s.lookup(q)
            assert d is not None and d.n_tokens == TOKENS
            m = ss.Match(d.snapshot_id, d.n_tokens)
            calls: dict[str, Callable[[], object]] = {
                "lookup": lambda: s.lookup(q),
                "lookup(prefill_tokens_per_s=60000)": lambda: s.lookup(q, prefill_tokens_per_s=60000.0),
                "restore into a BlockWriter": lambda: s.restore(m, into={"kv": BlockWriter(pools, range(100, 193))}),
            }
            for fn in calls.values():
                fn()
            print(f"snapstore from {TREE}; {TOKENS} tokens, 12 links, page cache, RAM tier off")
            print(f"{'call':36} {'SQL':>4} {'writes':>6} {'probes':>6} {'py calls':>8} {'p50 us':>7}")
            for name, fn in calls.items():
                n_sql, writes, probes, py = counted(s, fn)
                ts = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                print(f"{name:36} {n_sql:4} {writes:6} {probes:6} {py:8} {statistics.median(ts) * 1e6:7.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
