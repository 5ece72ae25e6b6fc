"""Issue 12 item 5: one side-by-side benchmark of every way to keep a prefix's state, with a chart.

    .venv/bin/python benchmarks/bench.py --only side [--quick]      # part of `make bench`

Two workloads, one after the other, every method interleaved within each repetition:

* **field**: the workload an engine reported (issue 12): a 30,028-token prefix of a hybrid model,
  118 MB of running (recurrent + conv) state as two ``Fixed`` parts and 12 KiB/token of bf16 K/V
  rows (6 attention layers x K/V x 8 heads x 64), 487 MB in all;
* **512 MiB**: the core workload of bench.py (2688 tokens x 192 KiB + 8 MiB fixed).

Methods: raw buffered write + fsync / ``preadv``; raw O_DIRECT write + fsync / O_DIRECT reads with
several in flight (threads); snapstore with its defaults (RAM tier 2 GiB, direct I/O on), with the
RAM tier off, with direct I/O off; safetensors; torch.save / torch.load; diskcache + pickle of a
state object, the way llama-cpp-python's ``LlamaDiskCache`` stores a ``LlamaState`` (the state as
one ``bytes`` copy, keyed by the token tuple). Every save is durable (fsync; diskcache does not
fsync by itself, so its value file is fsynced after ``set``, and the bare ``set`` is shown too).
Every restore lands in the same reused, 4 KiB-aligned destination and is checked byte for byte;
*cold* = ``posix_fadvise(DONTNEED)`` on every file the method reads right before it (after the
save's fsync, so the pages are clean and really leave), then *1st warm* straight after, then the
*later warm* = median of the 2nd and 3rd warm restore. Ratios are against the raw baselines of the
same repetition's run (medians).

The chart (``--chart``, PNG): throughput per method for both workloads, and restore time vs prefix
length for the field layout against re-prefill, **measured directly** on a tiny random Llama
(transformers, 4 layers x 256, 5 M parameters, float32 on this CPU) for a few lengths and fitted
(a + b n + c n^2) beyond the longest measured one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from snapstore import Budget, Fixed, Identity, Layout, Rows, Store
from snapstore.chunks.direct_io import ALIGN, O_DIRECT

MIB = 1 << 20
GIB = 1 << 30
FIELD_TOKENS = 30_028
FIELD_ROW = (6, 2, 8, 64)  # bf16: 12,288 B/token
FIELD_FIXED = {"ssm": 112_001_024, "conv": 6_000_640}  # 118 MB of running state, 4 KiB multiples
CORE_ROW = (48, 2, 8, 128)  # bench.py's 512 MiB workload
CORE_FIXED = {"fixed": 8 * MIB}


class LlamaState:
    """What llama-cpp-python's LlamaDiskCache pickles: token ids and the context's state as one bytes copy."""

    def __init__(self, input_ids: np.ndarray, n_tokens: int, llama_state: bytes, llama_state_size: int, seed: int):
        self.input_ids = input_ids
        self.scores = None  # llama-cpp-python also keeps logits here (n_tokens x vocab with logits_all); left out
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed


def aligned(n: int) -> np.ndarray:
    """A zeroed, touched uint8 array of n bytes starting on a 4 KiB boundary."""
    big = np.ones(n + ALIGN, dtype=np.uint8)
    off = -big.ctypes.data % ALIGN
    return big[off:off + n]


class Work:
    """One workload: source and destination as contiguous aligned buffers, parts are views into them."""

    def __init__(self, name: str, tokens: int, row: tuple[int, ...], fixed: dict[str, int], seed: int = 3):
        from bench import random_fill  # bench.py is the entry point; its helpers are shared

        self.name, self.tokens_n, self.row = name, tokens, row
        self.row_bytes = int(np.prod(row)) * 2
        kv = tokens * self.row_bytes
        assert kv % ALIGN == 0 and all(v % ALIGN == 0 for v in fixed.values())
        self.sizes = {"kv": kv, **fixed}
        self.nbytes = sum(self.sizes.values())
        self.src = aligned(self.nbytes)
        random_fill(self.src, seed)
        self.dst = aligned(self.nbytes)
        self.src_parts, self.dst_parts, off = {}, {}, 0
        for k, n in self.sizes.items():
            self.src_parts[k] = self.src[off:off + n]
            self.dst_parts[k] = self.dst[off:off + n]
            off += n
        self.tokens = np.arange(tokens, dtype=np.int64)
        self.layout = Layout(fixed={k: Fixed("uint8", (n,)) for k, n in fixed.items()},
                             rows={"kv": Rows("bfloat16", row)})

    def check(self) -> None:
        assert np.array_equal(self.dst, self.src), f"{self.name}: restore mismatch"
        self.dst[::65536] ^= 0xFF  # so the next restore must really write every piece


# -- raw ---------------------------------------------------------------------------------------
def write_all(fd: int, buf: np.ndarray) -> None:
    mv = memoryview(buf).cast("B")
    while mv:
        mv = mv[os.write(fd, mv):]


def raw_save(path: str, w: Work, direct: bool) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0), 0o600)
    try:
        write_all(fd, w.src)  # aligned source, 4 KiB-multiple length: O_DIRECT-ready as it is
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_load(path: str, w: Work, direct: bool, inflight: int = 4, piece: int = 8 * MIB) -> None:
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        mv = memoryview(w.dst)
        if not direct:
            done = 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], done)
                assert n > 0
                done += n
            return

        def one(off: int) -> None:
            end = min(off + piece, len(mv))
            while off < end:
                n = os.preadv(fd, [mv[off:end]], off)
                assert n > 0
                off += n

        with ThreadPoolExecutor(inflight) as ex:
            list(ex.map(one, range(0, len(mv), piece)))
    finally:
        os.close(fd)


# -- the methods -------------------------------------------------------------------------------
class Method:
    """save() writes the state durably; load() restores it into w.dst; files() = what load reads."""

    def __init__(self, name: str, save: Callable[[], Any], load: Callable[[], Any], files: Callable[[], list[str]],
                 close: Callable[[], Any] | None = None, after: Callable[[], Any] | None = None,
                 before: Callable[[], Any] | None = None):
        self.name, self.save, self.load, self.files = name, save, load, files
        self.close = close or (lambda: None)
        self.after = after or (lambda: None)  # after each restore, off the clock (RAM-tier admission drain)
        # before each save, off the clock: open a fresh store or cache (an engine opens it once, not per save)
        self.before = before or (lambda: None)


def methods(w: Work, work: str, light: bool = False) -> list[Method]:
    from bench import blob_files, fsync_path, read_path_row

    row = read_path_row(work)  # the read path the store measured on this file system (issue 48)

    out: list[Method] = []
    raw = os.path.join(work, f"{w.name}.raw")
    for direct in (False, True):
        tag = "O_DIRECT" if direct else "buffered"
        out.append(Method(f"raw {tag}", lambda d=direct: raw_save(raw, w, d), lambda d=direct: raw_load(raw, w, d),
                          lambda: [raw], lambda: os.unlink(raw)))

    ident = Identity(build="bench", pack=f"{w.name}-bf16", kv="bf16")

    def store_method(label: str, ram: int | None, direct: bool | None) -> Method:
        sdir = os.path.join(work, f"{w.name}-{label.replace(' ', '_')}")
        box: dict[str, Any] = {}

        def before() -> None:
            shutil.rmtree(sdir, ignore_errors=True)
            if "s" in box:
                box.pop("s").close()
            box["s"] = Store.open(sdir, identity=ident, layout=w.layout, direct_io=direct,
                                  budget=Budget(ram_bytes=ram, disk_bytes=64 * GIB, reserve_bytes=256 * MIB))
            box["s"]._reads.apply(row)  # as a store that has measured reads (no probe mid-run)

        def save() -> None:
            res = box["s"].save(w.tokens, w.src_parts, parent=None)
            assert res.ok, res
            box["id"] = res.snapshot_id

        def load() -> None:
            box["s"].restore(box["id"], w.dst_parts)

        def after() -> None:
            if box["s"]._ram is not None:
                box["s"]._ram.drain()  # admission runs on a background thread, off the restore's path

        def close() -> None:
            if "s" in box:
                box.pop("s").close()
            shutil.rmtree(sdir, ignore_errors=True)

        return Method(f"snapstore {label}", save, load, lambda: blob_files(sdir), close, after, before)

    out.append(store_method("defaults", None, None))
    out.append(store_method("RAM tier off", 0, None))
    if light:  # --side-light: the raw methods and the store's defaults and ram=0 only
        return out
    out.append(store_method("direct I/O off", None, False))

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        src_t = {k: torch.from_numpy(v) for k, v in w.src_parts.items()}
        src_t["kv"] = src_t["kv"].view(torch.bfloat16).view(w.tokens_n, *w.row)
        dst_t = {k: torch.from_numpy(v) for k, v in w.dst_parts.items()}
        dst_t["kv"] = dst_t["kv"].view(torch.bfloat16).view(w.tokens_n, *w.row)
        try:
            import safetensors.torch as sft
        except ImportError:
            sft = None
        if sft is not None:
            sf = os.path.join(work, f"{w.name}.safetensors")

            def sf_save() -> None:
                sft.save_file(src_t, sf)
                fsync_path(sf)

            def sf_load() -> None:
                for k, t in sft.load_file(sf).items():
                    dst_t[k].copy_(t)

            out.append(Method("safetensors", sf_save, sf_load, lambda: [sf], lambda: os.unlink(sf)))
        pt = os.path.join(work, f"{w.name}.pt")

        def pt_save() -> None:
            with open(pt, "wb") as f:
                torch.save(src_t, f)
                f.flush()
                os.fsync(f.fileno())

        def pt_load() -> None:
            for k, t in torch.load(pt, weights_only=True).items():
                dst_t[k].copy_(t)

        out.append(Method("torch.save/load", pt_save, pt_load, lambda: [pt], lambda: os.unlink(pt)))

    try:
        import diskcache
    except ImportError:
        diskcache = None
    if diskcache is not None:
        ddir = os.path.join(work, f"{w.name}-diskcache")
        key = tuple(int(t) for t in w.tokens)  # LlamaDiskCache keys by the token tuple
        box2: dict[str, Any] = {}

        def dc_files() -> list[str]:
            return [os.path.join(r, f) for r, _, fs in os.walk(ddir) for f in fs]

        def dc_open() -> None:
            shutil.rmtree(ddir, ignore_errors=True)
            if "c" in box2:
                box2.pop("c").close()
            box2["c"] = diskcache.Cache(ddir)  # LlamaDiskCache: diskcache.Cache(cache_dir), pickle (highest protocol)

        def dc_save() -> None:
            c = box2["c"]
            t0 = time.perf_counter()
            # Llama.save_state(): llama_state_get_data into a buffer, then one bytes copy of it
            state = LlamaState(w.tokens.copy(), w.tokens_n, w.src.tobytes(), w.nbytes, 1234)
            c[key] = state
            box2["set"] = time.perf_counter() - t0
            for p in dc_files():  # diskcache does not fsync: make the save durable like the others
                fsync_path(p)
            fsync_path(ddir)

        def dc_load() -> None:
            state = box2["c"][key]  # unpickle the LlamaState from its value file
            # Llama.load_state(): llama_state_set_data copies the bytes into the context
            w.dst[:] = np.frombuffer(state.llama_state, dtype=np.uint8)

        def dc_close() -> None:
            if "c" in box2:
                box2.pop("c").close()
            shutil.rmtree(ddir, ignore_errors=True)

        m = Method("diskcache+pickle", dc_save, dc_load, dc_files, dc_close, before=dc_open)
        m.box = box2  # type: ignore[attr-defined]
        out.append(m)
    return out


KINDS = ("save", "cold", "warm1", "warmN")


def run_workload(w: Work, work: str, reps: int, light: bool = False) -> dict[str, Any]:
    from bench import drop_cache, timed

    ms = methods(w, work, light)
    t: dict[str, dict[str, list[float]]] = {m.name: {k: [] for k in (*KINDS, "set")} for m in ms}
    try:
        for r in range(reps):
            for m in (ms if r % 2 == 0 else ms[::-1]):  # alternate the order against drift
                gc.collect()
                tm = t[m.name]
                m.before()
                tm["save"].append(timed(m.save))
                if hasattr(m, "box"):
                    tm["set"].append(m.box["set"])
                drop_cache(m.files())
                tm["cold"].append(timed(m.load))
                w.check()
                m.after()
                tm["warm1"].append(timed(m.load))
                w.check()
                m.after()
                later = []
                for _ in range(2):
                    later.append(timed(m.load))
                    w.check()
                    m.after()
                tm["warmN"].append(statistics.median(later))
                m.close()
    finally:
        for m in ms:
            with contextlib.suppress(Exception):
                m.close()
    med = {name: {k: statistics.median(v) for k, v in d.items() if v} for name, d in t.items()}
    return {"bytes": w.nbytes, "tokens": w.tokens_n, "s": med, "all": t}


def report(w: Work, res: dict[str, Any], reps: int) -> dict[str, Any]:
    from bench import gbps

    med = res["s"]
    rb, rd = med["raw buffered"], med["raw O_DIRECT"]
    best_read = min(rb["cold"], rd["cold"])
    print(f"\n== side by side: {w.name}, {w.nbytes / 1e6:.0f} MB ({w.tokens_n} tokens x {w.row_bytes} B K/V + "
          f"{(w.nbytes - w.tokens_n * w.row_bytes) / 1e6:.0f} MB fixed), medians of {reps}, same run ==")
    print("ms (GB/s); x = raw time / its time: save vs the faster raw write+fsync (buffered or O_DIRECT); cold vs"
          " the best raw cold read; warm vs the buffered raw warm read")
    print(f"{'method':24}{'save':>20}{'cold':>20}{'1st warm':>20}{'later warm':>20}")
    out: dict[str, Any] = {}
    for name, d in med.items():
        refs = {"save": min(rb["save"], rd["save"]), "cold": best_read, "warm1": rb["warm1"], "warmN": rb["warmN"]}
        cells = []
        row: dict[str, Any] = {}
        for k in KINDS:
            s = d[k]
            x = refs[k] / s
            row[k] = {"ms": s * 1e3, "GBps": gbps(w.nbytes, s), "x_raw": x}
            cells.append(f"{s * 1e3:7.1f} ({gbps(w.nbytes, s):5.2f}) {x:4.2f}x")
        print(f"{name:24}" + "".join(f"{c:>20}" for c in cells))
        if "set" in d:
            row["set_ms"] = d["set"] * 1e3
        out[name] = row
    if "diskcache+pickle" in med:
        dc = med["diskcache+pickle"]["set"] * 1e3
        print(f"(diskcache+pickle: the bare Cache.set(), without the fsync, took {dc:.1f} ms)")
    return out


# -- restore time vs prefix length, against re-prefill -----------------------------------------
def restore_vs_length(work: str, lengths: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Cold and 1st-warm restore (snapstore defaults) of the field layout at several prefix lengths."""
    from bench import blob_files, drop_cache, timed

    out: dict[int, dict[str, float]] = {}
    for n in lengths:
        w = Work(f"len{n}", n, FIELD_ROW, FIELD_FIXED, seed=n)
        sdir = os.path.join(work, f"len{n}")
        cold, warm = [], []
        for _ in range(reps):
            shutil.rmtree(sdir, ignore_errors=True)
            with Store.open(sdir, identity=Identity(build="bench", pack="len", kv="bf16"), layout=w.layout,
                            budget=Budget(disk_bytes=64 * GIB, reserve_bytes=256 * MIB)) as s:
                sid = s.save(w.tokens, w.src_parts, parent=None).snapshot_id
                drop_cache(blob_files(sdir))
                cold.append(timed(lambda s=s, sid=sid, w=w: s.restore(sid, w.dst_parts)))
                w.check()
                warm.append(timed(lambda s=s, sid=sid, w=w: s.restore(sid, w.dst_parts)))
                w.check()
        shutil.rmtree(sdir, ignore_errors=True)
        out[n] = {"bytes": w.nbytes, "cold": statistics.median(cold), "warm1": statistics.median(warm)}
        del w
        gc.collect()
    return out


