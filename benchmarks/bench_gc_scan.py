"""gc --remote's manifest scan, manifests/s against the pool width (issue 52: the scan was the first
thing to break at 100 nodes; docs/benchmarks.md "A fleet on one bucket").

One node publishes ``--manifests`` one-link snapshots (distinct 256-token prompts) to a loopback
SeaweedFS bucket; then ``gc_remote(dry_run=True)`` runs (one listing, every manifest read) at each
``--widths`` value, alternating, ``--repeats`` times. ``--latency-ms`` adds that many milliseconds to
each manifest GET (a cloud store's round trip; loopback has ~none), on top of the real GET.

    python benchmarks/bench_gc_scan.py --manifests 1000 --widths 1,16 --latency-ms 0,15 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3_fixtures import SeaweedCluster  # noqa: E402

import snapstore  # noqa: E402
from snapstore.remote.keys import LAYOUT as KEYS  # noqa: E402
from snapstore.remote.maint import gc_remote  # noqa: E402
from snapstore.remote.s3client import S3Client  # noqa: E402

LAYOUT = snapstore.Layout(fixed={"st": snapstore.Fixed("float32", (8, 8))},
                          rows={"kv": snapstore.Rows("float16", (2, 64))})


class Slow(S3Client):
    """The real client, each manifest GET delayed by ``delay`` seconds (a remote store's round trip)."""

    def __init__(self, url: str, delay: float):
        super().__init__(url)
        self.delay = delay

    def get(self, key: str, limit: int) -> bytes | None:
        if self.delay and f"{KEYS}/m/" in key:
            time.sleep(self.delay)
        return super().get(key, limit)


def seed(url: str, where: Path, n: int) -> None:
    """``n`` one-link snapshots published by nodes of 50 saves each."""
    rng = np.random.default_rng(0)
    st = np.zeros((8, 8), np.float32)
    for first in range(0, n, 50):
        store = snapstore.Store.open(where / str(first), layout=LAYOUT, remote=url, chunk_bytes=65536,
                                     identity=snapstore.Identity(build="bench-scan", pack="sha256:x", kv="f16"),
                                     staging_bytes=65536 * 4)
        try:
            for _ in range(first, min(n, first + 50)):
                kv = rng.standard_normal((256, 2, 64)).astype(np.float16)  # new chunks: no fence waits
                store.save(rng.integers(0, 50_000, 256, dtype=np.int64), {"st": st, "kv": kv}, rows=256)
            f = store.flush()
            if f.failed:
                raise SystemExit(f"seeding failed: {f.errors}")
        finally:
            store.close()
        print(f"  {min(n, first + 50)} saved", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifests", type=int, default=1000)
    ap.add_argument("--widths", default="1,16")
    ap.add_argument("--latency-ms", default="0,15")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    cluster = SeaweedCluster().start(timeout=120.0)
    print("cluster up", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-scan-"))
    try:
        os.environ.update(cluster.env())
        os.environ["SNAPSTORE_REMOTE_GC_WINDOW_S"] = "0.5"
        os.environ["SNAPSTORE_REMOTE_TIMEOUT_S"] = "10"
        cluster.create_bucket("fleet")
        url = f"s3://fleet/scan-{secrets.token_hex(4)}"
        t = time.monotonic()
        seed(url, tmp / "node", a.manifests)
        print(f"seeded {a.manifests} snapshots in {time.monotonic() - t:.1f} s", flush=True)
        results: dict[str, list[float]] = {}
        for lat in [float(x) for x in a.latency_ms.split(",")]:
            for _ in range(a.repeats):
                for w in [int(x) for x in a.widths.split(",")]:
                    os.environ["SNAPSTORE_REMOTE_SCAN_WIDTH"] = str(w)
                    client = Slow(url, lat / 1000)
                    t = time.monotonic()
                    rep = gc_remote(client, grace=3600.0, dry_run=True)
                    dt = time.monotonic() - t
                    rate = a.manifests / dt
                    assert not rep.broken_manifests and not rep.chunks_removed, rep
                    results.setdefault(f"latency {lat:g} ms, width {w}", []).append(rate)
                    print(f"latency {lat:g} ms width {w}: {dt:.2f} s, {rate:.0f} manifests/s", flush=True)
        out = {"manifests": a.manifests, "load": os.getloadavg(),
               "manifests_per_s": {k: {"median": statistics.median(v), "runs": v} for k, v in results.items()}}
        print(json.dumps(out, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
