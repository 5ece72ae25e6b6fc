"""MLX PrefixCache across a restart: a new process restores what another stored, byte for byte.

Process 1 answers conversation A (a 24-token system prompt + a question) on a fresh store for
each case in mlx_models.CASES (llama in float32 and bfloat16, a small prefill step, a KV cache
quantized from token 0 and from token 20, gemma3's sliding window with one-token pieces that leave
the window growing and rotated, qwen3_next's gated DeltaNet hybrid, falcon_h1's Mamba2 hybrid of
CacheLists). Process 2, a restart, answers B (restores the shared system prompt), A again (restores
A's prompt but its last token) and A's next turn (restores all of A). Every token and every
log-probability equals mlx_lm's own uncached run with the same split, computed here.

Speculative decoding likewise: process 1 answers A with a draft model (the draft's cache stored as
the snapshots' draft component) and B without it; process 2 answers A again (target and draft
restored), B with the draft (the target restored from a snapshot without the draft component, the
draft read from token 0) and A's next turn, each equal to mlx_lm's speculative_generate_step with
the same split (tokens, from-draft flags, log-probabilities).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="needs the mlx extra (mlx[cpu], mlx-lm)")

import mlx.core as mx  # noqa: E402
import mlx_models  # noqa: E402

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mlx_restart")
    out: dict[str, Any] = {}
    for phase in ("1", "2"):
        path = root / f"phase{phase}.npz"
        subprocess.run([sys.executable, str(HERE / "mlx_child.py"), str(root / "stores"), phase, str(path)],
                       check=True, timeout=600)
        with np.load(path) as z:
            out.update({k: z[k] for k in z.files if k != "stats"})
            out.setdefault("stats", {}).update(json.loads(str(z["stats"])))
    return out


def _expected_restore(case: str, call: str) -> int:
    extra = mlx_models.CASES[case][3]
    a = len(mlx_models.PROMPT_A)
    return {"a": 0, "b": len(mlx_models.SYSTEM), "a_again": a - 1, "a2": a - 1}[call] if not extra or call != "b" \
        else max(c for c in mlx_models.split(mlx_models.PROMPT_B, [len(mlx_models.SYSTEM)], extra)
                 if c <= len(mlx_models.SYSTEM))


@pytest.mark.parametrize("case", list(mlx_models.CASES))
def test_a_restart_restores_and_equals_mlx_lm_with_the_same_split(runs: dict[str, Any], case: str) -> None:
    arch, dtype, kw, extra = mlx_models.CASES[case]
    model = mlx_models.build(arch, dtype=dtype)
    restored_before = 0
    for name, prompt, prefix, _session in [*mlx_models.CALLS_1, *mlx_models.CALLS_2]:
        ref = mlx_models.reference(model, prompt, mlx_models.split(prompt, prefix, extra), kw, 6)
        tokens = runs[f"{case}.{name}.tokens"]
        logprobs = runs[f"{case}.{name}.logprobs"]
        assert tokens.tolist() == [t for t, _ in ref], (case, name)
        want = np.stack([np.array(lp.astype(mx.float32)) for _, lp in ref])
        assert want.tobytes() == logprobs.tobytes(), (case, name)
        st = runs["stats"][f"{case}.{name}"]
        if name == "b":
            restored_before = 0  # process 2 starts its counters anew
        restored = st["restored_tokens"] - restored_before
        restored_before = st["restored_tokens"]
        assert restored == _expected_restore(case, name), (case, name, st)
    st = runs["stats"][f"{case}.a2"]
    assert st["hits"] == 3 and st["restore_fallbacks"] == 0 and st["abandoned"] == 0 and st["bypassed"] == 0


def test_a_restart_restores_the_draft_cache_and_equals_mlx_lm_speculative_decoding(runs: dict[str, Any]) -> None:
    target, draft = mlx_models.draft_pair()
    restored = {}
    for name, prompt, prefix, speculative in [*mlx_models.SPEC_CALLS_1, *mlx_models.SPEC_CALLS_2]:
        if not speculative:
            continue
        ref = mlx_models.spec_reference(target, draft, prompt, mlx_models.split(prompt, prefix, []), 8)
        assert runs[f"draft.{name}.tokens"].tolist() == [[int(t), int(f)] for t, _, f in ref], name
        assert np.stack([np.array(lp) for _, lp, _ in ref]).tobytes() == runs[f"draft.{name}.logprobs"].tobytes()
        restored[name] = runs["stats"][f"draft.{name}"]["restored_tokens"]
    comp = runs["stats"]["draft.components.a"]
    assert len(comp) == 1 and comp[0].startswith("draft-") and runs["stats"]["draft.components.b"] == []
    assert any(f for _, f in runs["draft.a.tokens"].tolist()) and not all(f for _, f in runs["draft.a.tokens"].tolist())
    a = len(mlx_models.PROMPT_A)
    # process 2: A again restores 36 (with the draft), B restores 32 (target only), A2 restores 36
    assert (restored["a"], restored["a_again"], restored["b"] - restored["a_again"],
            restored["a2"] - restored["b"]) == (0, a - 1, len(mlx_models.PROMPT_B) - 1, a - 1)
