"""Small restores and lookups: the per-request fixed costs (issue 31), for ``bench.py --only small``.

The serving case: a few thousand tokens of a shared system prompt, many requests a second. The
state has the geometry of the tiny Llama that ``bench_vllm.py`` serves (one row per 32-token block,
2 layers x 16 KiB: 1 KiB a token, 3 MiB at 3,000 tokens), saved as a chain of 1, 4 or 12 links (the
vLLM connector saves a link every 256 tokens). For each size and chain:

- ``Store.restore`` into a reused contiguous buffer, cold (every chunk file of the chain dropped
  from the page cache) and warm, against the raw read of the same bytes from one file into the
  same buffer (cold and warm) — the floor a restore of that many bytes can reach. "warm" is the
  first restore after the cold one (the pages just read in, the CPU's caches cold after the wait);
  "steady" the median of warm restores in a row (a server restoring a hot system prompt request
  after request), after a few; the raw read is timed the same two ways;
- the floor of a restore that verifies (issue 48 item 2): the raw read plus the XXH3-128 of the same
  bytes, timed the same three ways in the same run; each ``small.restore`` row of ``--json`` has
  ``cold_floor_x``, ``warm_floor_x``, ``steady_floor_x`` (floor time / restore time) beside
  ``cold_x``/``warm_x``/``steady_x``, and ``ram_floor_x`` (steady floor / RAM-tier restore);
- the defaults (the RAM tier on): ``ram``, steady as above once the tier admitted the chain (a pause
  after each of the first restores, as a server's prefill and decode give it: admission waits for a
  moment with no restore in flight), and ``ram_busy``, a fresh store restored back to back from its
  first restore (no pause: the tier admits a piece only after 16 restores ended while it waited, so
  these are mostly restores from files with the tier's costs on them), each against the steady floor;
- a scheduler lookup at 3K tokens: ``match`` then ``describe`` (what the vLLM connector did before
  issue 31), ``Store.lookup`` (both in one read transaction), and ``Store.lookup`` as the vLLM
  connector calls it now (the prompt a list, weighed against prefill), p50 and p90;
- a profile of one warm restore and one lookup: SQL statements (apsw's profile hook: count and
  SQLite's own time), chunk files opened, reads and bytes read, checksum calls and their time,
  copies through ``Sink.write`` — the counts say where a fixed cost comes from.
"""

from __future__ import annotations

import inspect
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from snapstore import Budget, Identity, Layout, Rows, Store
from snapstore.chunks.chunkfile import checksum_stream

MIB = 1 << 20
BLOCK = 32  # tokens per row (vLLM block)
UNIT = 16384  # bytes of one block of one layer: 2 KV heads x 32 tokens x 2 x 32 head dim x float32
LAYERS = 2
ROW = LAYERS * UNIT
SIZES = (1024, 3072, 8192)
LINKS = (1, 4, 12)
# "steady": after the cold/warm pairs, STEADY_FIRST warm reads in a row (a cold read's pages were
# still getting faster to copy for about eight reads on the VM of docs/benchmarks.md, raw reads
# alike), then the median of STEADY more
STEADY_FIRST = 8
STEADY = 30
PREFILL_TOKENS_PER_S = 60_000.0
_SUM_STEP = 512 << 10  # the floor reads and hashes in the steps a restore does on its own thread (restore.stream)


def _layout() -> Layout:
    return Layout(rows={"kv": Rows("uint8", (LAYERS, UNIT))}, tokens_per_row=BLOCK)


def _open(path: str, ram: int = 0) -> Store:
    """The store, the RAM tier off (``ram=0``: restores from the page cache) unless ``ram`` bytes."""
    return Store.open(path, identity=Identity(build="bench-small", pack="tiny-llama", kv="float32"),
                      layout=_layout(), budget=Budget(disk_bytes=4 << 30, ram_bytes=ram))


def _drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _blobs(store_dir: str) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(store_dir, "blobs")) for f in fs]


def _raw_read(path: str, out: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        mv, done = memoryview(out).cast("B"), 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], done)
            assert n > 0
            done += n
    finally:
        os.close(fd)


