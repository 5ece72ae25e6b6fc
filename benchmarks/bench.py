"""snapstore benchmarks: one command, one file system, everything side by side.

    make bench                      # or: .venv/bin/python benchmarks/bench.py [--quick] [--repeat N]

Sections (``--only`` picks some): raw (raw write + fsync / read), store (snapstore save and
restore, cold and warm, RAM tier), alt (safetensors, torch.save/torch.load), delta (stored bytes
of a depth 1..8 delta chain), codec (raw vs zstd vs zstd-shuffle2 on bf16-like data), chunks
(chunk size sweep), match (match() over 10,000 snapshots of 128K-token prompts), small (bench_small.py:
1K/3K/8K-token restores from chains of 1/4/12 links against the raw read of the same bytes, the
scheduler lookup, and a profile of both: SQL statements, files, reads, checksums, copies), rss (peak memory
of a 2 GiB save and restore, each in a fresh subprocess), side (bench_side.py: the field workload and
the 512 MiB one, raw / O_DIRECT / snapstore / safetensors / torch / diskcache + pickle side by side,
restore time vs prefix length against re-prefill, and a PNG chart).

Every figure is a median of ``--repeat`` runs (5; ``--quick``: 3 runs of a smaller state), and
the raw baselines are measured interleaved with the snapstore runs, so ratios compare like with
like on a noisy machine. "cold" means posix_fadvise(DONTNEED) on every file read (for a store,
every chunk file under blobs/) right before the timed read; "warm" means straight after a read.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import snapstore  # noqa: E402
from snapstore import Budget, Fixed, Identity, Layout, Rows, Store  # noqa: E402
from snapstore.chunks.chunkfile import (  # noqa: E402
    CODECS,
    HEADER_SIZE,
    ChunkHeader,
    checksum,
    decode_payload,
    encode_payload,
)
from snapstore.restore.read_choice import candidate  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
ROW_SHAPE = (48, 2, 8, 128)  # 48 layers x K/V x 8 KV heads x head dim 128, bf16: 192 KiB per token
ROW_BYTES = 48 * 2 * 8 * 128 * 2
FIXED_BYTES = 8 * MIB  # the fixed part (e.g. recurrent / running state)
DEFAULT_DIR = "/work/scratch/bench"

_results: dict[str, Any] = {}


# -- helpers ---------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def spread(xs: list[float], nbytes: int) -> str:
    rates = sorted(gbps(nbytes, t) for t in xs)
    return f"[{rates[0]:.2f}..{rates[-1]:.2f}]"


def drop_cache(paths: list[str]) -> None:
    """posix_fadvise(DONTNEED) on each file (clean pages leave the page cache)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def blob_files(store_dir: str) -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(store_dir, "blobs")):
        out += [os.path.join(root, f) for f in files]
    return out


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_fill(arr: np.ndarray, seed: int, block: int = 4 * MIB) -> None:
    """Fill a uint8 array with random bytes in small blocks (no big temporaries)."""
    rng = np.random.default_rng(seed)
    flat = arr.reshape(-1)
    for off in range(0, flat.size, block):
        n = min(block, flat.size - off)
        flat[off:off + n] = np.frombuffer(rng.bytes(n), dtype=np.uint8)


def bf16_like(nbytes: int, seed: int = 1) -> np.ndarray:
    """bf16 K/V-like bytes: normal floats (per-channel scales) truncated from float32 to bf16."""
    rng = np.random.default_rng(seed)
    n = nbytes // 2
    scale = rng.uniform(0.1, 4.0, size=1024).astype(np.float32)
    vals = rng.standard_normal(n, dtype=np.float32) * np.resize(scale, n)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def layout() -> Layout:
    return Layout(fixed={"fixed": Fixed("uint8", (FIXED_BYTES,))}, rows={"kv": Rows("bfloat16", ROW_SHAPE)})


def identity() -> Identity:
    return Identity(build="bench", pack="kv-48L-bf16", kv="bf16")


def open_store(path: str, *, ram: int | None = 0, chunk_bytes: int | None = None, codec: str | None = None,
               lay: Layout | None = None, staging_bytes: int | None = None, direct_reads: bool | None = None) -> Store:
    return Store.open(path, identity=identity(), layout=lay or layout(),
                      budget=Budget(ram_bytes=ram, disk_bytes=64 * GIB, reserve_bytes=256 * MIB),
                      chunk_bytes=chunk_bytes, codec=codec, staging_bytes=staging_bytes, direct_reads=direct_reads)


class State:
    """A source state (random bytes: incompressible, the worst case) and a reused destination."""

    def __init__(self, total: int, seed: int = 7):
        self.tokens_n = (total - FIXED_BYTES) // ROW_BYTES
        self.nbytes = self.tokens_n * ROW_BYTES + FIXED_BYTES
        self.kv = np.empty(self.tokens_n * ROW_BYTES, dtype=np.uint8)
        self.fixed = np.empty(FIXED_BYTES, dtype=np.uint8)
        random_fill(self.kv, seed)
        random_fill(self.fixed, seed + 1)
        self.dst_kv = np.ones_like(self.kv)  # touched: a reused destination, like an engine's arena
        self.dst_fixed = np.ones_like(self.fixed)
        self.tokens = np.arange(self.tokens_n, dtype=np.int64)

    def parts(self) -> dict[str, np.ndarray]:
        return {"kv": self.kv, "fixed": self.fixed}

    def into(self) -> dict[str, np.ndarray]:
        return {"kv": self.dst_kv, "fixed": self.dst_fixed}

    def check(self) -> None:
        assert np.array_equal(self.dst_kv, self.kv) and np.array_equal(self.dst_fixed, self.fixed), "restore mismatch"
        self.dst_kv[:4096] ^= 0xFF  # so the next restore must really write
        self.dst_fixed[:4096] ^= 0xFF


# -- raw baselines ---------------------------------------------------------------------------
def raw_write(path: str, bufs: list[np.ndarray]) -> float:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for b in bufs:
            mv = memoryview(b).cast("B")
            while mv:
                n = os.write(fd, mv)
                mv = mv[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: str, bufs: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for b in bufs:
            mv = memoryview(b).cast("B")
            done = 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], off + done)
                assert n > 0
                done += n
            off += done
    finally:
        os.close(fd)
    return time.perf_counter() - t0


