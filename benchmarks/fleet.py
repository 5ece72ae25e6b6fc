"""A fleet on one shared tier: N node processes over one loopback SeaweedFS cluster, with churn and faults.

Each node is a process running a small engine of numpy state through snapstore's public API
(``Store.open(remote=...)``, ``match``, ``restore``, ``save``, ``flush``) against one bucket prefix.
The parent draws a workload from a model of real traffic and hands requests to whichever node is
free:

  * a few shared system prompts (1-3K tokens) with Zipf popularity (s = 1.1), each request's prompt
    the system prompt plus a user turn;
  * many one-off prompts (a system prompt and a long unique suffix, never seen again);
  * multi-turn conversations (2-6 turns): each turn extends the previous prompt and goes to
    whichever node is free next, so conversations move between nodes.

A request is: ``match`` the prompt, ``restore`` what matched (every restored byte compared with the
state the prompt's tokens define), "prefill" the rest, ``save`` the system-prompt boundary and the
whole prompt, ``flush`` (a save is *acknowledged* when its flush reports it published). Meanwhile:

  * churn: a node is SIGKILLed every ``--kill-every`` seconds at a chosen point (mid-save, mid-upload
    i.e. between ``save`` returning and ``flush`` returning, mid-restore, or idle), and a new node
    joins with an empty local store in its place;
  * one maintenance node runs ``snapstore gc --remote --grace 5`` and ``snapstore verify --remote``
    (the CLI, in-process) every ``--gc-every`` seconds;
  * the volume server holding half the bucket's volumes is SIGKILLed once and restarted.

After the run: a node that joins empty with the shared tier and one without it take the same
``--newcomer`` requests (hit rates over their first requests); a checker node restores every
acknowledged snapshot from the bucket (streamed, so each one really comes from the bucket);
``gc --remote`` then ``verify --remote --deep``; and a restore of one long prompt from the bucket is
timed against a raw GET of the same chunk objects (same client, same parallelism, medians).

S3 requests are counted in every node process by wrapping the S3 client's methods (one count per
request the client makes; a LIST counts one per page of 1000), by operation: match, restore (+ the
background import), save (+ the background upload), gc, verify.

``python benchmarks/fleet.py --nodes 16 --minutes 5 --json fleet.json``. Figures: docs/benchmarks.md
"A fleet on one bucket"; what survived which fault: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3_fixtures import SeaweedCluster, _die_with_parent  # noqa: E402

import snapstore  # noqa: E402

LAYOUT = snapstore.Layout(fixed={"st": snapstore.Fixed("float32", (8, 8))},
                          rows={"kv": snapstore.Rows("float16", (2, 64))})  # 256 bytes a token
ROW_BYTES = 2 * 64 * 2
ST_BYTES = 8 * 8 * 4
CHUNK = 64 << 10
IDENT = snapstore.Identity(build="fleet-1", pack="sha256:fleet-bench", kv="f16")
_M = np.uint64(0x9E3779B97F4A7C15)


# -- the engine's state: a pure function of the tokens ------------------------------------------
def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """h[i] identifies tokens[:i+1] (a rolling hash: row i depends on every token before it, as K/V does)."""
    out = np.empty(len(tokens), dtype=np.uint64)
    h = 1469598103934665603
    for i, t in enumerate(tokens.tolist()):
        h = ((h ^ (t + 0x9E37)) * 1099511628211 + i) & 0xFFFFFFFFFFFFFFFF
        out[i] = h
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def kv_rows(h: np.ndarray) -> np.ndarray:
    """The K/V rows of a prefix whose hashes are ``h`` (float16 (n, 2, 64), finite)."""
    with np.errstate(over="ignore"):
        x = _mix(h[:, None] ^ (np.arange(128, dtype=np.uint64)[None, :] * _M))
    vals = ((x >> np.uint64(40)) % np.uint64(2001)).astype(np.float32) / 1000 - 1
    return vals.astype(np.float16).reshape(-1, 2, 64)


def fixed_state(h_last: int, n: int) -> np.ndarray:
    """The fixed part a save of the prefix of length ``n`` (last hash ``h_last``) holds."""
    x = _mix(np.arange(64, dtype=np.uint64) + np.uint64(h_last) + np.uint64(n))
    return ((x >> np.uint64(40)) % np.uint64(1 << 20)).astype(np.float32).reshape(8, 8)


# -- S3 request counting (instrumentation of this process's client, not a substitute for it) -----
_COUNTS: dict[str, dict[str, list[int]]] = {}
_OP = ["open"]
_LOCK = threading.Lock()


def _tally(method: str, key: str, nbytes: int, n: int = 1) -> None:
    name = threading.current_thread().name
    op = ("upload" if name.startswith("snapstore-upload") else "import" if name.startswith("snapstore-import")
          else _OP[0])
    kind = key.split("/")[1] if key.count("/") >= 1 else "?"  # c chunk, m manifest, u use, l lease
    with _LOCK:
        c = _COUNTS.setdefault(op, {}).setdefault(f"{method} {kind}", [0, 0])
        c[0] += n
        c[1] += nbytes


def install_counters() -> None:
    """Wrap S3Client's request methods so each request is tallied by operation, method and object kind."""
    from snapstore.remote.s3client import S3Client
    put_new, put, head, get, stream, lst, delete = (S3Client.put_new, S3Client.put, S3Client.head, S3Client.get,
                                                     S3Client.stream, S3Client.list, S3Client.delete)

    def c_put_new(self: S3Client, key: str, data: bytes | memoryview) -> bool:
        _tally("PUT", key, len(data))
        return put_new(self, key, data)

    def c_put(self: S3Client, key: str, data: bytes | memoryview) -> None:
        _tally("PUT", key, len(data))
        put(self, key, data)

    def c_head(self: S3Client, key: str) -> Any:
        _tally("HEAD", key, 0)
        return head(self, key)

    def c_get(self: S3Client, key: str, limit: int) -> bytes | None:
        out = None
        try:
            out = get(self, key, limit)
            return out
        finally:
            _tally("GET", key, len(out) if out else 0)

    def c_stream(self: S3Client, key: str, piece: int = 8 << 20) -> Any:
        _tally("GET", key, 0)
        res = stream(self, key, piece)
        if res is None:
            return None
        size, pieces = res

        def counted() -> Iterator[memoryview]:
            for p in pieces:
                _tally("GET", key, len(p), n=0)
                yield p

        return size, counted()

    def c_list(self: S3Client, prefix: str) -> Iterator[Any]:
        _tally("LIST", prefix, 0)
        for i, info in enumerate(lst(self, prefix)):
            if i and i % 1000 == 0:
                _tally("LIST", prefix, 0)
            yield info

    def c_delete(self: S3Client, keys: Any) -> None:
        for k in keys:
            _tally("DELETE", k, 0)
        delete(self, keys)

    for name, fn in (("put_new", c_put_new), ("put", c_put), ("head", c_head), ("get", c_get),
                     ("stream", c_stream), ("list", c_list), ("delete", c_delete)):
        setattr(S3Client, name, fn)


