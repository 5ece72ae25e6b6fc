"""The shared tier against a real loopback SeaweedFS (two volume servers), one run, side by side.

  * tee (the default restore): node B reads the chain from the bucket, each chunk checked whole
    before it is copied into its buffers, and returns; the chain is imported into its local tier
    in the background (timed until ``flush()`` returns); the next restore of the prompt is local;
  * fetch (``SNAPSTORE_REMOTE_RESTORE=fetch``): node B pulls the chain into its local tier (every
    chunk verified, written, fsynced), then restores locally;
  * stream: node B restores the chain straight from the bucket into its buffers
    (``SNAPSTORE_REMOTE_RESTORE=stream``, every chunk checked, nothing written locally);
  * each of the three vs a raw GET of the same objects with the same client (obstore), same
    parallelism, in rounds (``--rounds``, medians);
  * time to a restored prefix on node B (match + restore, per mode) vs re-prefill (given as
    --prefill-tps tokens/s, default 1300: ~26 s for a 34K-token prompt on a consumer GPU);
  * the saving node's save() latency without a shared tier, with background upload (the
    default) and with remote_wait=True.

``.venv/bin/python benchmarks/bench_remote.py [--quick] [--rounds N] [--json]``. Figures: docs/benchmarks.md.
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
from snapstore.remote.keys import LAYOUT as KEYS  # noqa: E402
from snapstore.remote.s3client import S3Client  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a 64 MiB chain instead of 512 MiB")
    ap.add_argument("--prefill-tps", type=float, default=1300.0)
    ap.add_argument("--rounds", type=int, default=7, help="rounds of raw GET, tee, fetch, stream (medians)")
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
    for attempt in range(3):  # a loaded machine can take a minute; a stuck start goes again on fresh ports
        try:
            cluster = SeaweedCluster().start(timeout=120.0)
            break
        except TimeoutError:
            if attempt == 2:
                raise
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
        for mode, extra in (("local only", {}), ("background upload", {"remote": url + "lat"}),
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
        A = snapstore.Store.open(os.path.join(tmp, "a"), identity=ident, layout=layout, remote=url, **kw)  # type: ignore[arg-type]
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

        dest_kv = np.zeros_like(kv)
        dest_st = np.zeros_like(st)

        def node_b(rep: int, mode: str) -> dict[str, float]:
            """A fresh node B: s per byte read from the bucket, match-to-restored s, the next restore's s
            (local for tee and fetch), the background import's s (tee)."""
            os.environ["SNAPSTORE_REMOTE_RESTORE"] = mode
            B = snapstore.Store.open(os.path.join(tmp, f"{mode}{rep}"), identity=ident, layout=layout, remote=url,
                                     **kw)  # type: ignore[arg-type]
            try:
                dest_kv[:] = 0
                t0 = time.perf_counter()
                m = B.match(tokens)
                assert m is not None and m.n_tokens == n
                t1 = time.perf_counter()
                if mode == "fetch":  # fetch (verified, into the local tier), then the local restore
                    local = B._tiers.shared.materialize(m, lambda c, fr: B._capacity.excess(c) is None,  # noqa: SLF001
                                                        B._access.iid, layout)  # noqa: SLF001
                    t2 = time.perf_counter()
                    B.restore(local, {"st": dest_st, "kv": dest_kv})
                    t3 = time.perf_counter()
                    read, t_read, t_prefix, t_import = B.stats().remote["fetched_bytes"], t2 - t1, t3 - t0, 0.0
                else:  # tee (the default: from memory, imported in the background) or stream (never imported)
                    B.restore(m, {"st": dest_st, "kv": dest_kv})
                    t2 = time.perf_counter()
                    read, t_read, t_prefix = B.stats().remote["fetched_bytes"], t2 - t1, t2 - t0
                    assert B.flush().ok
                    t_import = time.perf_counter() - t2
                assert np.array_equal(dest_kv, kv), mode
                assert np.array_equal(dest_st, st + (len(bounds) - 1)), mode
                # the next request for the prompt on node B: local after tee and fetch, streamed again after stream
                again = B.match(tokens)
                assert again is not None and (type(again).__name__ == "Match") == (mode != "stream"), mode
                dest_kv[:] = 0
                t4 = time.perf_counter()
                B.restore(again, {"st": dest_st, "kv": dest_kv})
                t_next = time.perf_counter() - t4
                assert np.array_equal(dest_kv, kv), mode
                if mode == "stream":
                    assert B.snapshots() == []
                return {"per_byte": t_read / read, "to_prefix": t_prefix, "next": t_next, "import": t_import}
            finally:
                B.close()
                del os.environ["SNAPSTORE_REMOTE_RESTORE"]

        # rounds of (raw GET, tee, fetch, stream): the four see the same load drift
        raw: list[float] = []
        got: dict[str, list[dict[str, float]]] = {"tee": [], "fetch": [], "stream": []}
        for rep in range(a.rounds):
            with ThreadPoolExecutor(4) as pool:
                t = time.perf_counter()
                assert sum(pool.map(get, [o.key for o in objs])) == total
                raw.append(time.perf_counter() - t)
            for mode in got:
                got[mode].append(node_b(rep, mode))

        def med(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in got[mode])

        # GB/s = bytes each one read over its time: the raw GET reads every chunk object of the chain
        raw_s = statistics.median(raw) / total
        out.update({"bucket_bytes": total, "raw_get_gbps": round(1 / raw_s / 1e9, 3),
                    "raw_get_runs_s": [round(x, 3) for x in raw], "reprefill_s": round(n / a.prefill_tps, 1)})
        for mode in got:
            out[f"{mode}_gbps"] = round(1 / med(mode, "per_byte") / 1e9, 3)
            out[f"{mode}_vs_raw_get"] = round(raw_s / med(mode, "per_byte"), 3)
            out[f"node_b_{mode}_to_prefix_s"] = round(med(mode, "to_prefix"), 3)
            out[f"node_b_{mode}_next_restore_s"] = round(med(mode, "next"), 3)
        out["tee_import_s"] = round(med("tee", "import"), 3)
        out["tee_vs_raw_get_runs"] = [round(raw[i] / total / r["per_byte"], 3) for i, r in enumerate(got["tee"])]
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"chain of {out['links']} links, {mib} MiB, {n} tokens; SeaweedFS on loopback, obstore client")
    print(f"  raw GET (4 streams)           {out['raw_get_gbps']:.3f} GB/s")
    for mode, what in (("tee", "tee restore (default)"), ("fetch", "fetch, then restore"),
                       ("stream", "restore streamed")):
        print(f"  {what:<29} {out[mode + '_gbps']:.3f} GB/s  = {out[mode + '_vs_raw_get']:.2f}x raw GET; "
              f"node B match to restored prefix {out[f'node_b_{mode}_to_prefix_s']:.3f} s, "
              f"next restore {out[f'node_b_{mode}_next_restore_s']:.3f} s"
              + (" (local)" if mode != "stream" else " (streamed again)"))
    print(f"  tee: background import done {out['tee_import_s']:.3f} s after the restore returned; "
          f"ratio per round {out['tee_vs_raw_get_runs']}")
    print(f"  re-prefill at {a.prefill_tps:.0f} tok/s: {out['reprefill_s']:.1f} s")
    print(f"  save() of {out['save_mib']:.0f} MiB: " + ", ".join(f"{k} {v * 1000:.0f} ms"
                                                            for k, v in out["save_latency_s"].items()))

if __name__ == "__main__":
    main()