# -- sections --------------------------------------------------------------------------------
def measured_read_path(work: str) -> Any:
    """The cold-read path a store measures on this file system (issue 48, snapstore.restore.read_path),
    measured once here with the store's own probe, so every fresh store of a run reads as a store that
    has measured does (and none starts its probe in the background mid-run). Returns the catalog row."""
    sdir = os.path.join(work, "read-path")
    with open_store(sdir) as s:
        row, got = s._reads.measure_now(s._repo)
    shutil.rmtree(sdir)
    print(f"read path measured: {candidate(row.method, row.threads, row.piece).name} — {row.reason}")
    return row._replace(cold_rate=0.0)  # no drift to judge in the run's fresh stores


_READ_PATH: Any = None  # measured_read_path()'s row, once per run


def read_path_row(work: str) -> Any:
    global _READ_PATH
    if _READ_PATH is None:
        _READ_PATH = measured_read_path(work)
        _results["read_path"] = {"method": _READ_PATH.method, "threads": _READ_PATH.threads,
                                 "piece": _READ_PATH.piece, "why": _READ_PATH.reason,
                                 "figures": json.loads(_READ_PATH.figures)}
    return _READ_PATH


def section_core(args: argparse.Namespace, st: State, work: str) -> None:
    """raw (buffered and O_DIRECT) + the store with its defaults (RAM tier on, the measured read path)
    and with ``ram_bytes=0``, interleaved in every repetition; each ratio's baseline is the best raw method."""
    reps = args.repeat
    n = st.nbytes
    raw_path = os.path.join(work, "raw.bin")
    row = read_path_row(work)
    whole = _aligned(n)  # the O_DIRECT write's aligned source, made once before any clock
    whole[:FIXED_BYTES] = st.fixed
    whole[FIXED_BYTES:] = st.kv
    t: dict[str, list[float]] = {k: [] for k in (
        "raw_write", "raw_write_direct", "raw_cold", "raw_cold_direct", "raw_warm",
        "save", "restore_cold", "restore_warm", "restore_ram",
        "save_ram0", "restore_cold_ram0", "restore_warm_ram0")}
    chosen: list[str] = []  # the defaults' read path after each cold restore
    for r in range(reps):
        gc.collect()
        t["raw_write"].append(raw_write(raw_path, [st.fixed, st.kv]))
        drop_cache([raw_path])
        time.sleep(args.settle)
        t["raw_cold"].append(raw_read(raw_path, [st.dst_fixed, st.dst_kv]))
        t["raw_warm"].append(raw_read(raw_path, [st.dst_fixed, st.dst_kv]))
        t["raw_write_direct"].append(raw_write_direct(raw_path, whole))
        drop_cache([raw_path])
        time.sleep(args.settle)
        t["raw_cold_direct"].append(raw_read_direct(raw_path, [st.dst_fixed, st.dst_kv], 4, 4 * MIB))
        os.unlink(raw_path)
        order = [("", None), ("_ram0", 0)] if r % 2 == 0 else [("_ram0", 0), ("", None)]
        for tag, ram in order:  # the defaults (ram=None: the shipped RAM tier) and ram_bytes=0, alternating
            sdir = os.path.join(work, f"store{r}{tag}")
            with open_store(sdir, ram=ram) as s:
                s._reads.apply(row)  # the probe's choice, or what the defaults' restores chose from it so far
                res: Any = None

                def save(s: Store = s) -> None:
                    nonlocal res
                    res = s.save(st.tokens, st.parts(), parent=None)

                t["save" + tag].append(timed(save))
                assert res.ok, res
                sid = res.snapshot_id
                assert res.stored_bytes >= n
                drop_cache(blob_files(sdir))
                time.sleep(args.settle)
                t["restore_cold" + tag].append(timed(lambda s=s, sid=sid: s.restore(sid, st.into())))
                st.check()
                if not tag and s._reads.row is not None:  # timed by that restore (restore.read_path): carried on
                    row = s._reads.row._replace(cold_rate=0.0)
                    chosen.append(candidate(row.method, row.threads, row.piece).name)
                if s._ram is not None:
                    s._ram.drain()  # admission runs in the background, off the restore's path
                t["restore_warm" + tag].append(timed(lambda s=s, sid=sid: s.restore(sid, st.into())))
                st.check()
                if not tag:  # later warm restores with the defaults: the RAM tier (admitted on the 2nd)
                    if s._ram is not None:
                        s._ram.drain()
                    s.restore(sid, st.into())
                    st.check()
                    t["restore_ram"].append(timed(lambda s=s, sid=sid: s.restore(sid, st.into())))
                    st.check()
            shutil.rmtree(sdir)
    del whole
    m = {k: gbps(n, median(v)) for k, v in t.items()}
    m["raw_write_best"] = max(m["raw_write"], m["raw_write_direct"])
    m["raw_cold_best"] = max(m["raw_cold"], m["raw_cold_direct"])
    _results["core"] = {"bytes": n, "GBps": m, "spread": {k: spread(v, n) for k, v in t.items()},
                        "read_path": _results.get("read_path"), "settle_s": args.settle, "chosen_after": chosen,
                        "chosen_why": row.reason}
    how = candidate(row.method, row.threads, row.piece).name.replace("direct", "O_DIRECT")
    print(f"\n== raw vs snapstore: {n / MIB:.0f} MiB state ({st.tokens_n} tokens x {ROW_BYTES // 1024} KiB "
          f"bf16 K/V rows + {FIXED_BYTES // MIB} MiB fixed), medians of {reps}, checksums on ==")
    print(f"defaults = Budget() as shipped (RAM tier on), cold reads {how} (its choice at the end); ram=0 beside it; "
          "x = vs the best raw method")
    print(f"cold reads {args.settle:g} s after the write; the defaults' read path after each cold restore: "
          f"{', '.join(chosen)} ({row.reason})")
    print(f"{'':40}{'GB/s':>7}  {'x best':>6}  min..max GB/s")
    rows = [
        ("raw write + fsync, buffered", "raw_write", "raw_write_best"),
        ("raw write + fsync, O_DIRECT", "raw_write_direct", "raw_write_best"),
        ("raw read, cold, buffered (DONTNEED)", "raw_cold", "raw_cold_best"),
        ("raw read, cold, O_DIRECT 4x4MiB", "raw_cold_direct", "raw_cold_best"),
        ("raw read, warm", "raw_warm", "raw_warm"),
        ("snapstore save, defaults", "save", "raw_write_best"),
        ("snapstore save, ram=0", "save_ram0", "raw_write_best"),
        ("snapstore restore, cold, defaults", "restore_cold", "raw_cold_best"),
        ("snapstore restore, cold, ram=0", "restore_cold_ram0", "raw_cold_best"),
        ("snapstore restore, 1st warm, defaults", "restore_warm", "raw_warm"),
        ("snapstore restore, 1st warm, ram=0", "restore_warm_ram0", "raw_warm"),
        ("snapstore restore, later warm, defaults", "restore_ram", "raw_warm"),
    ]
    for label, k, base in rows:
        print(f"{label:40}{m[k]:7.2f}  {m[k] / m[base]:6.2f}  {spread(t[k], n)}")
    _results["core"]["ratios"] = {k: m[k] / m[b] for _, k, b in rows}
    _results["core"]["baselines"] = {k: b for _, k, b in rows}


