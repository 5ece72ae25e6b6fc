"""The shared tier against a real loopback SeaweedFS (two volume servers), one run, side by side.

  * fetch: node B pulls a chain from the bucket into its local tier (every chunk verified) vs a raw
    GET of the same objects with the same client (obstore), same parallelism;
  * stream: node B restores the chain straight from the bucket into its buffers
    (``SNAPSTORE_REMOTE_RESTORE=stream``, every chunk checked, nothing written locally), same yardstick;
  * time to a restored prefix on node B (match + fetch + restore) vs re-prefill (given as
    --prefill-tps tokens/s, default 1300: ~26 s for a 34K-token prompt on a consumer GPU);
  * the saving node's save() latency without a shared tier, with background upload (the
    default) and with remote_wait=True.

``.venv/bin/python benchmarks/bench_remote.py [--quick] [--json]``. Figures: docs/benchmarks.md.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3_fixtures import SeaweedCluster  # noqa: E402

import snapstore  # noqa: E402
from snapstore._remote_keys import LAYOUT as KEYS  # noqa: E402
from snapstore._s3client import S3Client  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a 64 MiB chain instead of 512 MiB")
    ap.add_argument("--prefill-tps", type=float, default=1300.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    mib = 64 if a.quick else 512
    row_bytes = 2 * 8 * 128 * 2  # attn.kv float16 (2, 8, 128)
    n = mib * (1 << 20) // row_bytes
    layout = snapstore.Layout(fixed={"st": snapstore.Fixed("float32", (16, 128))},
                              rows={"kv": snapstore.Rows("float16", (2, 8, 128))})
    ident = snapstore.Identity(build="bench", pack="sha256:bench")
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((n, 2, 8, 128)).astype(np.float16)
    st = rng.standard_normal((16, 128)).astype(np.float32)
    tokens = rng.integers(0, 50_000, n)
    bounds = [n // 4, n // 2, 3 * n // 4, n]
    cluster = SeaweedCluster().start()
    tmp = tempfile.mkdtemp(prefix="bench-remote-")
    out: dict[str, Any] = {"chain_mib": mib, "tokens": n, "links": len(bounds)}
    try:
        os.environ.update(cluster.env())
        cluster.create_bucket("bench")
        url = "s3://bench/b1"
        chunk = 8 << 20 if a.quick else 32 << 20
        kw = {"chunk_bytes": chunk, "budget": snapstore.Budget(disk_bytes=4 << 30, ram_bytes=0, reserve_bytes=0)}
        # -- save latency: no tier, background upload, wait mode (fresh stores, a fresh prefix each)
        lat: dict[str, float] = {}
        small = n // 8
        for mode, extra in (("local only", {}), ("background upload", {"remote": url}),
                            ("remote_wait=True", {"remote": url + "w", "remote_wait": True})):
            times = []
            for rep in range(3):
                s = snapstore.Store.open(os.path.join(tmp, f"lat-{mode[:4]}-{rep}"), identity=ident, layout=layout,
                                         **kw, **extra)  # type: ignore[arg-type]
                toks = tokens[:small].copy()
                toks[0] = 60_000 + rep  # a new prompt (and new state) each time: nothing deduplicates
                fresh = kv[:small] + np.float16(rep + 1)
                t = time.perf_counter()
                s.save(toks, {"st": st + rep, "kv": fresh}, rows=small)
                times.append(time.perf_counter() - t)
                s.flush()
                s.close()
            lat[mode] = statistics.median(times)
        out["save_latency_s"] = {k: round(v, 4) for k, v in lat.items()}
        out["save_mib"] = small * row_bytes / 2**20
        # -- node A saves the chain and uploads it
        A = snapstore.Store.open(os.path.join(tmp, "a"), identity=ident, layout=layout, remote=url, **kw)
        for i, b in enumerate(bounds):
            A.save(tokens[:b], {"st": st + i, "kv": kv}, rows=b)
        t = time.perf_counter()
        A.flush()
        out["upload_flush_s"] = round(time.perf_counter() - t, 3)
        A.close()
        # -- raw GET of the same objects, same client, same parallelism (4)
        client = S3Client(url)
        objs = [i for i in client.list(f"{KEYS}/c/")]
        total = sum(i.size for i in objs)

        def get(key: str) -> int:
            got = client.stream(key)
            assert got is not None
            return sum(len(p) for p in got[1])

        raw = []
        for _ in range(3):
            with ThreadPoolExecutor(4) as pool:
                t = time.perf_counter()
                assert sum(pool.map(get, [o.key for o in objs])) == total
                raw.append(time.perf_counter() - t)
        # -- node B: match + fetch (verified, into its local tier) + restore, three fresh nodes
        fetch, restore_t, first = [], [], []
        dest_kv = np.zeros_like(kv)
        dest_st = np.zeros_like(st)
        for rep in range(3):
            B = snapstore.Store.open(os.path.join(tmp, f"b{rep}"), identity=ident, layout=layout, remote=url, **kw)
            t0 = time.perf_counter()
            m = B.match(tokens)
            assert m is not None and m.n_tokens == n
            t1 = time.perf_counter()
            local = B._remote.materialize(m, lambda c, fr: B._capacity.excess(c) is None, B._iid)  # noqa: SLF001
            t2 = time.perf_counter()
            B.restore(local, {"st": dest_st, "kv": dest_kv})
            t3 = time.perf_counter()
            assert np.array_equal(dest_kv, kv), "kv"
            assert np.array_equal(dest_st, st + (len(bounds) - 1)), ("st", dest_st[0, :4], st[0, :4])
            fetch.append(t2 - t1)
            restore_t.append(t3 - t2)
            first.append(t3 - t0)
            B.close()
        # -- node B streaming (SNAPSTORE_REMOTE_RESTORE=stream): match + restore straight from the bucket
        stream, stream_first = [], []
        os.environ["SNAPSTORE_REMOTE_RESTORE"] = "stream"
        try:
            for rep in range(3):
                B = snapstore.Store.open(os.path.join(tmp, f"s{rep}"), identity=ident, layout=layout, remote=url,
                                         **kw)  # type: ignore[arg-type]
                dest_kv[:] = 0
                t0 = time.perf_counter()
                m = B.match(tokens)
                assert m is not None and m.n_tokens == n
                t1 = time.perf_counter()
                B.restore(m, {"st": dest_st, "kv": dest_kv})
                t2 = time.perf_counter()
                assert np.array_equal(dest_kv, kv), "kv (streamed)"
                assert B.snapshots() == []
                stream.append(t2 - t1)
                stream_first.append(t2 - t0)
                B.close()
        finally:
            del os.environ["SNAPSTORE_REMOTE_RESTORE"]
        # the raw GET again after both, so a drift of the machine's load shows in the pair
        for _ in range(2):
            with ThreadPoolExecutor(4) as pool:
                t = time.perf_counter()
                assert sum(pool.map(get, [o.key for o in objs])) == total
                raw.append(time.perf_counter() - t)
        raw_s, fetch_s, stream_s = statistics.median(raw), statistics.median(fetch), statistics.median(stream)
        out.update({
            "bucket_bytes": total, "raw_get_gbps": round(total / raw_s / 1e9, 3),
            "raw_get_runs_s": [round(x, 3) for x in raw],
            "fetch_gbps": round(total / fetch_s / 1e9, 3), "fetch_vs_raw_get": round(raw_s / fetch_s, 3),
            "stream_gbps": round(total / stream_s / 1e9, 3), "stream_vs_raw_get": round(raw_s / stream_s, 3),
            "node_b_match_stream_s": round(statistics.median(stream_first), 3),
            "node_b_match_fetch_restore_s": round(statistics.median(first), 3),
            "node_b_local_restore_s": round(statistics.median(restore_t), 3),
            "reprefill_s": round(n / a.prefill_tps, 1),
        })
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"chain of {out['links']} links, {mib} MiB, {n} tokens; SeaweedFS on loopback, obstore client")
    print(f"  raw GET (4 streams)           {out['raw_get_gbps']:.3f} GB/s")
    print(f"  fetch into local tier (4)     {out['fetch_gbps']:.3f} GB/s  = {out['fetch_vs_raw_get']:.2f}x raw GET")
    print(f"  restore streamed from bucket  {out['stream_gbps']:.3f} GB/s  = {out['stream_vs_raw_get']:.2f}x raw GET")
    print(f"  node B match+stream restore   {out['node_b_match_stream_s']:.2f} s")
    print(f"  node B next restore (local)   {out['node_b_local_restore_s']:.3f} s")
    print(f"  node B match+fetch+restore    {out['node_b_match_fetch_restore_s']:.2f} s "
          f"(re-prefill at {a.prefill_tps:.0f} tok/s: {out['reprefill_s']:.1f} s)")
    print(f"  save() of {out['save_mib']:.0f} MiB: " + ", ".join(f"{k} {v * 1000:.0f} ms"
                                                            for k, v in out["save_latency_s"].items()))


if __name__ == "__main__":
    main()
