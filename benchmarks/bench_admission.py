"""Write admission (issue 32, part 2): bytes written and hits of one replayed workload under
``admit="always"`` and ``admit="second_hit"`` (and, with ``--rate``, under a write rate).

    .venv/bin/python benchmarks/bench_admission.py                # 2,000 requests, 8 system prompts
    .venv/bin/python benchmarks/bench_admission.py --quick        # 300 requests
    .venv/bin/python benchmarks/bench_admission.py --workload chat [--sessions]

The workload (seeded, the same for every mode): each request is one of ``--systems`` shared system
prompts (``--system-tokens`` each, chosen Zipf-like: a few are popular) followed by a user message
of 32-512 tokens that nobody sends again, except ``--repeat-share`` of the requests, which resend an
earlier request's whole prompt (a retry, a regenerate). ``--workload chat``: conversations of
``--turns`` turns instead, interleaved, each turn the previous prompt plus 32-256 tokens (the case
where every saved prompt comes back exactly once); ``--sessions``: their saves name the session.
Like a PrefixCache with ``cache_prefix`` at
the system prompt, the client matches the prompt, restores what it found, then saves the state at
the system-prompt boundary and after the whole prompt (a delta over the boundary when that exists).

Per mode it prints: saves stored and skipped (by reason), bytes written (the stored bytes of every
save: chunk files written, deduplicated chunks not counted), bytes held at the end, hits (requests
whose match found a snapshot), hit tokens (prompt tokens not recomputed) and hit tokens per MiB
written. K/V rows are 256 bytes a token (random bytes: incompressible), chunks 64 KiB.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import snapstore as ss  # noqa: E402

ROW = 256
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (ROW,))})
IDENT = ss.Identity(build="bench-admission", pack="bench", kv="u8", mtp=False)
MIB = 1 << 20


Request = tuple[np.ndarray, str | None]  # the prompt's tokens, the session it continues (chat --sessions)


def workload(args: argparse.Namespace) -> list[Request]:
    """The requests, in order (token ids; a token's K/V row is a function of the id and position)."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(1, 1 << 30, args.system_tokens, dtype=np.int64) for _ in range(args.systems)]
    weights = 1.0 / np.arange(1, args.systems + 1)  # Zipf-like popularity
    weights /= weights.sum()
    out: list[Request] = []
    if args.workload == "chat":  # conversations of --turns turns, interleaved; each turn extends the last
        convs = [systems[int(rng.choice(args.systems, p=weights))] for _ in range(args.requests // args.turns)]
        order = rng.permutation(np.repeat(np.arange(len(convs)), args.turns))
        for c in order:
            convs[c] = np.concatenate([convs[c], rng.integers(1 << 30, 1 << 31, int(rng.integers(32, 257)),
                                                              dtype=np.int64)])
            out.append((convs[c], f"chat-{c}" if args.sessions else None))
        return out
    for _ in range(args.requests):
        if out and rng.random() < args.repeat_share:
            out.append(out[int(rng.integers(0, len(out)))])
            continue
        sys_p = systems[int(rng.choice(args.systems, p=weights))]
        user = rng.integers(1 << 30, 1 << 31, int(rng.integers(32, 513)), dtype=np.int64)
        out.append((np.concatenate([sys_p, user]), None))
    return out


def kv_rows(tokens: np.ndarray) -> np.ndarray:
    """Deterministic, incompressible rows: row i depends on tokens[:i+1] only through (token, i)."""
    out = np.empty((len(tokens), ROW), np.uint8)
    for i, tok in enumerate(tokens):
        out[i] = np.random.default_rng((int(tok), i)).integers(0, 256, ROW, dtype=np.uint8)
    return out


@dataclass
class Tally:
    mode: str
    stored: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    written: int = 0
    held: int = 0
    hits: int = 0
    hit_tokens: int = 0
    seconds: float = 0.0


def replay(mode: str, prompts: list[Request], rows: list[np.ndarray], boundary: int, root: str,
           rate: int | None) -> Tally:
    budget = ss.Budget(disk_bytes=64 << 30, ram_bytes=0, reserve_bytes=0, write_bytes_per_hour=rate)
    tally = Tally(mode + (f" + {rate / MIB:.0f} MiB/h" if rate else ""))
    t0 = time.perf_counter()
    with ss.Store.open(root, identity=IDENT, layout=LAYOUT, budget=budget, chunk_bytes=64 << 10,
                       staging_bytes=1 << 20, admit=mode) as s:
        for (tokens, session), kv in zip(prompts, rows, strict=True):
            m = s.match(tokens)
            if m is not None:
                tally.hits += 1
                tally.hit_tokens += m.n_tokens
                s.restore(m, {"kv": np.empty_like(kv)})
            for n in (boundary, len(tokens)):
                r = s.save(tokens[:n], {"kv": kv[:n]}, session=session if n == len(tokens) else None)
                if r.skipped:
                    tally.skipped[r.skipped] = tally.skipped.get(r.skipped, 0) + 1
                else:
                    tally.stored += 1
                    tally.written += r.stored_bytes
        tally.held = s.stats().stored_bytes
    tally.seconds = time.perf_counter() - t0
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--repeat-share", type=float, default=0.05)
    ap.add_argument("--workload", choices=("oneoff", "chat"), default="oneoff",
                    help="oneoff: one-off questions after shared system prompts; chat: multi-turn conversations")
    ap.add_argument("--turns", type=int, default=4, help="chat: turns a conversation")
    ap.add_argument("--sessions", action="store_true", help="chat: each conversation saves with session=")
    ap.add_argument("--rate", type=int, default=0, help="also run 'always' under this write rate (bytes an hour)")
    ap.add_argument("--seed", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="300 requests")
    ap.add_argument("--dir", default=os.environ.get("SNAPSTORE_BENCH_DIR") or None)
    args = ap.parse_args()
    if args.quick:
        args.requests = 300
    prompts = workload(args)
    rows = [kv_rows(p) for p, _ in prompts]
    runs: list[tuple[str, int | None]] = [("always", None), ("second_hit", None)]
    if args.rate:
        runs.append(("always", args.rate))
    shape = (f"{args.repeat_share:.0%} repeats" if args.workload == "oneoff" else
             f"chat of {args.turns} turns{' with sessions' if args.sessions else ', no sessions'}")
    print(f"# {args.requests} requests, {args.systems} system prompts of {args.system_tokens} tokens, {shape}; "
          f"{ROW} B a token; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{'mode':<28}{'stored':>8}{'skipped':>26}{'written MiB':>13}{'held MiB':>10}{'hits':>7}"
          f"{'hit tokens':>12}{'hit tok/MiB':>13}{'s':>7}")
    for mode, rate in runs:
        root = tempfile.mkdtemp(prefix="bench-admission-", dir=args.dir)
        try:
            t = replay(mode, prompts, rows, args.system_tokens, root, rate)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(t.skipped.items())) or "0"
        per = t.hit_tokens / (t.written / MIB) if t.written else 0.0
        print(f"{t.mode:<28}{t.stored:>8}{skipped:>26}{t.written / MIB:>13.1f}{t.held / MIB:>10.1f}{t.hits:>7}"
              f"{t.hit_tokens:>12}{per:>13.0f}{t.seconds:>7.1f}")


if __name__ == "__main__":
    main()
