"""``snapstore bench``: what the storage under a store gives, and what the store makes of it (issue 48 item 4).

For the store directory it is pointed at, in well under a minute: the raw limits of that storage
(buffered and O_DIRECT write + fsync; cold reads buffered and with O_DIRECT reads in flight; a read
from the page cache) and, in the same run, a scratch store's save and restores of the same bytes
(defaults: RAM tier on, direct I/O writes on) with their ratios to the best raw method, and which
cold-read path the store chose and why (:mod:`snapstore.restore.read_path`; the measurement is kept
in the store's catalog, as a large cold restore would keep it). The scratch store and the scratch
files live in the store's ``tmp/`` (same file system) and are removed at the end; the store's own
snapshots and chunk files are not read or touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from snapstore._config import Budget, default_dir
from snapstore._errors import CorruptionError, StateError
from snapstore._identity import Identity
from snapstore._layout import Fixed, Layout, Rows
from snapstore.chunks.direct_io import ALIGN, O_DIRECT
from snapstore.chunks.publish import SCRATCH_PREFIX
from snapstore.chunks.repo import DB_NAME, Repo
from snapstore.console.context import EXIT_OK, FORMAT, CliContext, UsageError
from snapstore.restore.rates import RestoreRates
from snapstore.restore.read_choice import candidate
from snapstore.restore.read_path import BUFFERED, CACHED, CANDIDATES, PROBE_ROUNDS, ReadPaths, storage_key
from snapstore.store.store import Store

__all__ = ["add_commands", "cmd_bench"]

MIB = 1 << 20
_ROW = 64 * 1024  # bytes per token row of the scratch state (K/V-like rows), plus one fixed part
_FIXED = 8 * MIB

_BENCH_HELP = """\
Measure the storage under a store and the store on it, side by side, in one run (well under a
minute at the default size): the raw limits (write + fsync, buffered and O_DIRECT; a cold read,
buffered and with O_DIRECT reads in flight; a read from the page cache) and a scratch store's save
and restores of the same bytes with the defaults, each with its ratio to the best raw method, and
which cold-read path the store chose on this storage and why. Run it before filing a performance
bug: it shows what your own disk gives.

The scratch files and the scratch store live in the store's tmp/ and are removed at the end (an
interrupted run leaves tmp/w-bench-*, which gc removes after its grace period); the read-path
measurement is kept in the store's catalog.
Figures of a busy machine are noisy: read the ratios, and run it again when it is quiet.

examples:
  snapstore --dir /srv/cache bench
  snapstore bench --size-mib 512 --repeat 5 --json"""


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``bench`` to the snapstore parser, with its handler as ``run``."""
    fmt = argparse.RawDescriptionHelpFormatter
    pb = sub.add_parser("bench", parents=[common], formatter_class=fmt, description=_BENCH_HELP,
                        help="the storage's raw limits and the store's figures, side by side")
    pb.add_argument("--size-mib", type=int, default=256, metavar="N",
                    help="bytes of state to write and read, in MiB (default 256; 16 to 8192)")
    pb.add_argument("--repeat", type=int, default=3, metavar="N", help="medians of N runs (default 3; 1 to 9)")
    pb.set_defaults(run=cmd_bench)


def _root(args: argparse.Namespace) -> str:
    """The store directory: an existing store, or a path that does not exist yet (a store is created)."""
    root = os.path.abspath(getattr(args, "dir", None) or default_dir())
    if os.path.lexists(root) and not os.path.isdir(root):
        raise UsageError(f"{root} is not a directory: pass --dir with a store directory (or set $SNAPSTORE_DIR)")
    if os.path.isdir(root) and os.listdir(root) and not os.path.isfile(os.path.join(root, DB_NAME)):
        raise UsageError(f"{root} is not a snapstore store (no {DB_NAME}) and not empty: pass --dir with a store "
                         "directory, or a new path (a store is created there)")
    return root