def prefill_times(lengths: list[int], threads: int = 2) -> dict[int, float] | None:
    """One forward pass (prefill, K/V cache on) of a tiny random Llama per length, measured, median of 2."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=768, vocab_size=32000, max_position_embeddings=max(lengths) + 16)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    out: dict[int, float] = {}
    with torch.no_grad():
        model(torch.zeros((1, 64), dtype=torch.long), use_cache=True)  # warm-up
        for n in lengths:
            ids = torch.randint(0, 32000, (1, n))
            ts = []
            for _ in range(2):
                t0 = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                ts.append(time.perf_counter() - t0)
            out[n] = min(ts)
    return out


def fit_prefill(pf: dict[int, float]) -> Callable[[np.ndarray], np.ndarray]:
    """Least-squares a + b n + c n^2 (linear layers + attention) through the measured points, c, b >= 0."""
    n = np.array(sorted(pf), dtype=np.float64)
    y = np.array([pf[int(k)] for k in n])
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], axis=1), y, rcond=None)[0]
    b, c = max(b, 0.0), max(c, 0.0)
    return lambda x: a + b * x + c * x * x


# -- chart -------------------------------------------------------------------------------------
def chart(path: str, tables: dict[str, dict[str, Any]], vslen: dict[int, dict[str, float]],
          pf: dict[int, float] | None, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("(matplotlib is not installed: no chart)")
        return False
    fig = plt.figure(figsize=(14, 11))
    grid = fig.add_gridspec(2, len(tables))
    axes = [fig.add_subplot(grid[0, i]) for i in range(len(tables))] + [fig.add_subplot(grid[1, :])]
    labels = {"save": "save (durable)", "cold": "restore cold", "warm1": "restore 1st warm",
              "warmN": "restore later warm"}
    colors = {"save": "#7f7f7f", "cold": "#1f77b4", "warm1": "#ff7f0e", "warmN": "#2ca02c"}
    for ax, (wname, tab) in zip(axes, tables.items()):
        names = list(tab)
        x = np.arange(len(names))
        for i, k in enumerate(KINDS):
            ax.bar(x + (i - 1.5) * 0.2, [tab[nm][k]["GBps"] for nm in names], 0.2, label=labels[k], color=colors[k])
        ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("GB/s (higher is better)")
        ax.set_yscale("log")
        ax.set_title(wname, fontsize=10)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7)
    ax = axes[-1]
    ns = sorted(vslen)
    ax.plot(ns, [vslen[n]["cold"] for n in ns], "o-", label="snapstore restore, cold (defaults)", color="#1f77b4")
    ax.plot(ns, [vslen[n]["warm1"] for n in ns], "s-", label="snapstore restore, 1st warm", color="#ff7f0e")
    if pf:
        mp = sorted(pf)
        ax.plot(mp, [pf[n] for n in mp], "^-", color="#d62728",
                label="re-prefill, tiny Llama (5M params, CPU), measured")
        f = fit_prefill(pf)
        xs = np.linspace(mp[-1], max(ns), 50)
        if xs[-1] > mp[-1]:
            ax.plot(xs, f(xs), "--", color="#d62728", label="re-prefill, same model, fitted a+bn+cn²")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("prefix length (tokens); field layout: 118 MB fixed + 12 KiB/token")
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title("restore vs re-prefill", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"chart: {path}")
    return True


def section_side(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Both workloads side by side, restore time vs length, re-prefill, the chart."""
    quick = args.quick
    reps = 1 if quick else args.repeat
    scale = 4 if quick else 1  # --quick: a quarter of each workload
    works = [("field", FIELD_TOKENS // scale // 4 * 4, FIELD_ROW, {k: v // scale // ALIGN * ALIGN
                                                                   for k, v in FIELD_FIXED.items()}),
             ("512MiB", 2688 // scale, CORE_ROW, CORE_FIXED)]
    light = bool(getattr(args, "side_light", False))
    if light:  # issue 48: the field workload's raw reads and the store's defaults / ram=0, nothing else
        works = works[:1]
    results: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for name, toks, row, fixed in works:
        w = Work(name, toks, row, fixed)
        res = run_workload(w, work, reps, light)
        label = f"{name}: {w.nbytes / 1e6:.0f} MB ({w.tokens_n} tokens)"
        tables[label] = report(w, res, reps)
        results[name] = {"bytes": w.nbytes, "tokens": w.tokens_n, "methods": tables[label]}
        del w, res
        gc.collect()
    if light:
        return results
    lengths = [512, 2048, 8192, 30_028] if not quick else [512, 2048, 7504]
    vslen = restore_vs_length(work, lengths, 1 if quick else 3)
    plens = [512, 1024, 2048, 4096] if quick else [512, 1024, 2048, 4096, 8192]
    pf = prefill_times(plens)
    print("\n== restore (field layout, snapstore defaults) vs re-prefill (tiny random Llama, 4 x 256, "
          "measured on this CPU, 2 threads; fitted a+bn+cn^2 past the last measured length) ==")
    f = fit_prefill(pf) if pf else None
    print(f"{'tokens':>7} {'MB':>7} {'cold ms':>9} {'1st warm ms':>12} {'re-prefill ms':>14}")
    for n, d in vslen.items():
        rp = ""
        if pf and n in pf:
            rp = f"{pf[n] * 1e3:14.0f}"
        elif f is not None:
            rp = f"{float(f(np.array(float(n)))) * 1e3:13.0f}*"
        print(f"{n:7} {d['bytes'] / 1e6:7.0f} {d['cold'] * 1e3:9.1f} {d['warm1'] * 1e3:12.1f} {rp:>14}")
    if pf:
        print("re-prefill measured: " + ", ".join(f"{n}: {t * 1e3:.0f} ms ({n / t:,.0f} tok/s)" for n, t in pf.items())
              + "   (* = fitted)")
    results["restore_vs_length"] = vslen
    results["prefill_measured_s"] = pf
    chart_path = args.chart or os.path.join(args.dir, "benchmarks-side-quick.png" if quick else "benchmarks-side.png")
    title = (f"snapstore side by side ({time.strftime('%Y-%m-%d')}, {'--quick, ' if quick else ''}"
             f"medians of {reps}, shared 2-vCPU machine: read ratios within the run)")
    chart(chart_path, tables, vslen, pf, title)
    results["chart"] = chart_path
    return results

