"""The vLLM connector beyond full attention at TP = 1 (issue 50), real vLLM on the CPU with tiny
random models built at test time: MLA (DeepSeek-V2: one ``MLAAttentionSpec`` group of 576-wide
latents, the ``CPU_MLA`` backend, vLLM's own prefix cache forced off), sliding windows (Mistral:
one ``SlidingWindowSpec`` group; Gemma 3: sliding + full groups) and tensor parallelism
(``tensor_parallel_size=2``, a tiny Llama).

Each case runs two vLLM processes on one store. Process 1 serves P (600 tokens; the connector
saves it), R (600 tokens sharing nothing with P) and then Q (P's first 576 tokens and 24 others)
under a cache salt: another namespace for the store and for vLLM's own prefix cache, so Q is
computed whole there — the reference output, with no reuse of any kind (checked: no cached
tokens). Process 2, new, serves Q, P, R: Q restores 576 tokens of P's from the store and
generates exactly the reference; P too; R's stored snapshot was damaged on purpose, its load
fails and vLLM recomputes it (same output). No log has a "connector disabled" line or a failed
load but that one. Two processes per case (~30-60 s each, unloaded): slow tier."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import DRIVER, model, serve, snapstore_json, vllm_python  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

SHARED = 576  # tokens Q shares with P: 18 blocks of 32, 36 of 16 (MLA)

# name: (build arguments, serve settings)
CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    # MLA: vLLM forces block size 16 and turns its own prefix cache and chunked prefill off on a CPU
    "deepseek_v2_mla": (["--deepseek-v2"], {"block_size": None}),
    "deepseek_v3_mla": (["--deepseek-v3"], {"block_size": None}),
    # sliding windows: vLLM's own prefix cache on, as a server runs them (it keeps only the window's blocks)
    "mistral_sliding": (["--sliding-window", "64"], {"prefix_cache": True}),
    "gemma3_sliding_full": (["--gemma3", "64"], {"prefix_cache": True}),
    "gemma2_sliding_full": (["--gemma2", "64"], {"prefix_cache": True}),
}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    """P (600 tokens); Q: P's first 576 and 24 others; R: 600 tokens sharing nothing with P."""
    rng = random.Random(50)
    p = [rng.randrange(4, 512) for _ in range(600)]
    q = p[:SHARED] + [rng.randrange(4, 512) for _ in range(600 - SHARED)]
    r = [rng.randrange(4, 512) for _ in range(600)]
    assert q[SHARED] != p[SHARED] and r[0] != p[0]
    return {"P": p, "Q": q, "R": r}


def _failures(res: dict[str, Any]) -> list[str]:
    """Lines saying the connector is off, or that a load failed (vLLM then recomputed)."""
    return [ln for ln in res["log"].splitlines()
            if "snapstore connector disabled" in ln or ("snapstore" in ln and "failed" in ln)]


def _build(python: Path, tmp: Path, args: list[str]) -> str:
    path = tmp / "model"
    subprocess.run([str(python), str(DRIVER), "build", str(path), *args], check=True, timeout=600,
                   capture_output=True)
    return str(path)


def _flip(files: list[Path]) -> None:
    assert files
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(bytes(raw))