def raw_write_direct(path: str, buf: np.ndarray) -> float:
    """O_DIRECT write + fsync of ``buf`` (4 KiB-aligned copy made before the clock starts)."""
    from snapstore.chunks.direct_io import ALIGN, O_DIRECT, align_up
    n = align_up(buf.nbytes)
    big = np.zeros(n + ALIGN, dtype=np.uint8)
    off = -big.ctypes.data % ALIGN
    frame = big[off:off + n]
    frame[:buf.nbytes] = buf.reshape(-1).view(np.uint8)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
    try:
        mv = memoryview(frame)
        while mv:
            mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _aligned(n: int) -> np.ndarray:
    """``n`` bytes at a 4 KiB-aligned address (what O_DIRECT needs)."""
    from snapstore.chunks.direct_io import ALIGN
    big = np.empty(n + ALIGN, dtype=np.uint8)
    off = -big.ctypes.data % ALIGN
    return big[off:off + n]


def raw_read_direct(path: str, bufs: list[np.ndarray], inflight: int, piece: int = MIB) -> float:
    """O_DIRECT read of ``path`` into ``bufs`` (in order) with ``inflight`` reads in flight: that many
    threads, each preadv-ing ``piece``-byte aligned spans into its own aligned buffer and copying
    them into the destination (numpy copies release the GIL). Buffers are made before the clock."""
    import threading

    from snapstore.chunks.direct_io import O_DIRECT
    flat = [b.reshape(-1).view(np.uint8) for b in bufs]
    starts = np.cumsum([0] + [len(f) for f in flat]).tolist()
    total = starts[-1]
    bounce = [_aligned(piece) for _ in range(inflight)]
    lock = threading.Lock()
    nxt = [0]

    def run(buf: np.ndarray) -> None:
        while True:
            with lock:
                off = nxt[0]
                nxt[0] += piece
            if off >= total:
                return
            want = min(piece, total - off)
            got = 0
            while got < want:
                k = os.preadv(fd, [buf.data[got:]], off + got)
                assert k > 0
                got += k
            for i, f in enumerate(flat):  # copy the span into the destination part(s) it covers
                a, b = max(off, starts[i]), min(off + want, starts[i + 1])
                if a < b:
                    np.copyto(f[a - starts[i]:b - starts[i]], buf[a - off:b - off])

    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    try:
        threads = [threading.Thread(target=run, args=(b,)) for b in bounce]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def section_issue12(args: argparse.Namespace, st: State, work: str) -> None:
    """Issue 12 side by side, one run: raw buffered / O_DIRECT write + fsync and cold / warm read;
    snapstore save with direct I/O on / off, the engine-visible latency of save(wait=False); restores
    cold, 1st warm, later warm with the RAM tier on (default 2 GiB) and off."""
    nb = st.nbytes
    raw = os.path.join(work, "raw12.bin")
    fig: dict[str, list[float]] = {}

    def add(k: str, t: float) -> None:
        fig.setdefault(k, []).append(t)

    flat = np.concatenate([st.kv, st.fixed])
    for _ in range(args.repeat):
        add("raw write buffered+fsync", raw_write(raw, [st.kv, st.fixed]))
        add("raw write O_DIRECT+fsync", raw_write_direct(raw, flat))
        for n in (1, 4, 8):  # issue 12 item 2: the best raw cold read is O_DIRECT with reads in flight
            drop_cache([raw])
            add(f"raw read cold O_DIRECT, {n} in flight", raw_read_direct(raw, [st.dst_kv, st.dst_fixed], n))
        drop_cache([raw])
        add("raw read cold", raw_read(raw, [st.dst_kv, st.dst_fixed]))
        add("raw read warm", raw_read(raw, [st.dst_kv, st.dst_fixed]))
        for direct in (True, False):
            sdir = os.path.join(work, f"s12-{direct}")
            shutil.rmtree(sdir, ignore_errors=True)
            s = Store.open(sdir, identity=identity(), layout=layout(), direct_io=direct,
                           budget=Budget(disk_bytes=64 * GIB, reserve_bytes=256 * MIB))  # RAM tier: default
            try:
                tag = "direct" if direct else "buffered"
                t = timed(lambda: s.save(st.tokens, st.parts(), parent=None))  # noqa: B023
                add(f"save durable ({tag})", t)
                m = s.match(st.tokens)
                assert m is not None
                drop_cache(blob_files(sdir))
                for label in ("cold", "1st warm", "2nd warm", "3rd warm"):
                    add(f"restore {label} ({tag}, RAM tier on)", timed(lambda: s.restore(m, st.into())))  # noqa: B023
                    st.check()
                    if s._ram is not None:
                        s._ram.drain()  # admission runs in the background; not on the timed path
            finally:
                s.close()
            for reads in (False, True) if direct else (False,):  # O_DIRECT reads of uncached chunks off / on
                s = open_store(sdir, ram=0, direct_reads=reads)
                what = f"{tag}, RAM tier off" + (", direct reads on" if reads else "")
                try:
                    m = s.match(st.tokens)
                    assert m is not None
                    drop_cache(blob_files(sdir))
                    add(f"restore cold ({what})", timed(lambda: s.restore(m, st.into())))  # noqa: B023
                    st.check()
                    add(f"restore warm ({what})", timed(lambda: s.restore(m, st.into())))  # noqa: B023
                    st.check()
                finally:
                    s.close()
            if direct:  # after the restores: a cold one follows one save (as the raw cold read follows one write)
                s2 = os.path.join(work, "s12-async")
                shutil.rmtree(s2, ignore_errors=True)
                with Store.open(s2, identity=identity(), layout=layout(),
                                budget=Budget(disk_bytes=64 * GIB, reserve_bytes=256 * MIB)) as a:
                    t0 = time.perf_counter()
                    h = a.save(st.tokens, st.parts(), parent=None, wait=False)
                    add("save wait=False: engine-visible", time.perf_counter() - t0)
                    h.result()
                    add("save wait=False: until durable", time.perf_counter() - t0)
                    # the engine's steady state: a store already in use (its staging touched, its
                    # blobs/ directories made) saves new bytes: one byte changed in every chunk
                    flip = (st.kv[::16 * MIB], st.fixed[:1])
                    for v in flip:
                        v += 1
                    try:
                        add("save durable (direct, store in use)",
                            timed(lambda: a.save(st.tokens, st.parts(), parent=None)))  # noqa: B023
                    finally:
                        for v in flip:
                            v -= 1
            shutil.rmtree(sdir, ignore_errors=True)
    os.unlink(raw)
    print(f"\n== issue 12: {nb / MIB:.0f} MiB state, medians of {args.repeat}, same run ==")
    best_cold = min((k for k in fig if k.startswith("raw read cold")), key=lambda k: median(fig[k]))
    ref = {"save": median(fig["raw write O_DIRECT+fsync"]), "cold": median(fig[best_cold]),
           "warm": median(fig["raw read warm"])}
    print(f"(cold restores x the best raw cold read: {best_cold!r}; buffered raw cold: "
          f"{median(fig['raw read cold']) * 1e3:.1f} ms)")
    out: dict[str, Any] = {"best raw cold": best_cold}
    for k, ts in fig.items():
        t = median(ts)
        base = "save" if k.startswith("save") else ("cold" if "cold" in k else ("warm" if "warm" in k else None))
        ratio = f"{ref[base] / t:5.2f}x raw" if base and not k.startswith("raw") else ""
        if base == "cold" and not k.startswith("raw"):
            ratio += f" ({median(fig['raw read cold']) / t:4.2f}x buffered raw)"
        print(f"{k:48s} {t * 1e3:8.1f} ms {gbps(nb, t):6.2f} GB/s {spread(ts, nb)} {ratio}")
        out[k] = {"ms": t * 1e3, "gbps": gbps(nb, t)}
    _results["issue12"] = out