def storage_name(path: str) -> str:
    """The mount that holds ``path``, as ``/dev/vda1 ext4 on /work`` (from /proc/self/mountinfo)."""
    try:
        dev = os.stat(path).st_dev
        best = ""
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                major, minor = (int(x) for x in fields[2].split(":"))
                if os.makedev(major, minor) == dev and len(rest) >= 2:
                    best = f"{rest[1]} {rest[0]} on {fields[4]}"
        return best or f"device {dev:x}"
    except (OSError, ValueError, IndexError):
        return "unknown storage"


def machine_name() -> str:
    """The CPU model, its count and the memory, as /proc tells (best effort)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem = f", {int(f.readline().split()[1]) / (1 << 20):.0f} GiB RAM"
    return f"{cpu}, {os.cpu_count()} CPUs{mem}, kernel {platform.release()}"


def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + n]


def _write(path: str, data: list[np.ndarray], direct: bool) -> float:
    """Seconds to write the arrays ``data`` to a new file at ``path`` and fsync it (O_DIRECT: each
    aligned, each a multiple of 4 KiB)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0), 0o600)
    try:
        for a in data:
            mv = a.data.cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _drop(paths: list[str]) -> None:
    """Drop the (clean) pages of ``paths`` from the page cache."""
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "blobs")) for f in fs]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_bench(root: str, size: int, repeat: int, note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The measurements of ``snapstore bench`` (see the module docstring), as the JSON report's fields."""
    say = note or (lambda _s: None)
    repo = Repo.open(root)
    try:
        reads = ReadPaths(None)
        kept = RestoreRates(repo.db.read(lambda t: t.restore_rates()))  # the store's cold rate: drift is judged by it
        reads.load(repo.root, repo.db.read(lambda t: t.read_paths()), lambda: kept.rates().get("cold", 0.0))
        before = reads.describe()
        say(f"measuring cold reads of {size >> 20} MiB, {repeat} rounds ...")
        row, got = reads.measure_now(repo, size=size, rounds=max(repeat, PROBE_ROUNDS))
        scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=repo.tmp)
    finally:
        repo.close()
    try:
        return _measure(root, scratch, size, repeat, reads, row, got, before, say)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _saved(s: Store, tokens: list[int]) -> Any:
    """The scratch snapshot's match; StateError when the store no longer finds it (its settings from the
    environment dropped it: a TTL or an entry limit)."""
    m = s.match(tokens)
    if m is None:
        raise StateError("snapstore bench: the scratch store lost its snapshot before it was restored (check "
                         "$SNAPSTORE_TTL and $SNAPSTORE_MAX_ENTRIES), and run it again")
    return m