def _take_counts() -> dict[str, dict[str, list[int]]]:
    with _LOCK:
        out = {op: {k: list(v) for k, v in d.items()} for op, d in _COUNTS.items()}
        _COUNTS.clear()
    return out


# -- a node process -------------------------------------------------------------------------------
def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def node_main(cfg: dict[str, Any]) -> None:
    """One inference node: requests on stdin (one JSON line each), phases and results on stdout."""
    install_counters()
    store = snapstore.Store.open(cfg["dir"], identity=IDENT, layout=LAYOUT, remote=cfg.get("url"),
                                 chunk_bytes=CHUNK, staging_bytes=CHUNK * 4,
                                 budget=snapstore.Budget(disk_bytes=cfg.get("disk_mib", 256) << 20, ram_bytes=0,
                                                         reserve_bytes=0))
    _say({"ready": True, "s3": _take_counts()})
    for line in sys.stdin:
        req = json.loads(line)
        toks = np.asarray(req["tokens"], dtype=np.int64)
        h = prefix_hashes(toks)
        out: dict[str, Any] = {"done": req["id"]}
        t0 = time.perf_counter()
        _OP[0] = "match"
        m = store.match(toks)
        t1 = time.perf_counter()
        got = m.n_tokens if m is not None else 0
        out.update(matched=got, remote=type(m).__name__ == "RemoteMatch", match_s=t1 - t0)
        if m is not None:
            _say({"phase": "restore", "id": req["id"]})
            _OP[0] = "restore"
            kv = np.zeros((len(toks), 2, 64), dtype=np.float16)
            st = np.zeros((8, 8), dtype=np.float32)
            try:
                store.restore(m, {"st": st, "kv": kv})
                ok = (kv[:got].tobytes() == kv_rows(h[:got]).tobytes()
                      and st.tobytes() == fixed_state(int(h[got - 1]), got).tobytes())
                out["restore"] = "ok" if ok else "wrong"
                out["restored_bytes"] = got * ROW_BYTES + ST_BYTES
            except snapstore.SnapstoreError as e:
                out["restore"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                got = 0  # recompute everything, as an engine would
            out["restore_s"] = time.perf_counter() - t1
        if not req.get("check"):
            _OP[0] = "save"
            sys_len = req["sys"]
            lengths = [n for n in (sys_len, len(toks)) if n > got and n <= len(toks)]
            lengths = sorted(set(lengths))
            saved = []
            if lengths:
                _say({"phase": "save", "id": req["id"]})
                kv_all = kv_rows(h)
                t2 = time.perf_counter()
                for n in lengths:
                    store.save(toks[:n], {"st": fixed_state(int(h[n - 1]), n), "kv": kv_all}, rows=n)
                    saved.append(n)
                out["save_s"] = time.perf_counter() - t2
                _say({"phase": "upload", "id": req["id"]})
            _OP[0] = "flush"
            t3 = time.perf_counter()
            f = store.flush(timeout=120)
            out.update(saved=saved, acked=bool(saved) and f.ok, uploaded=f.uploaded, flush_failed=f.failed,
                       flush_errors=f.errors[:2], flush_s=time.perf_counter() - t3)
        out["s3"] = _take_counts()
        _OP[0] = "idle"
        _say(out)
    store.close()


def maint_main(argv: list[str]) -> None:
    """The maintenance node: one ``snapstore`` CLI command in-process, its JSON and S3 requests on stdout."""
    from snapstore.cli.main import main as cli
    install_counters()
    _OP[0] = argv[0]
    rc = cli(argv)  # its JSON on stdout, then this line
    _say({"rc": rc, "s3": _take_counts()})


# -- the workload -----------------------------------------------------------------------------------
class Workload:
    """Shared system prompts with Zipf popularity, one-off prompts, multi-turn conversations."""

    def __init__(self, seed: int, n_system: int = 8, p_oneoff: float = 0.3, p_conv: float = 0.35):
        self.rng = random.Random(seed)
        self.system = [self._toks(self.rng.choice((1024, 1536, 2048, 3072))) for _ in range(n_system)]
        w = [1 / (k + 1) ** 1.1 for k in range(n_system)]
        self.weights = [x / sum(w) for x in w]
        self.p_oneoff, self.p_conv = p_oneoff, p_conv
        self.convs: list[dict[str, Any]] = []  # conversations waiting for their next turn
        self.lock = threading.Lock()
        self.next_id = 0

    def _toks(self, n: int) -> list[int]:
        return [self.rng.randrange(50_000) for _ in range(n)]

    def _sys(self) -> int:
        return self.rng.choices(range(len(self.system)), self.weights)[0]

    def next(self) -> dict[str, Any]:
        """The next request: {"id", "tokens", "sys" (system prompt length), "kind", "conv"}."""
        with self.lock:
            self.next_id += 1
            r = self.rng.random()
            if self.convs and r < self.p_conv:
                c = self.convs.pop(self.rng.randrange(len(self.convs)))
                c["tokens"] = c["tokens"] + self._toks(self.rng.randrange(64, 400))
                c["turn"] += 1
                return {"id": self.next_id, "tokens": c["tokens"], "sys": c["sys"], "kind": "turn", "conv": c}
            s = self._sys()
            if r < self.p_conv + 0.1:  # a new conversation
                c = {"tokens": self.system[s] + self._toks(self.rng.randrange(64, 400)), "sys": len(self.system[s]),
                     "turn": 1, "turns": self.rng.randrange(2, 7)}
                return {"id": self.next_id, "tokens": c["tokens"], "sys": c["sys"], "kind": "turn", "conv": c}
            if r < self.p_conv + 0.1 + self.p_oneoff:
                return {"id": self.next_id, "tokens": self.system[s] + self._toks(self.rng.randrange(512, 2048)),
                        "sys": len(self.system[s]), "kind": "oneoff", "conv": None}
            return {"id": self.next_id, "tokens": self.system[s] + self._toks(self.rng.randrange(16, 128)),
                    "sys": len(self.system[s]), "kind": "system", "conv": None}

    def done(self, req: dict[str, Any], completed: bool) -> None:
        """A conversation's turn finished (or its node died: the turn goes again elsewhere)."""
        c = req["conv"]
        if c is None:
            return
        if not completed:
            c["turn"] -= 1  # its node died: the conversation goes on elsewhere
        with self.lock:
            if c["turn"] < c["turns"] or not completed:
                self.convs.append(c)


# -- the parent ---------------------------------------------------------------------------------------
HERE = Path(__file__).resolve()


class Node:
    """A node process and the pipe to it."""

    def __init__(self, fleet: Fleet, name: str, url: str | None, extra_env: dict[str, str] | None = None):
        self.name = name
        self.dir = os.path.join(fleet.tmp, name)
        env = {**os.environ, **fleet.env, **(extra_env or {})}
        cfg = {"dir": self.dir, "url": url}
        self.err = open(self.dir + ".err", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--node", json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err,
                                     env=env, text=True, bufsize=1,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 - no node outlives the run
        self.fleet = fleet
        self.kill_at: str | None = None  # a phase to SIGKILL this node in
        self.killed: str | None = None
        first = self.read()
        if first is None or not first.get("ready"):
            raise RuntimeError(f"node {name} did not start: {Path(self.dir + '.err').read_text()[-2000:]}")
        fleet.add_counts(first["s3"])

    def read(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def request(self, req: dict[str, Any]) -> dict[str, Any] | None:
        """Send one request; None when the node died (was killed) before answering."""
        assert self.proc.stdin is not None
        body = {"id": req["id"], "tokens": req["tokens"], "sys": req["sys"], "check": req.get("check", False)}
        try:
            self.proc.stdin.write(json.dumps(body) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        while True:
            doc = self.read()
            if doc is None:
                return None
            if "phase" in doc:
                if self.kill_at == doc["phase"]:
                    time.sleep(self.fleet.rng.uniform(0, 0.03))
                    self.kill(doc["phase"])
                continue
            return doc

    def kill(self, where: str) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.killed = where

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


class Fleet:
    """The run: cluster, nodes, chaos, bookkeeping."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.rng = random.Random(a.seed)
        self.tmp = tempfile.mkdtemp(prefix="snapstore-fleet-")
        self.counts: dict[str, dict[str, list[int]]] = {}
        self.lock = threading.Lock()
        self.acked: dict[tuple[int, ...], int] = {}  # prefix -> times acknowledged
        self.saved_logical = 0
        self.saved_rows: set[int] = set()
        self.saved_fixed: set[tuple[int, int]] = set()
        self.results: list[dict[str, Any]] = []
        self.kills: dict[str, int] = {}
        self.events: list[str] = []
        self.verify_midrun: list[dict[str, Any]] = []
        self.gc_runs: list[dict[str, Any]] = []
        self.joined = 0
        self.maint_errors: list[str] = []
        self.maint_s: dict[str, list[float]] = {}
        self.stop_at = float("inf")  # set to 0 to end the run early

    def add_counts(self, c: dict[str, dict[str, list[int]]]) -> None:
        with self.lock:
            for op, d in c.items():
                for k, (n, b) in d.items():
                    x = self.counts.setdefault(op, {}).setdefault(k, [0, 0])
                    x[0] += n
                    x[1] += b

    def record(self, req: dict[str, Any], res: dict[str, Any]) -> None:
        """Bookkeeping of one answered request (acknowledged saves, logical and unique bytes)."""
        self.add_counts(res.pop("s3", {}))
        with self.lock:
            self.results.append({**res, "kind": req["kind"], "n": len(req["tokens"])})
            if res.get("acked"):
                h = prefix_hashes(np.asarray(req["tokens"], dtype=np.int64))
                for n in res["saved"]:
                    key = tuple(req["tokens"][:n])
                    self.acked[key] = self.acked.get(key, 0) + 1
                    self.saved_logical += n * ROW_BYTES + ST_BYTES
                    self.saved_rows.update(h[:n].tolist())
                    self.saved_fixed.add((int(h[n - 1]), n))

    def maint(self, *argv: str) -> dict[str, Any] | None:
        """Run one snapstore CLI command on the maintenance node: its JSON report, or None (recorded) if it failed."""
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, str(HERE), "--maint", *argv], capture_output=True, text=True,
                           env={**os.environ, **self.env}, timeout=300, check=False)
        self.maint_s.setdefault(argv[0], []).append(time.perf_counter() - t0)  # with the process start
        lines = p.stdout.strip().splitlines()
        try:
            doc: dict[str, Any] = json.loads(lines[-1])
            self.add_counts(doc.pop("s3", {}))
            out: dict[str, Any] = json.loads("\n".join(lines[:-1]) or p.stderr)
        except (ValueError, IndexError):
            out = {"error": (p.stdout + p.stderr)[-600:]}
        if "error" in out:
            with self.lock:
                self.maint_errors.append(f"{time.monotonic() - self.t0:.1f}s {argv[0]}: {str(out['error'])[:400]}")
            return None
        return out

    def worker(self, slot: int, work: Workload, stop: float) -> None:
        """One node slot: a node serves requests until the run ends; a killed one is replaced by a new, empty one."""
        gen = 0
        node = Node(self, f"n{slot}-{gen}", self.url)
        with self.lock:
            self.slots[slot] = node
        while time.monotonic() < min(stop, self.stop_at):
            req = work.next()
            res = node.request(req)
            if res is None:
                work.done(req, completed=False)
                with self.lock:
                    where = node.killed or "crash"
                    self.kills[where] = self.kills.get(where, 0) + 1
                    self.events.append(f"{time.monotonic() - self.t0:.1f}s {node.name} killed ({where})")
                node.close()
                gen += 1
                node = Node(self, f"n{slot}-{gen}", self.url)
                with self.lock:
                    self.joined += 1
                    self.slots[slot] = node
                continue
            self.record(req, res)
            work.done(req, completed=True)
            time.sleep(self.a.think)
        node.close()

    def chaos(self, stop: float) -> None:
        """Kill a node every --kill-every s at a chosen point; restart the volume server once; gc + verify."""
        modes = ["save", "upload", "restore", "any"]
        next_kill = time.monotonic() + self.a.kill_every
        next_gc = time.monotonic() + self.a.gc_every
        vol_at = self.t0 + (stop - self.t0) * 0.45
        vol_done = False
        i = 0
        while time.monotonic() < stop:
            now = time.monotonic()
            if now >= next_kill:
                with self.lock:
                    live = [n for n in self.slots.values() if n.proc.poll() is None and n.kill_at is None]
                if live:
                    victim = self.rng.choice(live)
                    mode = modes[i % len(modes)]
                    i += 1
                    if mode == "any":  # wherever it is
                        victim.kill("any")
                    else:
                        victim.kill_at = mode
                next_kill = now + self.a.kill_every
            if not vol_done and now >= vol_at:
                vol_done = True
                self.events.append(f"{now - self.t0:.1f}s volume server 1 SIGKILLed")
                self.cluster.stop_volume(1)
                time.sleep(self.a.volume_down)
                self.cluster.start_volume(1)
                self.cluster.wait_volumes()
                vdir = os.path.join(self.cluster.root, "vol1")
                self.events.append(f"{time.monotonic() - self.t0:.1f}s volume server 1 back "
                                   f"({len([f for f in os.listdir(vdir) if f.endswith('.dat')])} volumes on disk)")
            if now >= next_gc:
                g = self.maint("gc", "--remote", self.url, "--grace", "5", "--json")
                if g is not None:
                    self.gc_runs.append(g)
                v = self.maint("verify", "--remote", self.url, "--json")
                if v is not None:
                    self.verify_midrun.append(v)
                next_gc = time.monotonic() + self.a.gc_every
            time.sleep(0.2)

    def run(self) -> dict[str, Any]:
        """Start the cluster, run the fleet, measure, stop everything."""
        for attempt in range(3):
            try:
                self.cluster = SeaweedCluster().start(timeout=120.0)
                break
            except TimeoutError:
                if attempt == 2:
                    raise
        try:
            return self._run()
        finally:
            self.cluster.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _run(self) -> dict[str, Any]:
        a = self.a
        self.env = {**self.cluster.env(), "SNAPSTORE_REMOTE_GC_WINDOW_S": "0.5", "SNAPSTORE_REMOTE_TIMEOUT_S": "10"}
        self.cluster.create_bucket("fleet")
        run = secrets.token_hex(4)
        self.url = f"s3://fleet/run-{run}"
        work = Workload(a.seed)
        self.slots: dict[int, Node] = {}
        self.t0 = time.monotonic()
        stop = self.t0 + a.minutes * 60
        with ThreadPoolExecutor(max_workers=a.nodes) as pool:
            futs = [pool.submit(self.worker, i, work, stop) for i in range(a.nodes)]
            # on this (the main) thread: a server is killed when the thread that started it exits
            # (s3_fixtures' parent-death signal), so the restarted volume server must outlive the run
            try:
                self.chaos(stop)
            except BaseException:  # Ctrl-C, SIGTERM: stop every node now, not at the end of the run
                self.stop_at = 0.0
                with self.lock:
                    for n in self.slots.values():
                        n.kill("interrupted")
                raise
            for f in futs:
                f.result()
        wall = time.monotonic() - self.t0
        out: dict[str, Any] = {"nodes": a.nodes, "minutes": a.minutes, "wall_s": round(wall, 1),
                               "kill_every": a.kill_every, "gc_every": a.gc_every,
                               "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
        # -- a node joining empty with the shared tier vs one without it, the same requests
        reqs = [work.next() for _ in range(a.newcomer)]
        out["newcomer"] = {}
        for label, url in (("shared_tier", self.url), ("no_tier", None)):
            n = Node(self, f"newcomer-{label}", url)
            hits = tokens = total = 0
            for r in reqs:
                res = n.request(r)
                assert res is not None, f"newcomer {label} died"
                if label == "shared_tier":
                    self.record(r, dict(res))
                hits += res["matched"] > 0
                tokens += res["matched"]
                total += len(r["tokens"])
            n.close()
            out["newcomer"][label] = {"requests": len(reqs), "hit_rate": round(hits / max(1, len(reqs)), 3),
                                      "token_hit_rate": round(tokens / max(1, total), 3)}
        # -- every acknowledged snapshot restored from the bucket by a new node
        checker = Node(self, "checker", self.url, {"SNAPSTORE_REMOTE_RESTORE": "stream"})
        lost: list[dict[str, Any]] = []
        wrong_check = 0
        acked = list(self.acked)
        for i, toks in enumerate(acked):
            res = checker.request({"id": -i - 1, "tokens": list(toks), "sys": 0, "check": True})
            assert res is not None, "the checker died"
            self.add_counts(res.pop("s3", {}))
            if res.get("restore") == "wrong":
                wrong_check += 1
            if res["matched"] != len(toks) or res.get("restore") != "ok" or not res["remote"]:
                lost.append({"tokens": len(toks), "matched": res["matched"], "remote": res["remote"],
                             "reason": res.get("restore", "no match in the bucket")})
        checker.close()
        # -- gc (every lease is stale now: every node has stopped) and a deep verify
        g = self.maint("gc", "--remote", self.url, "--grace", "0", "--lease-ttl", "0", "--json") or \
            {"chunks_removed": 0, "leases_removed": 0}
        v = self.maint("verify", "--remote", self.url, "--deep", "--json")
        if v is None:  # the bucket could not be read whole: every manifest counts as unverified
            v = {"damaged_manifests": ["verify failed"], "missing_chunks": [], "corrupt_chunks": [], "manifests": 0,
                 "chunks": 0, "chunk_bytes": 0, "orphan_chunks": 0, "live_leases": 0}
        problems = len(v["damaged_manifests"]) + len(v["missing_chunks"]) + len(v["corrupt_chunks"])
        mid = sum(len(x["damaged_manifests"]) + len(x["missing_chunks"]) + len(x["corrupt_chunks"])
                  for x in self.verify_midrun)
        res_all = self.results
        restores = [r for r in res_all if "restore" in r]
        unique = len(self.saved_rows) * ROW_BYTES + len(self.saved_fixed) * ST_BYTES
        out.update({
            "requests": len(res_all),
            "restores": len(restores),
            "restores_ok": sum(1 for r in restores if r["restore"] == "ok"),
            "restores_failed": sum(1 for r in restores if r["restore"].startswith("failed")),
            "restore_failures": sorted({r["restore"][:120] for r in restores if r["restore"].startswith("failed")})[:8],
            "wrong_restores": sum(1 for r in restores if r["restore"] == "wrong") + wrong_check,
            "acknowledged": len(acked),
            "lost_acknowledged": len(lost),
            "lost": lost[:20],
            "verify_problems": problems + mid,
            "verify_final": {k: v[k] for k in ("manifests", "chunks", "chunk_bytes", "orphan_chunks", "live_leases")},
            "verify_midrun_runs": len(self.verify_midrun),
            "verify_findings": [{"when": when, **{k: x[k][:5] for k in ("damaged_manifests", "missing_chunks",
                                                                          "corrupt_chunks")}}
                                for when, x in [*(("mid-run", y) for y in self.verify_midrun), ("final", v)]
                                if x["damaged_manifests"] or x["missing_chunks"] or x["corrupt_chunks"]],
            "gc_runs": len(self.gc_runs) + 1,
            "gc_removed_chunks": sum(x["chunks_removed"] for x in self.gc_runs) + g["chunks_removed"],
            "gc_removed_leases": sum(x["leases_removed"] for x in self.gc_runs) + g["leases_removed"],
            "kills": self.kills,
            "joined_empty": self.joined,
            "events": self.events,
            "maintenance_errors": self.maint_errors,
            "maintenance_seconds": {k: [round(x, 1) for x in v] for k, v in self.maint_s.items()},
            "saved_logical_bytes": self.saved_logical,
            "unique_bytes": unique,
            "bucket_bytes": v["chunk_bytes"],
            "dedup_ratio": round(self.saved_logical / max(1, v["chunk_bytes"]), 2),
            "bucket_over_unique": round(v["chunk_bytes"] / max(1, unique), 3),
        })
        if self.maint_errors:  # what the object store said meanwhile
            out["server_log_tail"] = Path(self.cluster.root, "server.log").read_text(errors="replace")[-1500:]
            out["volume1_log_tail"] = Path(self.cluster.root, "vol1.log").read_text(errors="replace")[-1500:]
        out["s3"] = self.per_op(res_all)
        out.update(self.throughput())
        return out

    def per_op(self, res_all: list[dict[str, Any]]) -> dict[str, Any]:
        """S3 requests and bytes per operation (totals, and per match / saved snapshot / bucket restore)."""
        c = self.counts
        saves = sum(len(r.get("saved", [])) for r in res_all)
        remote_restores = sum(1 for r in res_all if r.get("remote") and "restore" in r)
        matches = len(res_all)

        def merged(*ops: str) -> dict[str, list[int]]:
            m: dict[str, list[int]] = {}
            for op in ops:
                for k, (n, b) in c.get(op, {}).items():
                    x = m.setdefault(k, [0, 0])
                    x[0] += n
                    x[1] += b
            return m

        def per(d: dict[str, list[int]], n: int) -> dict[str, Any]:
            by_method: dict[str, list[int]] = {}
            for k, (cnt, b) in d.items():
                x = by_method.setdefault(k.split()[0], [0, 0])
                x[0] += cnt
                x[1] += b
            return {"count": n, **{meth: round(v[0] / max(1, n), 2) for meth, v in sorted(by_method.items())},
                    "bytes": round(sum(v[1] for v in by_method.values()) / max(1, n))}

        return {"totals": c,
                "per_save": per(merged("save", "upload", "flush"), saves),
                "per_bucket_restore": per(merged("restore", "import"), remote_restores),
                "per_match": per(merged("match"), matches),
                "per_gc": per(merged("gc"), max(1, len(self.gc_runs) + 1)),
                "per_verify": per(merged("verify"), max(1, len(self.verify_midrun) + 1)),
                "node_open": per(merged("open"), max(1, self.a.nodes + self.joined + 3))}

    def throughput(self) -> dict[str, Any]:
        """Restore of one long prompt from the bucket vs a raw GET of the same chunk objects (medians)."""
        from snapstore.remote.keys import LAYOUT as KEYS
        from snapstore.remote.s3client import S3Client
        os.environ.update(self.env)
        url = self.url + "-tput"
        n = self.a.tput_tokens
        toks = np.random.default_rng(7).integers(0, 50_000, n)
        h = prefix_hashes(toks)
        kv = kv_rows(h)
        st = fixed_state(int(h[-1]), n)
        budget = snapstore.Budget(disk_bytes=1 << 30, ram_bytes=0, reserve_bytes=0)
        with snapstore.Store.open(os.path.join(self.tmp, "tput-src"), identity=IDENT, layout=LAYOUT, remote=url,
                                  chunk_bytes=CHUNK, staging_bytes=CHUNK * 4, budget=budget, remote_wait=True) as s:
            s.save(toks, {"st": st, "kv": kv}, rows=n)
        client = S3Client(url)
        keys = [i.key for i in client.list(f"{KEYS}/c/")]
        size = sum(i.size for i in client.list(f"{KEYS}/c/"))
        t_restore: list[float] = []
        t_raw: list[float] = []
        t_match: list[float] = []
        for r in range(self.a.rounds):
            d = os.path.join(self.tmp, f"tput-{r}")
            with snapstore.Store.open(d, identity=IDENT, layout=LAYOUT, remote=url, chunk_bytes=CHUNK,
                                      staging_bytes=CHUNK * 4, budget=budget) as s:
                dest_kv = np.zeros_like(kv)
                dest_st = np.zeros_like(st)
                t0 = time.perf_counter()
                m = s.match(toks)
                t1 = time.perf_counter()
                assert m is not None and m.n_tokens == n
                s.restore(m, {"st": dest_st, "kv": dest_kv})
                t_restore.append(time.perf_counter() - t1)
                t_match.append(t1 - t0)
                assert dest_kv.tobytes() == kv.tobytes() and dest_st.tobytes() == st.tobytes()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=4) as pool:  # the tier reads 4 chunk objects at a time
                got = sum(len(b or b"") for b in pool.map(lambda k: client.get(k, 1 << 30), keys))
            t_raw.append(time.perf_counter() - t0)
            assert got == size
        mr, mg = statistics.median(t_restore), statistics.median(t_raw)
        return {"tput_bytes": size, "tput_chunks": len(keys), "restore_mib_s": round(size / mr / (1 << 20), 1),
                "raw_get_mib_s": round(size / mg / (1 << 20), 1), "get_ratio": round(mg / mr, 3),
                "tput_match_s": round(statistics.median(t_match), 3),
                "tput_rounds": self.a.rounds, "tput_sha256": hashlib.sha256(kv.tobytes()).hexdigest()[:16]}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--json", metavar="FILE", help="write the report here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--think", type=float, default=0.2, help="seconds a node idles between requests")
    ap.add_argument("--kill-every", type=float, default=10.0, help="seconds between SIGKILLs of a node")
    ap.add_argument("--gc-every", type=float, default=30.0, help="seconds between gc + verify --remote runs")
    ap.add_argument("--volume-down", type=float, default=5.0, help="seconds the volume server stays down")
    ap.add_argument("--newcomer", type=int, default=100, help="requests for the joining-empty hit rates")
    ap.add_argument("--tput-tokens", type=int, default=65536, help="tokens of the throughput prompt (256 B each)")
    ap.add_argument("--rounds", type=int, default=3)
    return ap.parse_args(argv)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the fleet benchmark with these arguments; the report (also written to --json)."""
    a = parse(argv)
    out = Fleet(a).run()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


def _term(signum: int, frame: object) -> None:
    """SIGTERM: unwind as Ctrl-C does, so the cluster and the nodes are stopped."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--node":
        node_main(json.loads(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--maint":
        maint_main(sys.argv[2:])
        return
    signal.signal(signal.SIGTERM, _term)
    out = run()
    brief = {k: out[k] for k in ("nodes", "requests", "restores", "wrong_restores", "acknowledged", "lost_acknowledged",
                                 "verify_problems", "dedup_ratio", "get_ratio", "kills", "joined_empty", "newcomer")}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
