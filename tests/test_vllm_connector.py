"""The vLLM connector (issue 17) against a real vLLM (CPU build, its own venv) serving a tiny
random Llama built at test time: K/V round-trips across processes with identical greedy output,
block-granular prefixes, the local prefix cache and chunked prefill, a damaged chunk recomputed,
a store that cannot open disabling the connector. Each vLLM process starts in 20-90 s: slow tier."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = HERE / "vllm_driver.py"
BS = 32


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv, created by scripts/vllm_venv.sh when missing (idempotent, stamp file)."""
    subprocess.run([str(ROOT / "scripts" / "vllm_venv.sh")], check=True, timeout=3600)
    return VPY


@pytest.fixture(scope="session")
def model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama (head size 32) and its local tokenizer."""
    path = tmp_path_factory.mktemp("vllm") / "model"
    subprocess.run([str(vllm_python), str(DRIVER), "build", str(path)], check=True, timeout=600,
                   capture_output=True)
    return str(path)


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    """A (300 tokens), B (300), and C sharing only A's first 5 blocks (then 100 other tokens)."""
    rng = random.Random(1)
    a = [rng.randrange(4, 512) for _ in range(300)]
    b = [rng.randrange(4, 512) for _ in range(300)]
    c = a[:5 * BS] + [rng.randrange(4, 512) for _ in range(100)]
    assert c[5 * BS] != a[5 * BS]
    return {"A": a, "B": b, "C": c}


def serve(model: str, tmp: Path, name: str, prompts: list[list[int]], **spec: Any) -> dict[str, Any]:
    """One vLLM process serving ``prompts`` in order; its results and its log."""
    out = tmp / f"{name}.json"
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps({"model": model, "prompts": prompts, "out": str(out), **spec}))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"))
    proc = subprocess.run([str(VPY), str(DRIVER), "serve", str(spec_path)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res: dict[str, Any] = json.loads(out.read_text())
    res["log"] = proc.stdout + proc.stderr
    return res


def snapstore_json(store: Path, *args: str) -> dict[str, Any]:
    """The main venv's CLI on the connector's store (a vLLM store inspects like any other)."""
    out = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(store), *args, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


@pytest.fixture(scope="session")
def baseline(model: str, prompts: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy outputs of A, B, C from a vLLM without any connector."""
    res = serve(model, tmp_path_factory.mktemp("base"), "base", [prompts["A"], prompts["B"], prompts["C"]])
    assert [r["num_cached_tokens"] for r in res["results"]] == [0, 0, 0]
    return [r["tokens"] for r in res["results"]]


@pytest.fixture(scope="session")
def saved_store(model: str, prompts: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by process 1 (A, then B) through the connector; tests copy it."""
    tmp = tmp_path_factory.mktemp("saved")
    store = tmp / "store"
    res = serve(model, tmp, "p1", [prompts["A"], prompts["B"]], connector="snapstore", extra={"path": str(store)})
    assert [r["num_cached_tokens"] for r in res["results"]] == [0, 0]
    return store


CONFIGS = {"plain": {}, "prefix_cache": {"prefix_cache": True}, "chunked": {"chunked": 64}}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_second_process_restores_prefixes_with_identical_output(
        config: str, model: str, prompts: dict[str, list[int]], baseline: list[list[int]], saved_store: Path,
        tmp_path: Path) -> None:
    """Process 2 (a new vLLM) serves A and B from what process 1 stored (288 tokens each: every
    whole block below the last prompt token) and C, which shares only A's first 5 blocks, from
    A's rows (160): greedy output identical to the run without connector, with vLLM's own prefix
    cache on and with chunked prefill too."""
    store = tmp_path / "store"
    spec = CONFIGS[config]
    if config == "plain":
        shutil.copytree(saved_store, store)
    else:  # process 1 in the same configuration
        p1 = serve(model, tmp_path, "p1", [prompts["A"], prompts["B"]], connector="snapstore",
                   extra={"path": str(store)}, **spec)
        assert [r["tokens"] for r in p1["results"]] == baseline[:2]
    p2 = serve(model, tmp_path, "p2", [prompts["A"], prompts["B"], prompts["C"]], connector="snapstore",
               extra={"path": str(store)}, **spec)
    assert [r["num_cached_tokens"] for r in p2["results"]] == [288, 288, 160]
    assert [r["tokens"] for r in p2["results"]] == baseline
    worker = p2["stats"]["worker"]
    if config != "prefix_cache":  # with vLLM's prefix cache C's 5 blocks are local (A's, this process)
        assert worker["loads"] == 3 and worker["loaded_blocks"] == 9 + 9 + 5
    assert worker["load_errors"] == 0
    doc = snapstore_json(store, "verify", "--deep")
    assert doc["status"] == "clean"


def test_flipped_byte_in_a_chunk_is_recomputed_never_junk(
        model: str, prompts: dict[str, list[int]], baseline: list[list[int]], saved_store: Path,
        tmp_path: Path) -> None:
    """One flipped byte in a stored chunk: the load fails its checksum, the connector reports the
    blocks, vLLM recomputes them — output identical to the run without connector — and the failure
    is counted (connector stats; the store's quarantine)."""
    store = tmp_path / "store"
    shutil.copytree(saved_store, store)
    chunks = sorted((p for p in (store / "blobs").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim = chunks[-1]  # the biggest: a 256-token link under A or B
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    p2 = serve(model, tmp_path, "p2", [prompts["A"], prompts["B"], prompts["C"]], connector="snapstore",
               extra={"path": str(store)})
    assert [r["tokens"] for r in p2["results"]] == baseline
    worker = p2["stats"]["worker"]
    assert worker["load_errors"] >= 1 and worker["failed_blocks"] >= 8
    stats = snapstore_json(store, "stats")["stats"]
    assert stats["quarantined"] >= 1  # found by the restore, not offered again until a save heals it


def test_store_that_cannot_open_disables_the_connector(
        model: str, prompts: dict[str, list[int]], baseline: list[list[int]], tmp_path: Path) -> None:
    """A store path that cannot be a store (a regular file): one clear log line per side, and
    vLLM serves on, computing everything."""
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    p = serve(model, tmp_path, "p", [prompts["A"]], connector="snapstore", extra={"path": str(bad)})
    assert [r["tokens"] for r in p["results"]] == baseline[:1]
    assert p["results"][0]["num_cached_tokens"] == 0
    lines = [ln for ln in p["log"].splitlines() if "snapstore connector disabled" in ln]
    assert len(lines) == 2 and any("scheduler side" in ln for ln in lines) and any("worker side" in ln for ln in lines)