def section_alt(args: argparse.Namespace, st: State, work: str) -> None:
    """safetensors and torch.save/torch.load of the same tensors, against raw and snapstore."""
    try:
        import torch
    except ImportError:
        print("\n== alternatives: torch is not installed, skipped ==")
        return
    try:
        import safetensors.torch as sft
    except ImportError:
        sft = None
    n = st.nbytes
    kv = torch.from_numpy(st.kv).view(torch.bfloat16).view(st.tokens_n, *ROW_SHAPE)
    fixed = torch.from_numpy(st.fixed)
    dkv = torch.from_numpy(st.dst_kv).view(torch.bfloat16).view(st.tokens_n, *ROW_SHAPE)
    dfixed = torch.from_numpy(st.dst_fixed)
    tensors = {"kv": kv, "fixed": fixed}
    t: dict[str, list[float]] = {k: [] for k in ("raw_write", "raw_cold", "st_save", "st_cold", "st_warm",
                                                 "pt_save", "pt_cold", "pt_warm", "save", "restore_cold")}
    raw_path = os.path.join(work, "raw.bin")
    sf_path = os.path.join(work, "state.safetensors")
    pt_path = os.path.join(work, "state.pt")

    def st_save() -> None:
        sft.save_file(tensors, sf_path)
        fsync_path(sf_path)

    def st_load() -> None:
        d = sft.load_file(sf_path)
        dkv.copy_(d["kv"])
        dfixed.copy_(d["fixed"])

    def pt_save() -> None:
        with open(pt_path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    def pt_load() -> None:
        d = torch.load(pt_path, weights_only=True)
        dkv.copy_(d["kv"])
        dfixed.copy_(d["fixed"])

    for r in range(args.repeat):
        gc.collect()
        t["raw_write"].append(raw_write(raw_path, [st.fixed, st.kv]))
        drop_cache([raw_path])
        time.sleep(args.settle)
        t["raw_cold"].append(raw_read(raw_path, [st.dst_fixed, st.dst_kv]))
        sdir = os.path.join(work, f"astore{r}")
        with open_store(sdir) as s:
            res: Any = None

            def save() -> None:
                nonlocal res
                res = s.save(st.tokens, st.parts(), parent=None)

            t["save"].append(timed(save))
            drop_cache(blob_files(sdir))
            time.sleep(args.settle)
            t["restore_cold"].append(timed(lambda: s.restore(res.snapshot_id, st.into())))
            st.check()
        shutil.rmtree(sdir)
        if sft is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sf_path)
            t["st_save"].append(timed(st_save))
            drop_cache([sf_path])
            time.sleep(args.settle)
            t["st_cold"].append(timed(st_load))
            st.check()
            t["st_warm"].append(timed(st_load))
            st.check()
            os.unlink(sf_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pt_path)
        t["pt_save"].append(timed(pt_save))
        drop_cache([pt_path])
        time.sleep(args.settle)
        t["pt_cold"].append(timed(pt_load))
        st.check()
        t["pt_warm"].append(timed(pt_load))
        st.check()
        os.unlink(pt_path)
        gc.collect()
    os.unlink(raw_path)
    m = {k: gbps(n, median(v)) for k, v in t.items() if v}
    print(f"\n== alternatives, same {n / MIB:.0f} MiB of bf16 tensors (load includes the copy into the "
          f"destination), medians of {args.repeat} ==")
    print(f"{'':36}{'GB/s':>7}  {'x raw':>6}  {'snapstore / it':>14}")
    rows = [
        ("safetensors save_file + fsync", "st_save", "raw_write", "save"),
        ("safetensors load_file + copy, cold", "st_cold", "raw_cold", "restore_cold"),
        ("safetensors load_file + copy, warm", "st_warm", "raw_cold", None),
        ("torch.save + fsync", "pt_save", "raw_write", "save"),
        ("torch.load + copy, cold", "pt_cold", "raw_cold", "restore_cold"),
        ("torch.load + copy, warm", "pt_warm", "raw_cold", None),
        ("(snapstore save, same run)", "save", "raw_write", None),
        ("(snapstore restore cold, same run)", "restore_cold", "raw_cold", None),
    ]
    out = {}
    for label, k, base, ours in rows:
        if k not in m:
            continue
        vs = f"{m[ours] / m[k]:14.2f}" if ours else f"{'':14}"
        print(f"{label:36}{m[k]:7.2f}  {m[k] / m[base]:6.2f}  {vs}")
        out[k] = {"GBps": m[k], "x_raw": m[k] / m[base]}
    _results["alt"] = out