def _snapshot_chunks(store: Path, sid: int) -> list[Path]:
    """The chunk files of snapshot ``sid``'s own parts (a window or state part, rows above its parent)."""
    out: list[Path] = []
    for part in snapstore_json(store, "inspect", str(sid))["snapshot"]["parts"]:
        for c in part["chunks"]:
            out.extend(f for f in (store / "blobs").rglob(f"*{c['id']}*") if f.is_file())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_new_process_restores_the_stored_prefix_with_identical_output(
        case: str, vllm_python: Path, prompts: dict[str, list[int]], tmp_path: Path) -> None:  # noqa: F811
    """Process 1 also serves R (sharing nothing with P); one byte of each chunk of R's longest
    snapshot (its window blocks, latent rows or full-attention rows) is flipped before process 2
    serves R last: its load fails its checksum and vLLM recomputes, output equal to process 1's."""
    build, spec = CASES[case]
    built = _build(vllm_python, tmp_path, build)
    p, q, r = prompts["P"], prompts["Q"], prompts["R"]
    store = tmp_path / "store"
    extra = {"path": str(store)}
    first = serve(built, tmp_path, "p1", [p, r, {"tokens": q, "salt": "reference"}], connector="snapstore",
                  extra=extra, **spec)
    assert [x["num_cached_tokens"] for x in first["results"]] == [0, 0, 0]  # computed whole: the references
    ref_p, ref_r, ref_q = (x["tokens"] for x in first["results"])
    assert not _failures(first)
    plain = [s for s in snapstore_json(store, "inspect")["snapshots"] if s["namespace"] is None]
    _flip(_snapshot_chunks(store, max(s["id"] for s in plain)))  # R's leaf: saved after P's chain
    second = serve(built, tmp_path, "p2", [q, p, r], connector="snapstore", extra=extra, **spec)
    assert second["results"][0]["num_cached_tokens"] == SHARED  # from the store: process 2 computed nothing before
    assert second["results"][1]["num_cached_tokens"] >= SHARED  # the store's or vLLM's own cache (Q's blocks)
    assert [x["tokens"] for x in second["results"]] == [ref_q, ref_p, ref_r]
    failed = _failures(second)
    assert len(failed) == 1 and "load for request" in failed[0], failed  # R's damaged load only, recomputed
    worker = second["stats"]["worker"]
    assert worker["loads"] >= 1 and worker["load_errors"] == 1 and second["stats"]["scheduler"]["hit_tokens"] >= SHARED


def _rank_root_chunks(store: Path, rank: str, n_tokens: int) -> list[Path]:
    """The chunk files of the snapshot of ``n_tokens`` tokens (no namespace) that tensor-parallel rank
    ``rank`` ("1/2") saved."""
    doc = snapstore_json(store, "inspect")
    ident = next(i["key"] for i in doc["identities"] if i["fields"]["extra"]["tp"] == rank)
    snaps = [s for s in doc["snapshots"] if s["identity"] == ident and s["namespace"] is None
             and s["n_tokens"] == n_tokens]
    return [f for s in snaps for f in _snapshot_chunks(store, s["id"])]


def test_tensor_parallel_restores_each_rank_its_own_shard(
        vllm_python: Path, prompts: dict[str, list[int]], model: str, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TP = 2 (a tiny Llama, one OpenMP thread per rank): process 1 serves P and R (each rank saves
    its own chain: identity ``tp`` 0/2 and 1/2) and Q under a salt (the reference). One byte of
    rank 1's shard of R's first 256 tokens is flipped. Process 2 serves Q: both ranks restore 576
    tokens of P's, each its own shard (output as the reference); then R: rank 1's load fails its
    checksum, vLLM pools the failed blocks of both ranks and recomputes them on both, so the output
    is still R's (never rank 0's restored blocks beside rank 1's recomputed ones)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a one-NUMA-node machine: one core per rank
    p, q, r = prompts["P"], prompts["Q"], prompts["R"]
    store = tmp_path / "store"
    spec: dict[str, Any] = {"tp": 2, "connector": "snapstore", "extra": {"path": str(store)}}
    first = serve(model, tmp_path, "p1", [p, r, {"tokens": q, "salt": "reference"}], **spec)
    assert [x["num_cached_tokens"] for x in first["results"]] == [0, 0, 0]
    ref_p, ref_r, ref_q = (x["tokens"] for x in first["results"])
    assert not _failures(first)
    ranks = {i["fields"]["extra"]["tp"]: i["snapshots"] for i in snapstore_json(store, "inspect")["identities"]}
    assert ranks == {"0/2": 9, "1/2": 9}  # P, R, Q: 256, 512, 576 each, per rank
    _flip(_rank_root_chunks(store, "1/2", 256))
    second = serve(model, tmp_path, "p2", [q, r], **spec)
    assert second["results"][0]["num_cached_tokens"] == SHARED
    assert [x["tokens"] for x in second["results"]] == [ref_q, ref_r]
    failed = _failures(second)
    assert failed and all("rank 1" in ln for ln in failed), failed  # only rank 1's load of R failed
    assert ref_p  # P was served and saved in process 1 (what Q restores)
