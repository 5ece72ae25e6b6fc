"""boto3 vs obstore on the same bytes against a real loopback SeaweedFS: which S3 client the shared tier uses.

Each client PUTs (with ``If-None-Match: *``) and GETs the same N objects of chunk size, one stream
and four in parallel; medians of --reps. Also prints each client's installed size. Run:
``.venv/bin/python benchmarks/bench_s3client.py [--quick]``. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3_fixtures import SeaweedCluster  # noqa: E402


def _site_size(dist: str) -> int:
    """Installed bytes of a distribution and its own files (not its dependencies)."""
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        return 0
    total = 0
    for f in files:
        p = Path(str(f.locate()))
        if p.is_file():
            total += p.stat().st_size
    return total


def _boto3(env: dict[str, str]) -> tuple[Any, Any]:
    import boto3
    import botocore.config

    cfg = botocore.config.Config(max_pool_connections=16, retries={"mode": "standard", "max_attempts": 3})
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], config=cfg)

    def put(bucket: str, key: str, data: memoryview) -> None:
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(data), IfNoneMatch="*")

    def get(bucket: str, key: str) -> int:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
        n = 0
        for piece in body.iter_chunks(1 << 20):
            n += len(piece)
        return n

    return put, get, s3


def _obstore(env: dict[str, str], bucket: str) -> tuple[Any, Any]:
    import obstore
    from obstore.store import S3Store

    st = S3Store(bucket, endpoint=env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"],
                 access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                 client_options={"allow_http": True})

    def put(_bucket: str, key: str, data: memoryview) -> None:
        obstore.put(st, key, data, mode="create")

    def get(_bucket: str, key: str) -> int:
        return len(obstore.get(st, key).bytes())

    return put, get


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller objects")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    n_obj, size = (4, 8 << 20) if a.quick else (8, 32 << 20)
    rng = np.random.default_rng(0)
    blobs = [memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for _ in range(n_obj)]
    total = n_obj * size
    cluster = SeaweedCluster().start()
    out: dict[str, Any] = {"objects": n_obj, "object_bytes": size}
    try:
        env = cluster.env()
        os.environ.update(env)
        bput, bget, s3 = _boto3(env)
        s3.create_bucket(Bucket="bench-boto3")
        s3.create_bucket(Bucket="bench-obstore")
        oput, oget = _obstore(env, "bench-obstore")
        for name, put, get, bucket in (("boto3", bput, bget, "bench-boto3"), ("obstore", oput, oget, "bench-obstore")):
            res: dict[str, list[float]] = {"put_1": [], "get_1": [], "get_4": []}
            for rep in range(a.reps):
                keys = [f"r{rep}/o{i}" for i in range(n_obj)]
                t = time.perf_counter()
                for k, b in zip(keys, blobs):
                    put(bucket, k, b)
                res["put_1"].append(total / (time.perf_counter() - t) / 1e9)
                t = time.perf_counter()
                got = sum(get(bucket, k) for k in keys)
                res["get_1"].append(total / (time.perf_counter() - t) / 1e9)
                assert got == total
                with ThreadPoolExecutor(4) as pool:
                    t = time.perf_counter()
                    got = sum(pool.map(lambda k: get(bucket, k), keys))
                    res["get_4"].append(total / (time.perf_counter() - t) / 1e9)
            out[name] = {k: round(statistics.median(v), 3) for k, v in res.items()}
        out["installed_mib"] = {
            "boto3": round(sum(_site_size(d) for d in ("boto3", "botocore", "s3transfer", "jmespath",
                                                        "python-dateutil", "urllib3", "six")) / 2**20, 1),
            "obstore": round(sum(_site_size(d) for d in ("obstore",)) / 2**20, 1)}
    finally:
        cluster.stop()
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{n_obj} objects x {size >> 20} MiB, GB/s (median of {a.reps})")
        for name in ("boto3", "obstore"):
            r = out[name]
            print(f"  {name:8s} put {r['put_1']:.3f}  get {r['get_1']:.3f}  get x4 {r['get_4']:.3f}  "
                  f"installed {out['installed_mib'][name]} MiB")


if __name__ == "__main__":
    main()
