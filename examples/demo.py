"""snapstore demo: a hybrid (Mamba2 + attention) model answers a long system prompt; a new process reuses it.

Run it twice (``./demo.sh`` does):

    python examples/demo.py --phase first    # conversation 1: reads the system prompt, snapshots it
    python examples/demo.py --phase second   # new process, conversation 2: restores the system prompt

Both phases go through ``snapstore.engine.hf.PrefixCache(model).generate(...)``, which returns what
``model.generate`` returns. The second phase also runs the same generate without the store
(``uncached_generate``: the same prefill split, from token 0) and checks that the output — every
token and every score — is byte-identical, and prints the time saved: after a warm-up (the
process's first forwards pay one-off costs), the median time to first token of ``--runs`` calls
each way (one timed call swung the ratio 3.6-28x between runs).

The store is the default location: ``$SNAPSTORE_DIR`` if set, else the per-user cache directory.
The model is a Bamba (IBM's Mamba2/attention hybrid) randomly initialised from a fixed seed, so
nothing is downloaded; its identity includes a hash of its weights and config.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, BambaConfig

from snapstore.engine.hf import PrefixCache

VOCAB = 4096
SYSTEM = 4096  # "system prompt + tool list" tokens, shared by every conversation (--system)
QUESTION = 24  # each conversation's own question
DECODE = 16  # greedy tokens generated


def build_model() -> Any:
    cfg = BambaConfig(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, intermediate_size=768,
        vocab_size=VOCAB, attn_layer_indices=[2, 5], mamba_n_heads=8, mamba_d_state=64, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64, mamba_n_groups=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def prompt(conversation: int) -> torch.Tensor:
    """The shared system prompt followed by this conversation's question (seeded token ids)."""
    system = torch.randint(1, VOCAB, (1, SYSTEM), generator=torch.Generator().manual_seed(1234))
    question = torch.randint(1, VOCAB, (1, QUESTION), generator=torch.Generator().manual_seed(conversation))
    return torch.cat([system, question], dim=1)


class FirstToken:
    """A streamer that records when the first generated token arrives (generate puts the prompt first)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.puts = 0
        self.ttft = 0.0

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.ttft = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


def run(fn: Any, ids: torch.Tensor, **kw: Any) -> tuple[Any, float, float]:
    """Call ``fn(ids, ...)`` greedily; returns (output, time to first token, total seconds)."""
    streamer = FirstToken()
    out = fn(ids, max_new_tokens=DECODE, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
             output_scores=True, streamer=streamer, **kw)
    return out, streamer.ttft, time.perf_counter() - streamer.t0


def digest(out: Any) -> str:
    h = hashlib.sha256(out.sequences.numpy().tobytes())
    for s in out.scores:
        h.update(s.numpy().tobytes())
    return h.hexdigest()


def phase_first(pc: PrefixCache) -> int:
    ids = prompt(1)
    out, ttft, total = run(pc.generate, ids, cache_prefix=SYSTEM, session="demo-1")
    st = pc.stats()
    how = f"restored {st.restored_tokens} tokens" if st.hits else "read every token (nothing stored yet)"
    print(f"conversation 1: {ids.shape[1]} prompt tokens, {how}; first token after {ttft * 1000:.0f} ms, "
          f"{DECODE} tokens in {total * 1000:.0f} ms")
    if st.committed:
        print(f"snapshots saved: {st.committed} (at the end of the system prompt, token {SYSTEM}, and at the end "
              f"of the prompt, token {ids.shape[1]}, session demo-1)")
    else:
        print("snapshots saved: none (the system prompt and this prompt were stored by an earlier run)")
    print(f"bytes stored: {st.store.stored_bytes / 2**20:.2f} MiB in {pc.store.path}")
    print(f"generated: {out.sequences[0, ids.shape[1]:].tolist()}")
    return 0


def warm_up(model: Any) -> None:
    """One short generate: the process's first forwards (allocations, kernel selection) are timed by neither side."""
    ids = torch.randint(1, VOCAB, (1, 64), generator=torch.Generator().manual_seed(7))
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def phase_second(pc: PrefixCache, runs: int) -> int:
    ids = prompt(2)
    warm_up(pc.model)
    out, ttft, total = run(pc.generate, ids, cache_prefix=SYSTEM, session="demo-2")
    st = pc.stats()
    if not st.hits:
        print("the system prompt was not in the store: run `python examples/demo.py --phase first` first",
              file=sys.stderr)
        return 1
    ref, ref_ttft, ref_total = run(pc.uncached_generate, ids, cache_prefix=SYSTEM)
    timed = [(ttft, total)]
    ref_timed = [(ref_ttft, ref_total)]
    same = torch.equal(out.sequences, ref.sequences) and digest(out) == digest(ref)
    for _ in range(runs - 1):  # alternated: a change in the machine's load falls on both sides
        o, t, tt = run(pc.generate, ids, cache_prefix=SYSTEM, session="demo-2")
        r, rt, rtt = run(pc.uncached_generate, ids, cache_prefix=SYSTEM)
        timed.append((t, tt))
        ref_timed.append((rt, rtt))
        same = same and digest(o) == digest(out) and digest(r) == digest(ref)
    med = {"s": statistics.median(t for t, _ in timed), "r": statistics.median(t for t, _ in ref_timed)}
    med_total = {"s": statistics.median(t for _, t in timed), "r": statistics.median(t for _, t in ref_timed)}
    print(f"conversation 2 (a new process): {ids.shape[1]} prompt tokens, restored {st.restored_tokens} "
          f"(the system prompt) in {st.restore_seconds * 1000:.1f} ms, read {st.prefilled_tokens}")
    print(f"time to first token (median of {runs} calls each way, after a warm-up): {med['s'] * 1000:.0f} ms with "
          f"the store, {med['r'] * 1000:.0f} ms without   time saved: {(med['r'] - med['s']) * 1000:.0f} ms "
          f"({med['r'] / max(med['s'], 1e-9):.1f}x)")
    print(f"whole call ({DECODE} tokens, median): {med_total['s'] * 1000:.0f} ms with the store, "
          f"{med_total['r'] * 1000:.0f} ms without")
    print(f"generated: {out.sequences[0, ids.shape[1]:].tolist()}")
    print(f"output byte-identical to the same generate without the store (every token and score, every call): {same}")
    return 0 if same else 2


def main() -> int:
    global SYSTEM
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["first", "second"], required=True)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the same in both runs)")
    ap.add_argument("--runs", type=int, default=3, help="timed calls each way in the second phase (the median)")
    ap.add_argument("--system", type=int, default=SYSTEM, help="system prompt tokens (the same in both runs)")
    args = ap.parse_args()
    SYSTEM = args.system
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    model = build_model()
    print(f"== phase {args.phase}: Bamba hybrid, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"system prompt {SYSTEM} tokens + a {QUESTION}-token question")
    with PrefixCache(model) as pc:  # path=None: the default location
        return phase_first(pc) if args.phase == "first" else phase_second(pc, max(1, args.runs))


if __name__ == "__main__":
    sys.exit(main())
