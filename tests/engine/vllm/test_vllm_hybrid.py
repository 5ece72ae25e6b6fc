"""The vLLM connector on a hybrid model (issue 28), real vLLM on the CPU: a tiny random
Qwen3-Next (three gated-delta-net layers, one attention layer; bfloat16; vLLM keeps a recurrent
state per block boundary with prefix caching on). A store written by one vLLM process serves the
next: a prompt that shares 3 blocks with a stored one restores its attention blocks and the state
pages at that boundary and generates exactly what the same vLLM generates without the connector;
a damaged state chunk makes vLLM recompute the request (never attention without its state). Four
vLLM processes, ~40 s each: slow tier.

The block size is pinned (``BS``): left to itself vLLM raises a hybrid model's attention block to
hold a state page, and the state's size depends on the CPU's kernels (544-token blocks on some
CPUs, 288 on the AMD EPYC CI machines: 6 saves where 3 were expected). Pinned above both, every
CPU gets ``BS``; each run checks the block size vLLM reports it used, so a CPU that needs larger
blocks fails saying so instead of failing on counts. Every process prefills in BS-token chunks
(``max_num_batched_tokens``): vLLM holds a state only where a chunk ends (and at a prompt's last
block boundary), so that is where the connector saves them; the baseline runs the same
configuration, so the outputs compare exactly."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import DRIVER, serve, snapstore_json, vllm_python  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
# the attention block, pinned: a multiple of 32 (the CPU attention kernel's) at least the size vLLM
# derives from the state page on any CPU seen (288, 544): vLLM keeps a pinned size that holds a page
BS = 576
SPEC: dict[str, Any] = {"dtype": "bfloat16", "prefix_cache": True, "chunked": BS, "block_size": BS, "max_len": 8192,
                        "kv_mib": 256}


def hybrid_serve(*args: Any, prefix_off: bool = False, **kw: Any) -> dict[str, Any]:
    """``serve`` with SPEC (``prefix_off``: vLLM's prefix cache off), checking that vLLM used the
    pinned block size (what every count below assumes)."""
    res = serve(*args, **kw, **{**SPEC, "prefix_cache": not prefix_off})
    assert res["block_size"] == BS, (
        f"vLLM used {res['block_size']}-token blocks, not the pinned {BS}: this CPU's state page needs larger "
        "blocks; raise BS (a multiple of 32) to at least that")
    return res


@pytest.fixture(scope="module")
def hybrid_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> str:  # noqa: F811
    path = tmp_path_factory.mktemp("vllm-hybrid") / "model"
    subprocess.run([str(vllm_python), str(DRIVER), "build", str(path), "--hybrid"], check=True, timeout=600,
                   capture_output=True)
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    """P1: a 3-block prefix S and 300 more tokens; P2: S and 200 other tokens."""
    rng = random.Random(7)
    s = [rng.randrange(4, 512) for _ in range(3 * BS)]
    p1 = s + [rng.randrange(4, 512) for _ in range(300)]
    p2 = s + [rng.randrange(4, 512) for _ in range(200)]
    assert p1[3 * BS] != p2[3 * BS]
    return {"P1": p1, "P2": p2}


@pytest.fixture(scope="module")
def baseline(hybrid_model: str, prompts: dict[str, list[int]],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy outputs without a connector; P2 under a cache salt, so vLLM computes it whole."""
    res = hybrid_serve(hybrid_model, tmp_path_factory.mktemp("hy-base"), "base",
                       [prompts["P1"], {"tokens": prompts["P2"], "salt": "fresh"}])
    assert [r["num_cached_tokens"] for r in res["results"]] == [0, 0]
    return {"P1": res["results"][0]["tokens"], "P2": res["results"][1]["tokens"]}


@pytest.fixture(scope="module")
def saved_store(hybrid_model: str, prompts: dict[str, list[int]], baseline: dict[str, list[int]],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Process 1 serves P1 through the connector: snapshots at 1, 2 and 3 blocks, a delta chain
    (each: one attention block and the three state pages at its boundary)."""
    tmp = tmp_path_factory.mktemp("hy-saved")
    store = tmp / "store"
    res = hybrid_serve(hybrid_model, tmp, "p1", [prompts["P1"]], connector="snapstore", extra={"path": str(store)})
    assert res["results"][0]["tokens"] == baseline["P1"]
    assert res["stats"]["worker"]["saves"] == 3 and res["stats"]["worker"]["save_errors"] == 0
    return store


def _snapshots(store: Path) -> list[dict[str, Any]]:
    doc = snapstore_json(store, "inspect")
    snaps: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "n_tokens" in node and "id" in node:
                snaps.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc)
    return snaps


def test_stored_boundaries_are_a_delta_chain_with_a_state_each(saved_store: Path) -> None:
    snaps = {s["n_tokens"]: s for s in _snapshots(saved_store)}
    assert sorted(snaps) == [BS, 2 * BS, 3 * BS]
    leaf = snapstore_json(saved_store, "inspect", str(snaps[3 * BS]["id"]))["snapshot"]
    parts = {p["name"]: p for p in leaf["parts"]}
    assert sorted(parts) == ["g0.state", "g1.state", "g2.state", "g3.kv"]
    assert leaf["rows"] == {"g3.kv": 3} and leaf["base_tokens"] == 2 * BS  # rows only above the parent
    assert parts["g3.kv"]["row_start"] == 2 and parts["g3.kv"]["row_end"] == 3
    assert all(parts[f"g{i}.state"]["kind"] == "fixed" for i in range(3))


def test_new_process_restores_the_shared_prefix_with_identical_output(
        hybrid_model: str, prompts: dict[str, list[int]], baseline: dict[str, list[int]], saved_store: Path,
        tmp_path: Path) -> None:
    """Process 2 serves P2, which shares only S (3 blocks) with the stored P1: it is offered
    the 3-block boundary, restores 3 attention blocks and the state pages, and generates exactly what
    vLLM generates without the connector; P1 then hits vLLM's own prefix cache. The store verifies
    clean."""
    store = tmp_path / "store"
    shutil.copytree(saved_store, store)
    p2 = hybrid_serve(hybrid_model, tmp_path, "p2", [prompts["P2"], prompts["P1"]], connector="snapstore",
                      extra={"path": str(store)})
    assert [r["num_cached_tokens"] for r in p2["results"]] == [3 * BS, 3 * BS]
    assert [r["tokens"] for r in p2["results"]] == [baseline["P2"], baseline["P1"]]
    worker = p2["stats"]["worker"]
    assert worker["loads"] == 1 and worker["loaded_blocks"] == 3 and worker["load_errors"] == 0
    assert snapstore_json(store, "verify", "--deep")["status"] == "clean"


def test_damaged_state_chunk_recomputes_never_wrong_output(
        hybrid_model: str, prompts: dict[str, list[int]], baseline: dict[str, list[int]], saved_store: Path,
        tmp_path: Path) -> None:
    """One flipped byte in the state page of the 3-block boundary: the load fails its checksum, the
    connector reports the request's load failed, vLLM recomputes it (output identical to the run
    without the connector) and is not offered the damaged boundary again; the recomputed request's
    saves heal the store."""
    store = tmp_path / "store"
    shutil.copytree(saved_store, store)
    leaf = next(s for s in _snapshots(store) if s["n_tokens"] == 3 * BS)
    detail = snapstore_json(store, "inspect", str(leaf["id"]))["snapshot"]
    cid = next(p for p in detail["parts"] if p["name"] == "g1.state")["chunks"][0]["id"]
    victim = next(p for p in (store / "blobs").rglob(f"*{cid}*") if p.is_file())
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    p3 = hybrid_serve(hybrid_model, tmp_path, "p3", [prompts["P2"]], connector="snapstore",
                      extra={"path": str(store)})
    assert p3["results"][0]["tokens"] == baseline["P2"]
    worker = p3["stats"]["worker"]
    assert worker["load_errors"] == 1 and worker["loads"] == 0
    stats = snapstore_json(store, "stats")["stats"]
    assert stats["quarantined"] + stats["healed"] >= 1


def test_a_cache_the_connector_cannot_save_is_refused_at_start(
        hybrid_model: str, prompts: dict[str, list[int]], baseline: dict[str, list[int]], tmp_path: Path) -> None:
    """Without vLLM's prefix cache a Mamba group runs in the 'none' cache mode: vLLM keeps no
    state at block boundaries, so the connector is disabled at start-up with one line per side
    naming the group and what to change; vLLM serves on (same output) and nothing is stored."""
    store = tmp_path / "store"
    p = hybrid_serve(hybrid_model, tmp_path, "p", [prompts["P1"]], connector="snapstore", extra={"path": str(store)},
                     prefix_off=True)
    assert p["results"][0]["tokens"] == baseline["P1"] and p["results"][0]["num_cached_tokens"] == 0
    lines = [ln for ln in p["log"].splitlines() if "snapstore connector disabled" in ln]
    assert len(lines) == 2 and all("KV cache group 0" in ln and "'none' cache mode" in ln for ln in lines), lines
    assert p["stats"]["worker"]["saves"] == 0