def section_delta(args: argparse.Namespace, work: str) -> None:
    """A chain of deltas: each adds ~one chunk of rows and a changed fixed part."""
    chunk = 16 * MIB
    per = chunk // ROW_BYTES  # rows that fit one chunk
    base_rows = 512 if args.quick else 1024
    total_rows = base_rows + 8 * per
    st_kv = np.empty(total_rows * ROW_BYTES, dtype=np.uint8)
    random_fill(st_kv, 11)
    fixed = np.empty(FIXED_BYTES, dtype=np.uint8)
    tokens = np.arange(total_rows, dtype=np.int64)
    sdir = os.path.join(work, "delta")
    print(f"\n== delta chain: root of {base_rows} tokens ({base_rows * ROW_BYTES / MIB:.0f} MiB), then 8 deltas of "
          f"{per} tokens ({per * ROW_BYTES / MIB:.2f} MiB of rows, <= 1 chunk) + the {FIXED_BYTES // MIB} MiB "
          "fixed part, which changes every step ==")
    print(f"{'depth':>5} {'tokens':>7} {'logical MiB':>12} {'stored MiB':>11} {'expected MiB':>13} {'save s':>7}")
    out = []
    with open_store(sdir) as s:
        n = base_rows
        prev = None
        for depth in range(0, 9):
            random_fill(fixed, 100 + depth)
            res: Any = None

            def save() -> None:
                nonlocal res
                res = s.save(tokens[:n], {"kv": st_kv, "fixed": fixed}, parent="auto")

            sec = timed(save)
            assert res.ok and res.parent_id == prev, res
            rows = n - (n - per if depth else 0)
            expect = rows * ROW_BYTES + FIXED_BYTES + 2 * HEADER_SIZE
            if depth == 0:
                expect = n * ROW_BYTES + FIXED_BYTES + HEADER_SIZE * (1 + -(-n * ROW_BYTES // chunk))
            print(f"{depth:5} {n:7} {res.logical_bytes / MIB:12.1f} {res.stored_bytes / MIB:11.2f} "
                  f"{expect / MIB:13.2f} {sec:7.3f}")
            out.append({"depth": depth, "tokens": n, "stored": res.stored_bytes, "logical": res.logical_bytes})
            assert depth == 0 or res.stored_bytes == expect
            prev = res.snapshot_id
            n += per
        dkv = np.zeros_like(st_kv)
        dfx = np.zeros_like(fixed)
        rr = s.restore(prev, {"kv": dkv, "fixed": dfx})
        assert np.array_equal(dkv, st_kv) and np.array_equal(dfx, fixed) and rr.n_tokens == total_rows
        print(f"depth-8 restore: chain of {len(rr.chain)}, {rr.bytes_restored / MIB:.0f} MiB, byte-exact")
    shutil.rmtree(sdir)
    _results["delta"] = out


def section_codec(args: argparse.Namespace, work: str) -> None:
    """Codec ratio and speed on bf16-like data, per chunk and end to end through the store."""
    chunk = 16 * MIB
    total = (64 if args.quick else 256) * MIB
    data = bf16_like(total)
    rnd = np.frombuffer(np.random.default_rng(3).bytes(chunk), dtype=np.uint8)
    print(f"\n== codecs on bf16-like data ({total // MIB} MiB: normal floats truncated to bf16), one thread, "
          f"{chunk // MIB} MiB chunks ==")
    print(f"{'codec':14} {'ratio':>6} {'compress GB/s':>14} {'decompress GB/s':>16} {'ratio on random':>16}")
    out: dict[str, Any] = {}
    for name, code in CODECS.items():
        tc: list[float] = []
        td: list[float] = []
        stored = 0
        for rep in range(max(1, args.repeat // 2)):
            stored = 0
            c_t = d_t = 0.0
            for off in range(0, total, chunk):
                raw = memoryview(data[off:off + chunk])
                t0 = time.perf_counter()
                cod, payload = encode_payload(raw, code)
                c_t += time.perf_counter() - t0
                stored += len(payload)
                outbuf = memoryview(bytearray(len(raw)))
                head = ChunkHeader(cod, len(raw), len(payload), checksum(raw))
                t0 = time.perf_counter()
                decode_payload(head, payload, outbuf)
                d_t += time.perf_counter() - t0
                if rep == 0:
                    assert outbuf == raw
            tc.append(c_t)
            td.append(d_t)
        _, prnd = encode_payload(memoryview(rnd), code)
        ratio = total / stored
        c, d = gbps(total, median(tc)), gbps(total, median(td))
        out[name] = {"ratio": ratio, "compress_GBps": c, "decompress_GBps": d}
        ctxt = "(memcpy-free)" if name == "raw" else f"{c:14.2f}"
        dtxt = "(copy)" if name == "raw" else f"{d:16.2f}"
        print(f"{name:14} {ratio:6.3f} {ctxt:>14} {dtxt:>16} {chunk / len(prnd):16.3f}")
    # end to end: save + cold restore through the store with each codec (2 worker threads)
    lay = Layout(rows={"kv": Rows("bfloat16", ROW_SHAPE)})
    rows_n = total // ROW_BYTES
    kv = data[:rows_n * ROW_BYTES]
    dst = np.ones_like(kv)
    toks = np.arange(rows_n, dtype=np.int64)
    nbytes = rows_n * ROW_BYTES
    print(f"end to end through the store ({nbytes / MIB:.0f} MiB bf16-like, medians of {args.repeat}):")
    print(f"{'codec':14} {'save GB/s':>10} {'cold restore GB/s':>18} {'stored MiB':>11}")
    for name in CODECS:
        ts: list[float] = []
        tr: list[float] = []
        stored = 0
        for r in range(args.repeat):
            sdir = os.path.join(work, f"codec-{name}-{r}")
            with open_store(sdir, codec=name, lay=lay) as s:
                res: Any = None

                def save(s: Store = s) -> None:
                    nonlocal res
                    res = s.save(toks, {"kv": kv}, parent=None)

                ts.append(timed(save))
                stored = res.stored_bytes
                drop_cache(blob_files(sdir))
                tr.append(timed(lambda s=s: s.restore(res.snapshot_id, {"kv": dst})))
                assert np.array_equal(dst, kv)
                dst[:16] ^= 1
            shutil.rmtree(sdir)
        out[name]["save_GBps"] = gbps(nbytes, median(ts))
        out[name]["restore_cold_GBps"] = gbps(nbytes, median(tr))
        print(f"{name:14} {gbps(nbytes, median(ts)):10.2f} {gbps(nbytes, median(tr)):18.2f} {stored / MIB:11.1f}")
    _results["codec"] = out


def section_chunks(args: argparse.Namespace, st: State, work: str) -> None:
    """Chunk size sweep: save and restore of the same state with 4..64 MiB chunks."""
    sizes = [4, 8, 16, 32, 64]
    reps = max(3, args.repeat) if not args.quick else 2
    n = st.nbytes
    t: dict[int, dict[str, list[float]]] = {c: {"save": [], "cold": [], "warm": []} for c in sizes}
    rawt: dict[str, list[float]] = {"write": [], "cold": []}
    raw_path = os.path.join(work, "raw.bin")
    for r in range(reps):
        rawt["write"].append(raw_write(raw_path, [st.fixed, st.kv]))
        drop_cache([raw_path])
        rawt["cold"].append(raw_read(raw_path, [st.dst_fixed, st.dst_kv]))
        for c in (sizes if r % 2 == 0 else sizes[::-1]):  # alternate the order against drift
            sdir = os.path.join(work, f"chunks{c}")
            with open_store(sdir, chunk_bytes=c * MIB, staging_bytes=max(64, c) * MIB) as s:
                res: Any = None

                def save(s: Store = s) -> None:
                    nonlocal res
                    res = s.save(st.tokens, st.parts(), parent=None)

                t[c]["save"].append(timed(save))
                drop_cache(blob_files(sdir))
                t[c]["cold"].append(timed(lambda s=s: s.restore(res.snapshot_id, st.into())))
                st.check()
                t[c]["warm"].append(timed(lambda s=s: s.restore(res.snapshot_id, st.into())))
                st.check()
            shutil.rmtree(sdir)
    os.unlink(raw_path)
    rw, rc = gbps(n, median(rawt["write"])), gbps(n, median(rawt["cold"]))
    print(f"\n== chunk size sweep ({n / MIB:.0f} MiB, medians of {reps}; raw write+fsync {rw:.2f} GB/s, "
          f"raw cold read {rc:.2f} GB/s in this sweep) ==")
    print(f"{'chunk MiB':>9} {'files':>6} {'save GB/s':>10} {'x raw':>6} {'cold GB/s':>10} {'x raw':>6} "
          f"{'warm GB/s':>10}")
    out = {}
    for c in sizes:
        s_, co, wa = (gbps(n, median(t[c][k])) for k in ("save", "cold", "warm"))
        files = -(-st.kv.nbytes // (c * MIB)) + -(-FIXED_BYTES // (c * MIB))
        print(f"{c:9} {files:6} {s_:10.2f} {s_ / rw:6.2f} {co:10.2f} {co / rc:6.2f} {wa:10.2f}")
        out[c] = {"save": s_, "save_x": s_ / rw, "cold": co, "cold_x": co / rc, "warm": wa}
    _results["chunks"] = out


def section_match(args: argparse.Namespace, work: str) -> None:
    """match() latency over many snapshots of 128K-token prompts (delta chains, tiny layout)."""
    from snapstore.catalog import queries as _catalog

    prompts, per = (20, 50) if args.quick else (100, 100)
    plen = 128 * 1024
    step = plen // per
    lay = Layout(rows={"t": Rows("uint8", (1,))})
    sdir = os.path.join(work, "match")
    rows = np.zeros((plen + 1024, 1), dtype=np.uint8)  # identical row bytes: chunk files dedupe
    rng = np.random.default_rng(5)
    prompt_tokens = [rng.integers(0, 150_000, size=plen + 1024, dtype=np.int64) for _ in range(prompts)]
    t0 = time.perf_counter()
    with open_store(sdir, lay=lay, chunk_bytes=1 * MIB, staging_bytes=4 * MIB) as s:
        for p in range(prompts):
            toks = prompt_tokens[p]
            for b in range(1, per + 1):
                res = s.save(toks[:b * step], {"t": rows}, parent="auto")
                assert res.ok
        build = time.perf_counter() - t0
        count = len(s.snapshots())
        probes: list[list[int]] = []
        orig = _catalog.Txn.match_candidates

        def counting(c: Any, identity_id: int, namespace: str, anchors: Any, *a: Any, **k: Any) -> Any:
            # candidate rows actually read: match() stops at the first exact hit
            rec = [len(anchors), 0]
            probes.append(rec)
            for row in orig(c, identity_id, namespace, anchors, *a, **k):
                rec[1] += 1
                yield row

        _catalog.Txn.match_candidates = counting  # type: ignore[method-assign]
        from snapstore import _tokens
        try:
            lat: list[float] = []  # hit, the query's chain hashed in full (a prompt not seen lately)
            warm: list[float] = []  # hit, the chain cached (match -> save -> match of the same prompt)
            miss: list[float] = []
            q = 200 if not args.quick else 50
            for i in range(q):
                p = i % prompts
                query = prompt_tokens[p][:plen + 517]
                with _tokens._cache_lock:
                    _tokens._cache.clear()
                t1 = time.perf_counter()
                m = s.match(query)
                lat.append(time.perf_counter() - t1)
                assert m is not None and m.n_tokens == per * step, m
                t1 = time.perf_counter()
                m = s.match(query)
                warm.append(time.perf_counter() - t1)
                assert m is not None and m.n_tokens == per * step, m
            hit_probes = probes[-1]
            for i in range(q // 4):
                query = rng.integers(0, 150_000, size=plen + 517, dtype=np.int64)
                t1 = time.perf_counter()
                assert s.match(query) is None
                miss.append(time.perf_counter() - t1)
            miss_probes = probes[-1]
        finally:
            _catalog.Txn.match_candidates = orig  # type: ignore[method-assign]
        # where a hit's time goes, each step timed alone on the same store (medians of 50)
        from snapstore._tokens import Encoded, TokenIndex, as_token_array, spells_chain, spells_prefix
        from snapstore.catalog.find_keys import find_keys
        query = np.asarray(prompt_tokens[0][:plen + 517], dtype="<u8")
        conn = s._repo.db.conn()
        c = _catalog.Txn(conn)

        def med_us(fn: Callable[[], Any]) -> float:
            ts = []
            for _ in range(50):
                t1 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t1)
            return median(ts) * 1e6

        def fresh_chain() -> None:
            with _tokens._cache_lock:
                _tokens._cache.clear()
            TokenIndex(query)

        keys = find_keys(query)
        enc = Encoded(query)
        hit_sid = next(iter(orig(c, s.identity.key, "", keys, len(query), 0.0)))[0]
        segs = c.chain_tokens(hit_sid)
        raw_query = prompt_tokens[0][:plen + 517]
        parts = {
            "the prompt checked, read in place as uint64 (as_token_array)": med_us(
                lambda: as_token_array(raw_query, borrow=True)),
            f"find keys ({len(keys) - 1} blocks of XXH3: what match() hashes)": med_us(lambda: find_keys(query)),
            "(BLAKE3 anchor chain in full: saves only, for comparison)": med_us(fresh_chain),
            "first statement: deepest find keys -> first candidate": med_us(
                lambda: next(iter(orig(c, s.identity.key, "", keys, len(query), 0.0)))),
            "every statement read out (a miss runs these; here the hit prompt's candidates)": med_us(
                lambda: list(orig(c, s.identity.key, "", keys, len(query), 0.0))),
            "quarantine probe": med_us(c.quarantined_users),
            "candidate's token segments read, all held (chain_tokens)": med_us(lambda: c.chain_tokens(hit_sid)),
            "candidate's tokens compared (prompt encoded once, memcmp)": med_us(lambda: spells_prefix(segs, query)),
            "candidate's chain walked, links compared in SQL one by one (the exact check)": med_us(
                lambda: spells_chain(segs[-1], c.chain_links(hit_sid, 1, segs[-1][1], memoryview(
                    enc.width(segs[-1][1]))[:segs[-1][2] * segs[-1][1]]), query, enc)),
            "candidate's chain checked in one aggregate statement (what a hit does)": med_us(
                lambda: c.chain_spells(hit_sid, segs[-1][1], memoryview(
                    enc.width(segs[-1][1]))[:segs[-1][2] * segs[-1][1]], enc.narrow())),
            "the hit's row read": med_us(lambda: c.snapshot(hit_sid)),
        }
        plan = [r for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT id FROM snapshots WHERE identity_id = (SELECT id FROM identities WHERE "
            "key = ?) AND namespace = ? AND find_key IN (?, ?, ?) AND n_tokens <= ? AND last_used >= ? AND state = 1 "
            "AND matchable = 1 ORDER BY n_tokens DESC",
            (s.identity.key, "", 1, 2, 3, 10, 0.0))]
    shutil.rmtree(sdir)
    us = median(lat) * 1e6
    print(f"\n== match(): {count} snapshots ({prompts} prompts of {plen} tokens, {per} boundary snapshots each, "
          f"delta chains), built in {build:.0f} s ==")
    print(f"hit, chain hashed in full (query of {plen + 517} tokens, longest = {per * step} tokens): median "
          f"{us:,.0f} us (p90 {sorted(lat)[int(len(lat) * 0.9)] * 1e6:,.0f} us) over {len(lat)} queries")
    print(f"hit, the same prompt matched again (chain cached before; find keys are not cached): median "
          f"{median(warm) * 1e6:,.0f} us "
          f"(p90 {sorted(warm)[int(len(warm) * 0.9)] * 1e6:,.0f} us)")
    print(f"miss (random {plen + 517}-token query): median {median(miss) * 1e6:,.0f} us")
    print(f"find keys: {hit_probes[0]} in the query's chain; the first statement binds the deepest "
          f"{_catalog._FIRST_BATCH}, the rest only when it finds nothing; hit -> {hit_probes[1]} candidate "
          f"rows read (it stops at the first hit), miss -> {miss_probes[1]}")
    print("where a hit's time goes (each step alone, medians of 50):")
    for k, v in parts.items():
        print(f"  {k:58s} {v:8,.0f} us")
    print("query plan: " + " | ".join(str(r[-1]) for r in plan))
    _results["match"] = {"snapshots": count, "median_us": us, "cached_us": median(warm) * 1e6,
                         "miss_us": median(miss) * 1e6, "anchors": hit_probes[0], "candidates": hit_probes[1],
                         "parts_us": parts, "plan": [str(r[-1]) for r in plan]}


def rss_child(mode: str, store_dir: str, gib: float) -> None:
    """Runs in a fresh process: peak RSS increase of one save or restore beyond the arrays."""
    total = int(gib * GIB)
    rows_n = (total - FIXED_BYTES) // ROW_BYTES
    kv = np.empty(rows_n * ROW_BYTES, dtype=np.uint8)
    fixed = np.empty(FIXED_BYTES, dtype=np.uint8)
    if mode.startswith("save"):
        random_fill(kv, 21, block=1 * MIB)
        random_fill(fixed, 22, block=1 * MIB)
    else:
        kv.fill(1)
        fixed.fill(1)
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    with open_store(store_dir) as s:
        if mode == "save":
            res = s.save(np.arange(rows_n), {"kv": kv, "fixed": fixed}, parent=None)
            assert res.ok
            sid = res.snapshot_id
        elif mode == "save-staged":  # a source that is not a host buffer: goes through the staging buffer
            class Reader:
                def __init__(self, a: np.ndarray):
                    self.a, self.nbytes = a, a.nbytes

                def read_into(self, offset: int, out: memoryview) -> None:
                    out[:] = memoryview(self.a)[offset:offset + len(out)]

            res = s.save(np.arange(rows_n), {"kv": Reader(kv), "fixed": Reader(fixed)}, parent=None)
            assert res.ok
            sid = res.snapshot_id
        else:
            sid = s.snapshots()[-1].snapshot_id
            drop_cache(blob_files(store_dir))
            s.restore(sid, {"kv": kv, "fixed": fixed})
    sec = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mode": mode, "bytes": kv.nbytes + fixed.nbytes, "baseline": base, "peak": peak,
                      "increase": peak - base, "seconds": sec, "sid": sid}))


def section_rss(args: argparse.Namespace, work: str) -> None:
    gib = 0.5 if args.quick else 2.0
    sdir = os.path.join(work, "rss")
    print(f"\n== peak RSS (ru_maxrss) of a {gib:g} GiB save / restore, each in a fresh process, beyond the "
          "state arrays (baseline taken after allocating and touching them); staging buffer 64 MiB ==")
    out = {}
    for mode in ("save", "save-staged", "restore"):
        if mode == "save-staged":
            shutil.rmtree(sdir)
        cp = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", mode, "--dir", sdir,
                             "--rss-gib", str(gib)], capture_output=True, text=True, check=False)
        if cp.returncode != 0:
            print(f"{mode}: child failed\n{cp.stderr[-2000:]}")
            continue
        d = json.loads(cp.stdout.strip().splitlines()[-1])
        out[mode] = d
        print(f"{mode:12} state {d['bytes'] / MIB:7.0f} MiB  arrays+interpreter {d['baseline'] / MIB:7.0f} MiB  "
              f"peak {d['peak'] / MIB:7.0f} MiB  increase {d['increase'] / MIB:6.1f} MiB  ({d['seconds']:.2f} s)")
    shutil.rmtree(sdir, ignore_errors=True)
    _results["rss"] = out


