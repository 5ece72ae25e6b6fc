"""snapstore demo: a hybrid (Mamba2 + attention) model reads a long prompt once; a new process continues it.

Run it twice (``./demo.sh`` does):

    python examples/demo.py --phase save      # prefill the system prompt, save two boundary snapshots
    python examples/demo.py --phase restore   # new process: match, restore, continue; compare with re-prefill

The store is the default location: ``$SNAPSTORE_DIR`` if set, else the per-user cache directory.
The model is a Bamba (IBM's Mamba2/attention hybrid) randomly initialised from a fixed seed, so
nothing is downloaded; its identity includes a hash of its weights and config.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, BambaConfig

from snapstore.engine import hf

VOCAB = 4096
SYSTEM = 2048  # "system prompt" tokens, saved at two boundaries: ROOT and SYSTEM
ROOT = 1024
USER = 24  # the user's turn, read after the restore
DECODE = 16  # greedy tokens generated


def build_model() -> Any:
    cfg = BambaConfig(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, intermediate_size=768,
        vocab_size=VOCAB, attn_layer_indices=[2, 5], mamba_n_heads=8, mamba_d_state=64, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64, mamba_n_groups=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def prompt() -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (SYSTEM + USER,), generator=g).tolist()


def ids(toks: list[int]) -> torch.Tensor:
    return torch.tensor([toks], dtype=torch.long)


@torch.no_grad()
def prefill(model: Any, toks: list[int]) -> Any:
    """Read the system prompt in the same split the saved run used: [0, ROOT), then [ROOT, SYSTEM)."""
    cache = model(ids(toks[:ROOT]), use_cache=True).past_key_values
    model(ids(toks[ROOT:SYSTEM]), past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def continue_from(model: Any, cache: Any, toks: list[int]) -> tuple[list[int], str]:
    """Read the user's turn, then greedy-decode; returns the tokens and a SHA-256 of every logit."""
    h = hashlib.sha256()
    out = model(ids(toks), past_key_values=cache, use_cache=True)
    h.update(out.logits.numpy().tobytes())
    gen: list[int] = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(DECODE):
        gen.append(nxt)
        out = model(ids([nxt]), past_key_values=cache, use_cache=True)
        h.update(out.logits.numpy().tobytes())
        nxt = int(out.logits[0, -1].argmax())
    return gen, h.hexdigest()


def open_adapter(model: Any) -> Any:
    return hf.open_store(model, None, pack="sha256:" + hf.weights_sha256(model))  # None: the default location


@torch.no_grad()
def phase_save(model: Any, toks: list[int]) -> None:
    ad = open_adapter(model)
    t0 = time.perf_counter()
    cache = model(ids(toks[:ROOT]), use_cache=True).past_key_values
    t1 = time.perf_counter()
    root = hf.save(ad, cache, toks[:ROOT], session="demo")
    t2 = time.perf_counter()
    model(ids(toks[ROOT:SYSTEM]), past_key_values=cache, use_cache=True)
    t3 = time.perf_counter()
    leaf = hf.save(ad, cache, toks[:SYSTEM], session="demo")
    t4 = time.perf_counter()
    print(f"store: {ad.store.path}")
    print(f"prefilled {SYSTEM} tokens in {(t1 - t0 + t3 - t2) * 1000:.0f} ms; saved root@{ROOT} "
          f"(snapshot {root.snapshot_id}, {(t2 - t1) * 1000:.1f} ms) and leaf@{SYSTEM} as a delta over it "
          f"(snapshot {leaf.snapshot_id}, parent {leaf.parent_id}, {(t4 - t3) * 1000:.1f} ms)")
    st = ad.store.stats()
    print(f"bytes stored: {st.stored_bytes / 2**20:.2f} MiB on disk for {st.logical_bytes / 2**20:.2f} MiB of state")
    ad.store.close()


@torch.no_grad()
def phase_restore(model: Any, toks: list[int]) -> int:
    ad = open_adapter(model)
    store = ad.store
    t0 = time.perf_counter()
    m = store.match(toks)
    if m is None:
        print("no snapshot matches: run `python examples/demo.py --phase save` first", file=sys.stderr)
        return 1
    cache, res = hf.restore(model.config, ad, m)
    t_restore = time.perf_counter() - t0
    gen, digest = continue_from(model, cache, toks[m.n_tokens:])

    t1 = time.perf_counter()  # the uninterrupted run, recomputed here: re-read the system prompt
    cold = prefill(model, toks)
    t_prefill = time.perf_counter() - t1
    cold_gen, cold_digest = continue_from(model, cold, toks[SYSTEM:])

    st = store.stats()
    print(f"store: {store.path}")
    print(f"matched {m.n_tokens} of {len(toks)} prompt tokens (chain {res.chain}); tokens reused: {m.n_tokens}")
    print(f"bytes stored: {st.stored_bytes / 2**20:.2f} MiB; restored {res.bytes_restored / 2**20:.2f} MiB")
    print(f"restore: {t_restore * 1000:.1f} ms   re-prefill: {t_prefill * 1000:.1f} ms   "
          f"time saved: {(t_prefill - t_restore) * 1000:.1f} ms ({t_prefill / max(t_restore, 1e-9):.1f}x)")
    print(f"generated: {gen}")
    same = gen == cold_gen and digest == cold_digest
    print(f"outputs match the uninterrupted run (greedy tokens and every logit byte-identical): {same}")
    store.close()
    return 0 if same else 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["auto", "save", "restore"], default="auto",
                    help="auto: restore if a snapshot matches, else save")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the same in both runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    model = build_model()
    toks = prompt()
    phase = args.phase
    if phase == "auto":
        ad = open_adapter(model)
        phase = "restore" if ad.store.match(toks) is not None else "save"
        ad.store.close()
    print(f"== phase {phase}: Bamba hybrid, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"prompt {SYSTEM} + {USER} tokens")
    if phase == "save":
        phase_save(model, toks)
        return 0
    return phase_restore(model, toks)


if __name__ == "__main__":
    sys.exit(main())