def _measure(root: str, scratch: str, size: int, repeat: int, reads: ReadPaths, row: Any, got: Any,
             before: dict[str, object], say: Callable[[str], None]) -> dict[str, Any]:
    """The writes and the scratch store's figures (``run_bench``'s body, in ``scratch``)."""
    n_rows = max(1, (size - _FIXED) // _ROW)
    nbytes = n_rows * _ROW + _FIXED
    rng = np.random.default_rng(48)
    src = {"fixed": _aligned(_FIXED), "kv": _aligned(n_rows * _ROW).reshape(n_rows, _ROW)}
    for a in src.values():
        a.reshape(-1)[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    dst = {k: _aligned(v.size).reshape(v.shape) for k, v in src.items()}
    for a in dst.values():
        a.reshape(-1)[:] = 0  # touched once, reused: an engine's arena
    whole = [src["fixed"].reshape(-1), src["kv"].reshape(-1)]
    raw_path = os.path.join(scratch, "raw")
    t: dict[str, list[float]] = {k: [] for k in ("write_buffered", "write_direct", "save", "cold", "cold_other",
                                                  "warm1", "warmN")}
    direct_ok = O_DIRECT != 0
    best_direct = max((c for c in CANDIDATES if c.method == "direct"), key=lambda c: got.rates.get(c.name, 0.0))
    # the path not chosen, restored too for comparison (none when the file system refuses O_DIRECT)
    other = BUFFERED if reads.on else best_direct if got.rates.get(best_direct.name, 0.0) > 0.0 else None
    mine = row._replace(cold_rate=0.0)  # in the scratch stores: no drift to judge (their figures start empty)
    other_row = mine._replace(method=other.method, threads=other.threads, piece=other.piece) if other else None
    lay = Layout(fixed={"fixed": Fixed("uint8", (_FIXED,))}, rows={"kv": Rows("uint8", (_ROW,))})
    ident = Identity(build="snapstore-bench", pack="bench", kv="u8")
    tokens = list(range(n_rows))

    def check() -> None:
        if not all(np.array_equal(dst[k], src[k]) for k in src):
            raise CorruptionError("snapstore bench: a restore was not byte-exact (a bug: please report it)")
        for a in dst.values():
            a.reshape(-1)[::65536] ^= 0xFF  # the next restore must write every piece again

    for r in range(repeat):
        say(f"round {r + 1} of {repeat} ...")
        t["write_buffered"].append(_write(raw_path, whole, False))
        if direct_ok:
            try:
                t["write_direct"].append(_write(raw_path, whole, True))
            except OSError:
                direct_ok = False
        os.unlink(raw_path)
        sdir = os.path.join(scratch, f"store-{r}")
        # the defaults (RAM tier on), but the save always writes: a write admission or write budget set for
        # the user's stores would skip it (the reserve of free space stays theirs: a save it refuses is reported)
        budget = Budget(disk_bytes=4 * nbytes + (256 << 20), write_bytes_per_hour=0)
        with Store.open(sdir, identity=ident, layout=lay, budget=budget, admit="always") as s:
            t0 = time.perf_counter()
            saved = s.save(tokens, src, parent=None)
            t["save"].append(time.perf_counter() - t0)
            if not saved.ok:
                why = saved.skipped
                fix = f"free space on {root}, or lower $SNAPSTORE_RESERVE_MIB or --size-mib" if why == "disk_full" \
                    else "a store setting in the environment ($SNAPSTORE_*) refused it: unset it"
                raise StateError(f"snapstore bench: the scratch store's save of {nbytes >> 20} MiB was skipped "
                                 f"({why}): {fix}, and run it again")

        def with_chosen(sdir: str = sdir, budget: Budget = budget) -> None:
            with Store.open(sdir, identity=ident, layout=lay, budget=budget, admit="always") as s:  # a fresh RAM tier
                s._reads.apply(mine)  # the choice just measured for this storage (the scratch store is on it too)
                m = _saved(s, tokens)
                _drop(_files(sdir))
                for k in ("cold", "warm1", "warmN"):
                    t[k].append(_timed(partial(s.restore, m, dst)))
                    check()
                    if s._ram is not None:
                        s._ram.drain()  # admission runs in the background, off the restore's path

        def with_other(sdir: str = sdir, budget: Budget = budget) -> None:
            if other_row is None:
                return
            with Store.open(sdir, identity=ident, layout=lay, budget=budget, admit="always") as s:  # none held yet
                s._reads.apply(other_row)  # the path not chosen, for comparison
                m = _saved(s, tokens)
                _drop(_files(sdir))
                t["cold_other"].append(_timed(partial(s.restore, m, dst)))
                check()

        steps: list[Callable[..., None]] = [with_chosen, with_other] if r % 2 == 0 else [with_other, with_chosen]
        for step in steps:  # alternating: the same time since the save for both paths (a cold read right
            step()  # after a direct write can run slower on a virtual disk: docs/benchmarks.md)
        shutil.rmtree(sdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in t.items() if v}

    def rate(k: str) -> float:
        return nbytes / med[k] if k in med else 0.0

    raw = {"write_buffered": rate("write_buffered"), "write_direct": rate("write_direct")}
    raw.update({f"read_cold_{name}": v for name, v in got.rates.items() if name != CACHED})
    raw["read_warm"] = got.rates.get(CACHED, 0.0)
    best_write = max(raw["write_buffered"], raw["write_direct"])
    best_read = max(v for k, v in raw.items() if k.startswith("read_cold_"))
    warm = raw["read_warm"]
    chosen = candidate(row.method, row.threads, row.piece).name
    store = {
        "save": {"Bps": rate("save"), "x": rate("save") / best_write if best_write else 0.0},
        f"restore_cold_{chosen}": {"Bps": rate("cold"), "x": rate("cold") / best_read if best_read else 0.0},
        "restore_warm_first": {"Bps": rate("warm1"), "x": rate("warm1") / warm if warm else 0.0},
        "restore_warm_later": {"Bps": rate("warmN"), "x": rate("warmN") / warm if warm else 0.0},
    }
    if other is not None:
        store[f"restore_cold_{other.name}"] = {"Bps": rate("cold_other"),
                                               "x": rate("cold_other") / best_read if best_read else 0.0}
    return {"dir": root, "storage": storage_name(root), "storage_key": storage_key(root), "machine": machine_name(),
            "load": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, "bytes": nbytes,
            "repeat": repeat, "raw": raw, "store": store,
            "read_path": {"chosen": chosen, "why": row.reason, "figures": got.rates, "dropped": got.dropped,
                          "before": before.get("method"), "before_why": before.get("why")}}


def cmd_bench(args: argparse.Namespace, ctx: CliContext) -> int:
    """``snapstore bench``: measure, then print the table (or one JSON object)."""
    size_mib, repeat = int(args.size_mib), int(args.repeat)
    if not 16 <= size_mib <= 8192:
        raise UsageError(f"--size-mib must be 16 to 8192, got {size_mib}")
    if not 1 <= repeat <= 9:
        raise UsageError(f"--repeat must be 1 to 9, got {repeat}")
    root = _root(args)
    t0 = time.perf_counter()
    rep = run_bench(root, size_mib * MIB, repeat, None if ctx.json else ctx.note)
    rep["seconds"] = time.perf_counter() - t0
    if ctx.json:
        ctx.emit_json({"format": FORMAT, "command": "bench", **rep})
        return EXIT_OK
    gb = 1e9
    ctx.line(f"snapstore bench: {rep['dir']}")
    ctx.line(f"storage: {rep['storage']} ({rep['storage_key']}); {rep['machine']}")
    load = rep["load"]
    ctx.line(f"{rep['bytes'] / MIB:.0f} MiB, medians of {rep['repeat']}, load average "
             + (" ".join(f"{x:.1f}" for x in load) if load else "unknown") + " (a busy machine: read the ratios)")
    ctx.line("")
    ctx.line(f"{'raw limits':40}{'GB/s':>8}")
    names = {"write_buffered": "write + fsync, buffered", "write_direct": "write + fsync, O_DIRECT",
             "read_warm": "read from the page cache"}
    for k, v in rep["raw"].items():
        label = names.get(k, "read cold, " + k.removeprefix("read_cold_").replace("direct", "O_DIRECT"))
        ctx.line(f"  {label:38}{v / gb:8.2f}" if v else f"  {label:38}{'refused':>8}")
    ctx.line("")
    ctx.line(f"{'store (defaults), same run':40}{'GB/s':>8}  x best raw")
    labels = {"save": "save (durable)", "restore_warm_first": "restore, 1st warm",
              "restore_warm_later": "restore, later warm (RAM tier)"}
    chosen = rep["read_path"]["chosen"]
    for k, v in rep["store"].items():
        label = labels.get(k, "restore cold, " + k.removeprefix("restore_cold_"))
        if k == f"restore_cold_{chosen}":
            label += " (chosen)"
        ctx.line(f"  {label:38}{v['Bps'] / gb:8.2f}  {v['x']:.2f}x")
    ctx.line("")
    ctx.line(f"read path: {chosen} — {rep['read_path']['why']}")
    ctx.line(f"(kept in the store's catalog for this storage; {rep['seconds']:.0f} s)")
    return EXIT_OK