# -- main ------------------------------------------------------------------------------------
def machine() -> tuple[str, int | None, float, str]:
    """CPU model (with its L2 and L3 sizes: two VMs that both say "Intel Xeon" can be different
    hosts), CPUs, GiB of RAM, kernel."""
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
        except OSError:
            return ""

    info = dict(ln.split(":", 1) for ln in sh(["lscpu"]).splitlines() if ":" in ln)
    model = info.get("Model name", platform.processor()).strip()
    caches = [f"{k[:2]} {info[k].split('(')[0].strip()}" for k in ("L2 cache", "L3 cache") if k in info]
    if caches:
        model += f" ({', '.join(caches)})"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return model, os.cpu_count(), mem, platform.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller runs (128 MiB state, 3 repeats)")
    ap.add_argument("--repeat", type=int, default=None, help="repetitions per figure (median; default 5)")
    ap.add_argument("--size-mib", type=int, default=None, help="state size (default 512 MiB)")
    ap.add_argument("--dir", default=os.environ.get("SNAPSTORE_BENCH_DIR", DEFAULT_DIR),
                    help=f"work directory (same file system as the store would use; default {DEFAULT_DIR})")
    ap.add_argument("--only", default="core,issue12,alt,side,delta,codec,chunks,match,small,rss",
                    help="comma-separated sections: core,issue12,alt,side,delta,codec,chunks,match,small,rss")
    ap.add_argument("--side-light", action="store_true", help="section side: the field workload only, raw "
                    "buffered / O_DIRECT vs the store's defaults and ram=0 (issue 48), no peers, no chart")
    ap.add_argument("--chart", default=None,
                    help="where section side writes its PNG (default: benchmarks-side[-quick].png under --dir)")
    ap.add_argument("--settle", type=float, default=5.0,
                    help="sections core and alt: seconds between writing a file (raw, the store's, a peer's) and "
                         "reading it cold, so a cache below the page cache (a VM host's, a disk's) has let go of "
                         "it, as it has for a restore long after its save (default 5; 0: read at once)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--doc", default=None, help="rewrite the current table at the top of this markdown file "
                    "(make bench: docs/benchmarks.md) with this run's figures (bench_table.py)")
    ap.add_argument("--vllm-json", default=None, help="a bench_vllm.py --json file: its peers join the table")
    ap.add_argument("--table-from", default=None, help="measure nothing: print (and with --doc write) the table "
                    "of an earlier run's --json file")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-gib", type=float, default=2.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.dir, args.rss_gib)
        return
    if args.table_from:  # no measuring: the table of an earlier run's --json (and --vllm-json)
        import bench_table
        with open(args.table_from) as f:
            res = json.load(f)
        vllm = None
        if args.vllm_json:
            with open(args.vllm_json) as f:
                vllm = json.load(f)
        text = bench_table.table(res, res["meta"], vllm)
        print(text)
        if args.doc:
            bench_table.update_doc(args.doc, text)
        return
    args.repeat = args.repeat or (3 if args.quick else 5)
    size = (args.size_mib or (128 if args.quick else 512)) * MIB
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    model, cpus, mem, kernel = machine()
    fs = subprocess.run(["df", "-T", work], capture_output=True, text=True, check=False).stdout.splitlines()[-1:]
    print(f"snapstore {snapstore.__version__} benchmark | {model}, {cpus} CPUs, {mem:.0f} GiB RAM, kernel {kernel}")
    print(f"python {platform.python_version()}, numpy {np.__version__} | work dir {work}: {' '.join(fs)}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    load_before = os.getloadavg()
    sections = set(args.only.split(","))
    t0 = time.perf_counter()
    try:
        st = State(size) if sections & {"core", "alt", "chunks", "issue12"} else None
        if "core" in sections:
            section_core(args, st, work)
        if "issue12" in sections:
            section_issue12(args, st, work)
        if "alt" in sections:
            section_alt(args, st, work)
        if "chunks" in sections:
            section_chunks(args, st, work)
        del st
        gc.collect()
        if "side" in sections:  # issue 12 item 5: both workloads, every method, the chart (bench_side.py)
            import bench_side
            _results["side"] = bench_side.section_side(args, work)
        if "delta" in sections:
            section_delta(args, work)
        if "codec" in sections:
            section_codec(args, work)
        if "match" in sections:
            section_match(args, work)
        if "small" in sections:  # issue 31: small restores and lookups, with their profile (bench_small.py)
            import bench_small
            _results["small"] = bench_small.section_small(args, work)
        if "rss" in sections:
            section_rss(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    import bench_table
    vllm = None
    if args.vllm_json:
        with open(args.vllm_json) as f:
            vllm = json.load(f)
    disk = " ".join(fs[0].split()[:2]) if fs else ""
    meta = {"command": " ".join(["bench.py"] + sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{model}, {cpus} vCPUs, {mem:.0f} GiB RAM, kernel {kernel}, {disk}",
            "load_before": " ".join(f"{x:.1f}" for x in load_before),
            "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    _results["meta"] = meta
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_results, f, indent=1, default=str)
    text = bench_table.table(_results, meta, vllm)
    print("\n== current table (markdown) ==\n" + text)
    if args.doc:
        bench_table.update_doc(args.doc, text)


if __name__ == "__main__":
    main()