def _raw_read_sum(path: str, out: np.ndarray) -> None:
    """The floor of a restore that verifies (issue 48 item 2): the raw read plus the checksum of the
    same bytes (XXH3-128, the restore's, fed in the restore's in-cache steps as they land)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mv, done = memoryview(out).cast("B"), 0
        h = checksum_stream()
        while done < len(mv):
            step = mv[done:done + _SUM_STEP]
            n = os.preadv(fd, [step], done)
            assert n > 0
            h.update(step[:n])
            done += n
        h.digest()
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p))]


class Profile:
    """Counters of one profiled call: SQL (apsw profile hook), files, reads, checksums, copies."""

    def __init__(self) -> None:
        self.sql = 0
        self.txn_s = 0.0
        self.opens = 0
        self.reads = 0
        self.read_bytes = 0
        self.hashes = 0
        self.hash_s = 0.0
        self.copies = 0
        self.copy_bytes = 0
        self.wall_s = 0.0

    def row(self) -> dict[str, Any]:
        return {"wall_us": self.wall_s * 1e6, "sql_statements": self.sql, "catalog_us": self.txn_s * 1e6,
                "files_opened": self.opens, "reads": self.reads, "read_bytes": self.read_bytes,
                "checksums": self.hashes, "checksum_us": self.hash_s * 1e6, "copies": self.copies,
                "copy_bytes": self.copy_bytes}


@contextmanager
def profiled(store: Store) -> Iterator[Profile]:
    """Count what the calls inside do (wrapping os.open/pread/preadv, the restore stream's checksum
    and Sink.write, catalog transactions, and the calling thread's catalog connection: apsw's
    profile hook sees every statement). Timings inside are inflated by the wrappers; the counts
    are exact (reader threads' reads included)."""
    from snapstore.catalog.db import Database
    from snapstore.parts import buffers
    from snapstore.restore import stream

    p = Profile()
    saved = (os.open, os.pread, os.preadv, stream.checksum, stream.checksum_stream, buffers.Sink.write, Database.read)
    o_open, o_pread, o_preadv, o_sum, o_stream, o_write, o_read = saved

    class Hasher:  # the streaming XXH3 of an in-place read: one chunk, timed piece by piece
        def __init__(self) -> None:
            self._h = o_stream()
            p.hashes += 1

        def update(self, data: Any) -> None:
            t0 = time.perf_counter()
            self._h.update(data)
            p.hash_s += time.perf_counter() - t0

        def digest(self) -> bytes:
            return bytes(self._h.digest())

    def w_read(self: Any, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return o_read(self, fn)
        finally:
            p.txn_s += time.perf_counter() - t0

    def w_open(*a: Any, **k: Any) -> int:
        p.opens += 1
        return o_open(*a, **k)

    def w_pread(*a: Any) -> bytes:
        b = o_pread(*a)
        p.reads += 1
        p.read_bytes += len(b)
        return b

    def w_preadv(*a: Any) -> int:
        n = o_preadv(*a)
        p.reads += 1
        p.read_bytes += n
        return n

    def w_sum(data: Any) -> bytes:
        t0 = time.perf_counter()
        try:
            return o_sum(data)
        finally:
            p.hashes += 1
            p.hash_s += time.perf_counter() - t0

    def w_write(self: Any, start: int, data: memoryview) -> None:
        p.copies += 1
        p.copy_bytes += len(data)
        o_write(self, start, data)

    def on_sql(_stmt: str, _ns: int) -> None:  # SQLite's own timer here has millisecond resolution
        p.sql += 1

    conn = store._repo.db.conn()
    os.open, os.pread, os.preadv = w_open, w_pread, w_preadv  # type: ignore[assignment]
    stream.checksum = w_sum  # type: ignore[assignment]
    stream.checksum_stream = Hasher  # type: ignore[assignment]
    buffers.Sink.write = w_write  # type: ignore[method-assign]
    Database.read = w_read  # type: ignore[method-assign]
    conn.set_profile(on_sql)
    t0 = time.perf_counter()
    try:
        yield p
    finally:
        p.wall_s = time.perf_counter() - t0
        conn.set_profile(None)
        os.open, os.pread, os.preadv = o_open, o_pread, o_preadv  # type: ignore[assignment]
        stream.checksum = o_sum  # type: ignore[assignment]
        stream.checksum_stream = o_stream  # type: ignore[assignment]
        buffers.Sink.write = o_write  # type: ignore[method-assign]
        Database.read = o_read  # type: ignore[method-assign]


def _build(sdir: str, tokens: np.ndarray, kv: np.ndarray, links: int) -> int:
    """Save ``tokens`` as a chain of ``links`` snapshots at block boundaries; the leaf's id."""
    rows = len(tokens) // BLOCK
    bounds = sorted({max(1, rows * (i + 1) // links) for i in range(links)})
    with _open(sdir) as s:
        sid = 0
        for b in bounds:
            res = s.save(tokens[:b * BLOCK], {"kv": kv}, rows=b, parent="auto")
            assert res.ok and res.snapshot_id is not None, res
            sid = res.snapshot_id
        return sid


def section_small(args: Any, work: str) -> dict[str, Any]:
    """The small-restore figures, the lookup latency and the profile (see the module doc)."""
    reps = 7 if args.quick else 21
    rng = np.random.default_rng(31)
    out: dict[str, Any] = {"restore": {}, "lookup": {}, "profile": {}}
    print(f"\n== small restores (issue 31): tiny-Llama geometry, {ROW // 1024} KiB a {BLOCK}-token block, chains of "
          f"{', '.join(map(str, LINKS))} links; medians of {reps}, checksums on; ms ==")
    print(f"{'tokens':>6} {'MiB':>5} {'links':>5} | {'raw cold':>8} {'restore':>8} {'x raw':>6} | "
          f"{'raw warm':>8} {'restore':>8} {'x raw':>6} | {'raw stdy':>8} {'restore':>8} {'x raw':>6} | "
          f"{'RAM tier':>8} | x floor: cold / warm / steady / RAM (floor = raw read + XXH3 of the bytes)")
    for n_tok in SIZES:
        rows = n_tok // BLOCK
        tokens = rng.integers(4, 50_000, size=n_tok, dtype=np.int64)
        kv = np.frombuffer(rng.bytes(rows * ROW), np.uint8).reshape(rows, LAYERS, UNIT)
        raw_path = os.path.join(work, "small-raw.bin")
        with open(raw_path, "wb") as f:
            f.write(kv.tobytes())
            f.flush()
            os.fsync(f.fileno())
        for links in LINKS:
            sdir = os.path.join(work, f"small-{n_tok}-{links}")
            sid = _build(sdir, tokens, kv, links)
            dst = np.zeros_like(kv)
            t: dict[str, list[float]] = {k: [] for k in ("raw_cold", "raw_warm", "raw_steady", "cold", "warm",
                                                         "steady", "floor_cold", "floor_warm", "floor_steady")}
            with _open(sdir) as s:
                files = _blobs(sdir)
                s.restore(sid, {"kv": dst})  # statements prepared, connection open: a serving process's state
                for _ in range(reps):
                    _drop([raw_path])
                    t["raw_cold"].append(_timed(lambda: _raw_read(raw_path, dst)))
                    t["raw_warm"].append(_timed(lambda: _raw_read(raw_path, dst)))
                    _drop([raw_path])
                    t["floor_cold"].append(_timed(lambda: _raw_read_sum(raw_path, dst)))
                    t["floor_warm"].append(_timed(lambda: _raw_read_sum(raw_path, dst)))
                    dst[:1] ^= 0xFF
                    _drop(files)
                    t["cold"].append(_timed(lambda: s.restore(sid, {"kv": dst})))
                    t["warm"].append(_timed(lambda: s.restore(sid, {"kv": dst})))

                    assert np.array_equal(dst, kv), "restore mismatch"
                    dst[:1] ^= 0xFF
                for key, fn in (("raw_steady", lambda: _raw_read(raw_path, dst)),
                                ("floor_steady", lambda: _raw_read_sum(raw_path, dst)),
                                ("steady", lambda: s.restore(sid, {"kv": dst}))):
                    for _ in range(STEADY_FIRST):
                        fn()
                    t[key] = [_timed(fn) for _ in range(STEADY)]
                assert np.array_equal(dst, kv), "restore mismatch"
                if n_tok == 3072 and links == 12:
                    out["profile"] = _profile(s, sid, tokens, dst)
                    out["lookup"] = _lookup(s, tokens, reps * 10)
            with _open(sdir, ram=256 * MIB) as s:  # the defaults, restored back to back from the first restore:
                for _ in range(3):                  # admission waits for a moment with no restore in flight
                    s.restore(sid, {"kv": dst})
                t["ram_busy"] = [_timed(lambda: s.restore(sid, {"kv": dst})) for _ in range(reps)]
                assert np.array_equal(dst, kv), "restore mismatch"
            with _open(sdir, ram=256 * MIB) as s:  # the defaults, steady: the RAM tier on (admits on a 2nd restore)
                for _ in range(3):
                    s.restore(sid, {"kv": dst})
                    # a server's requests come with a prefill and a decode between them: admission runs
                    # there, off the restore's path (as the large section waits for it)
                    admitted = s._tiers.ram is not None and s._tiers.ram.drain(5.0)
                    assert admitted, "the RAM tier did not admit within 5 s"
                for _ in range(STEADY_FIRST):
                    s.restore(sid, {"kv": dst})
                t["ram"] = [_timed(lambda: s.restore(sid, {"kv": dst})) for _ in range(STEADY)]
                assert np.array_equal(dst, kv), "restore mismatch"
            shutil.rmtree(sdir)
            m = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            out["restore"][f"{n_tok}/{links}"] = {"tokens": n_tok, "links": links, "bytes": kv.nbytes, **m,
                                                  "cold_x": m["raw_cold"] / m["cold"],
                                                  "warm_x": m["raw_warm"] / m["warm"],
                                                  "steady_x": m["raw_steady"] / m["steady"],
                                                  # issue 48 item 2: against the floor (raw read + checksum)
                                                  "cold_floor_x": m["floor_cold"] / m["cold"],
                                                  "warm_floor_x": m["floor_warm"] / m["warm"],
                                                  "steady_floor_x": m["floor_steady"] / m["steady"],
                                                  "ram_floor_x": m["floor_steady"] / m["ram"],
                                                  "ram_busy_floor_x": m["floor_steady"] / m["ram_busy"]}
            print(f"{n_tok:6} {kv.nbytes / MIB:5.1f} {links:5} | {m['raw_cold']:8.3f} {m['cold']:8.3f} "
                  f"{m['raw_cold'] / m['cold']:6.2f} | {m['raw_warm']:8.3f} {m['warm']:8.3f} "
                  f"{m['raw_warm'] / m['warm']:6.2f} | {m['raw_steady']:8.3f} {m['steady']:8.3f} "
                  f"{m['raw_steady'] / m['steady']:6.2f} | {m['ram']:8.3f} | floor x "
                  f"{m['floor_cold'] / m['cold']:.2f} / {m['floor_warm'] / m['warm']:.2f} / "
                  f"{m['floor_steady'] / m['steady']:.2f} / {m['floor_steady'] / m['ram']:.2f}; RAM tier back to back "
                  f"{m['ram_busy']:.3f} ms ({m['floor_steady'] / m['ram_busy']:.2f})")
        os.unlink(raw_path)
    lk = out["lookup"]
    print("lookup at 3,072 tokens, 12 links (us): " + ", ".join(
        f"{k} p50 {v['p50_us']:.0f} / p90 {v['p90_us']:.0f}" for k, v in lk.items()))
    print("profile, 3,072 tokens / 12 links (one call each; wall time inflated by the counting wrappers):")
    print(f"  {'call':22} {'wall us':>8} {'SQL':>4} {'txn us':>7} {'opens':>5} {'reads':>5} {'KiB read':>8} "
          f"{'sums':>4} {'sum us':>6} {'copies':>6} {'KiB copied':>10}")
    for k, r in out["profile"].items():
        print(f"  {k:22} {r['wall_us']:8.0f} {r['sql_statements']:4} {r['catalog_us']:7.0f} {r['files_opened']:5} "
              f"{r['reads']:5} {r['read_bytes'] / 1024:8.0f} {r['checksums']:4} {r['checksum_us']:6.0f} "
              f"{r['copies']:6} {r['copy_bytes'] / 1024:10.0f}")
    return out


def _lookup(s: Store, tokens: np.ndarray, n: int) -> dict[str, dict[str, float]]:
    """p50/p90 of the scheduler's lookup: match then describe, and Store.lookup where it exists."""
    calls: dict[str, Callable[[], Any]] = {}

    def match_describe() -> Any:
        m = s.match(tokens)
        return s.describe(m) if m is not None else None

    calls["match+describe"] = match_describe
    calls["match"] = lambda: s.match(tokens)
    if hasattr(s, "lookup"):
        calls["lookup"] = lambda: s.lookup(tokens)
    if "prefill_tokens_per_s" in inspect.signature(getattr(s, "lookup", lambda: None)).parameters:
        # as the vLLM connector's scheduler calls it: the prompt a list of ints, weighed against
        # prefill (the tiny Llama prefilled 3,000 tokens in about 50 ms in bench_vllm.py)
        listed = tokens.tolist()
        calls["lookup, list, weighed"] = lambda: s.lookup(listed, prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
    ts: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(n):  # interleaved: a neighbour's burst hits every call alike
        for name, fn in calls.items():
            ts[name].append(_timed(fn))
    return {name: {"p50_us": statistics.median(v) * 1e6, "p90_us": _q(v, 0.9) * 1e6} for name, v in ts.items()}


def _profile(s: Store, sid: int, tokens: np.ndarray, dst: np.ndarray) -> dict[str, dict[str, Any]]:
    out = {}
    with profiled(s) as p:
        s.restore(sid, {"kv": dst})
    out["restore (warm)"] = p.row()
    with profiled(s) as p:
        m = s.match(tokens)
    out["match"] = p.row()
    with profiled(s) as p:
        s.describe(m)  # type: ignore[arg-type]
    out["describe"] = p.row()
    if hasattr(s, "lookup"):
        with profiled(s) as p:
            s.lookup(tokens)
        out["lookup"] = p.row()
    return out
