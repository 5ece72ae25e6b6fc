"""MLX PrefixCache in one process: equality with mlx_lm's functions, the policy, the identity, refusals.

The restart case (a new process restores; every cache kind) is tests/engine/mlx/test_mlx_restart.py.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="needs the mlx extra (mlx[cpu], mlx-lm)")

import mlx.core as mx  # noqa: E402
import mlx_models  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

import snapstore  # noqa: E402
from snapstore.engine.mlx import PrefixCache, UnsupportedCacheError  # noqa: E402

G = importlib.import_module("mlx_lm.generate")
ROOT = Path(__file__).resolve().parents[3]
PROMPT = mlx_models.PROMPT_A


def _same(a: list[Any], b: list[Any]) -> bool:
    """Same tokens and byte-identical log-probabilities."""
    return len(a) == len(b) and all(
        int(ta) == int(tb) and np.array(la.astype(mx.float32)).tobytes() == np.array(lb.astype(mx.float32)).tobytes()
        for (ta, la), (tb, lb) in zip(a, b))


@pytest.fixture(scope="module")
def llama() -> Any:
    return mlx_models.build("llama")


def test_without_cuts_it_equals_plain_generate_step_and_the_repeat_restores(llama: Any, tmp_path: Path) -> None:
    ids = mx.array(PROMPT)
    ref = list(G.generate_step(ids, llama, max_tokens=8))
    with PrefixCache(llama, tmp_path, boundary=0) as pc:
        assert pc.split(len(PROMPT)) == []
        assert _same(list(pc.generate_step(ids, max_tokens=8)), ref)
        assert _same(list(pc.generate_step(ids, max_tokens=8)), ref)  # restored at n - 1: one token read
        st = pc.stats()
        assert (st.calls, st.hits, st.misses) == (2, 1, 1)
        assert st.restored_tokens == len(PROMPT) - 1 and st.prefilled_tokens == len(PROMPT) + 1
        assert st.captures == st.committed == 1 and st.abandoned == 0


def test_stream_generate_and_generate_equal_mlx_lm(llama: Any, tmp_path: Path) -> None:
    tok = mlx_models.tokenizer()
    text = " ".join(f"w{t}" for t in PROMPT)
    want = [(r.text, r.token, np.array(r.logprobs).tobytes(), r.finish_reason, r.prompt_tokens, r.generation_tokens)
            for r in G.stream_generate(llama, tok, text, max_tokens=7)]
    with PrefixCache(llama, tmp_path, boundary=16) as pc:
        for _ in range(2):  # a miss, then a hit: the same responses
            got = [(r.text, r.token, np.array(r.logprobs).tobytes(), r.finish_reason, r.prompt_tokens,
                    r.generation_tokens) for r in pc.stream_generate(tok, text, max_tokens=7)]
            assert got == want
        assert pc.generate(tok, PROMPT, max_tokens=7) == G.generate(llama, tok, PROMPT, max_tokens=7)
        st = pc.stats()
        # the first call captures at 16, 32 and 36 (the last token but one); the others restore at 36
        assert (st.calls, st.hits, st.committed) == (3, 2, 3) and st.restored_tokens == 2 * (len(PROMPT) - 1)


def test_logits_processors_see_the_whole_prompt_on_a_hit(llama: Any, tmp_path: Path) -> None:
    # a repetition penalty over the last 64 tokens: it must see the restored prompt too
    procs = make_logits_processors(repetition_penalty=3.0, repetition_context_size=64)
    ids = mx.array(PROMPT)
    ref = list(G.generate_step(ids, llama, max_tokens=8, logits_processors=procs))
    assert not _same(ref, list(G.generate_step(ids, llama, max_tokens=8)))  # the penalty changes the run
    with PrefixCache(llama, tmp_path, boundary=0) as pc:
        list(pc.generate_step(ids, max_tokens=8, logits_processors=procs))
        assert _same(list(pc.generate_step(ids, max_tokens=8, logits_processors=procs)), ref)
        assert pc.stats().hits == 1


def test_sampling_with_the_same_seed_draws_the_same(llama: Any, tmp_path: Path) -> None:
    sampler = make_sampler(temp=1.0)
    ids = mx.array(PROMPT)
    mx.random.seed(7)
    ref = list(G.generate_step(ids, llama, max_tokens=8, sampler=sampler))
    with PrefixCache(llama, tmp_path, boundary=0) as pc:
        for _ in range(2):
            mx.random.seed(7)
            assert _same(list(pc.generate_step(ids, max_tokens=8, sampler=sampler)), ref)


def test_calls_it_cannot_serve_go_to_mlx_lm_unchanged(llama: Any, tmp_path: Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(PROMPT)
    ref = list(G.generate_step(ids, llama, max_tokens=5, prompt_cache=make_prompt_cache(llama)))
    with PrefixCache(llama, tmp_path, boundary=16) as pc:
        got = list(pc.generate_step(ids, max_tokens=5, prompt_cache=make_prompt_cache(llama)))
        assert _same(got, ref)
        with pytest.raises(TypeError):  # mlx_lm's own error for an argument it does not take
            list(pc.generate_step(ids, max_tokens=5, no_such_argument=1))
        st = pc.stats()
        assert st.bypassed == 2 and st.captures == 0 and pc.store.match(PROMPT) is None


def test_a_raising_call_abandons_its_captures_and_an_early_stop_commits(llama: Any, tmp_path: Path) -> None:
    ids = mx.array(PROMPT)
    calls = []

    def boom(tokens: mx.array, logits: mx.array) -> mx.array:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return logits

    with PrefixCache(llama, tmp_path, boundary=16) as pc:
        with pytest.raises(RuntimeError, match="boom"):
            list(pc.generate_step(ids, max_tokens=8, logits_processors=[boom]))
        st = pc.stats()
        assert st.captures == 3 and st.abandoned == 3 and st.committed == 0
        assert pc.store.match(PROMPT) is None
        gen = pc.generate_step(ids, max_tokens=8)
        next(gen)
        gen.close()  # the consumer stops (mlx_lm's stream_generate does at EOS): the prompt was read
        assert pc.stats().committed == 3
        m = pc.store.match(PROMPT)
        assert m is not None and m.n_tokens == len(PROMPT) - 1


def test_the_identity_follows_the_weights(tmp_path: Path) -> None:
    from mlx.utils import tree_flatten, tree_unflatten

    model = mlx_models.build("llama")
    ids = mx.array(PROMPT)
    with PrefixCache(model, tmp_path, boundary=0) as pc:
        list(pc.generate_step(ids, max_tokens=4))
        key = pc.store.identity.key
        # replaced parameters (model.update, load_weights): seen at the next call
        model.update(tree_unflatten([(k, v * 1.01) for k, v in tree_flatten(model.parameters())]))
        ref = list(G.generate_step(ids, model, max_tokens=4))
        assert _same(list(pc.generate_step(ids, max_tokens=4)), ref)
        st = pc.stats()
        assert st.identity_changes == 1 and st.hits == 0 and pc.store.identity.key != key
        # an in-place write keeps the array object: not seen per call, refresh() re-hashes
        w = model.layers[0].self_attn.q_proj.weight
        w[0, 0] = w[0, 0] + 1.0
        mx.eval(w)
        list(pc.generate_step(ids, max_tokens=4))
        assert pc.stats().identity_changes == 1
        pc.refresh()
        assert pc.stats().identity_changes == 2
        assert _same(list(pc.generate_step(ids, max_tokens=4)), list(G.generate_step(ids, model, max_tokens=4)))


def test_cache_settings_enter_the_identity(llama: Any, tmp_path: Path) -> None:
    ids = mx.array(PROMPT)
    with PrefixCache(llama, tmp_path, boundary=0) as pc:
        list(pc.generate_step(ids, max_tokens=2))
        list(pc.generate_step(ids, max_tokens=2, prefill_step_size=7))  # other chunks: other bytes, a miss
        list(pc.generate_step(ids, max_tokens=2, kv_bits=8, kv_group_size=32, quantized_kv_start=0))
        assert pc.stats().hits == 0
        list(pc.generate_step(ids, max_tokens=2, kv_bits=8, kv_group_size=32, quantized_kv_start=0))
        assert pc.stats().hits == 1


def test_refusals(llama: Any, tmp_path: Path) -> None:
    with pytest.raises(snapstore.ConfigError):
        PrefixCache(llama, tmp_path, boundary=-1)
    pc = PrefixCache(llama, tmp_path)
    with pytest.raises(snapstore.InvalidInputError):
        pc.generate_step(mx.array(PROMPT), session="")
    with pytest.raises(snapstore.InvalidInputError):
        pc.generate_step(mx.array(PROMPT), cache_prefix=[0])
    pc.close()
    with pytest.raises(snapstore.StateError):
        pc.generate_step(mx.array(PROMPT))


def test_a_cache_kind_it_does_not_store_is_refused_at_open(tmp_path: Path) -> None:
    from mlx_lm.models.cache import ChunkedKVCache

    model = mlx_models.build("llama")
    model.make_cache = lambda: [ChunkedKVCache(64) for _ in model.layers]
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        PrefixCache(model, tmp_path)


def test_a_damaged_snapshot_falls_back_to_reading_and_gives_the_same_tokens(llama: Any, tmp_path: Path) -> None:
    ids = mx.array(PROMPT)
    ref = list(G.generate_step(ids, llama, max_tokens=5))
    with PrefixCache(llama, tmp_path, boundary=0) as pc:
        list(pc.generate_step(ids, max_tokens=5))
    blobs = [f for f in (tmp_path / "blobs").rglob("*") if f.is_file()]
    assert blobs
    for f in blobs:  # flip the last byte of every chunk file
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    with PrefixCache(llama, tmp_path, boundary=0) as pc:
        assert _same(list(pc.generate_step(ids, max_tokens=5)), ref)
        st = pc.stats()
        assert st.restore_fallbacks == 1 and st.hits == 0 and st.restored_tokens == 0


def test_the_mlx_integration_never_imports_torch() -> None:
    for path in [*sorted((ROOT / "engine" / "mlx").glob("*.py")), ROOT / "engine" / "_prefix_policy.py",
                 ROOT / "engine" / "__init__.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"
    # the package's own import loads no torch (its torch names are loaded on first use)
    code = "import sys, snapstore.engine, snapstore.engine._prefix_policy; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_stream_generate_with_a_draft_model_equals_mlx_lm_speculative_decoding(tmp_path: Path) -> None:
    target, draft = mlx_models.draft_pair()
    tok = mlx_models.tokenizer()
    want = [(r.token, r.from_draft, np.array(r.logprobs).tobytes(), r.text, r.finish_reason)
            for r in G.stream_generate(target, tok, PROMPT, max_tokens=8, draft_model=draft, num_draft_tokens=3)]
    assert any(w[1] for w in want) and not all(w[1] for w in want)  # drafts accepted and rejected
    reads: list[int] = []  # tokens per draft forward

    class Counting:  # the draft model, counting what it reads
        def __getattr__(self, name: str) -> Any:
            return getattr(draft, name)

        def __call__(self, x: mx.array, **kw: Any) -> Any:
            reads.append(int(x.shape[1]))
            return draft(x, **kw)

    counting = Counting()
    with PrefixCache(target, tmp_path, boundary=0) as pc:
        for i in range(2):  # a miss, then a hit restoring the target's and the draft's caches
            reads.clear()
            got = [(r.token, r.from_draft, np.array(r.logprobs).tobytes(), r.text, r.finish_reason)
                   for r in pc.stream_generate(tok, PROMPT, max_tokens=8, draft_model=counting, num_draft_tokens=3)]
            assert got == want
            # the miss reads the prompt's first 36 tokens into the draft; the hit only decodes (1-2 tokens a step)
            assert max(reads) == (len(PROMPT) - 1 if i == 0 else 2)
        st = pc.stats()
        assert (st.hits, st.committed, st.bypassed) == (1, 1, 0) and st.restored_tokens == len(PROMPT) - 1


def test_the_prefill_rate_leaves_the_progress_callback_out(llama: Any, tmp_path: Path) -> None:
    """A known trace (issue 47 item 9): the caller's prompt_progress_callback sleeps W once, after
    the first chunk read (outside the model); the rate is of the chunks' computation only. Pieces
    of 16, 16 and 4 tokens (boundary 16; the last, under 16 tokens, is not timed): the rate's
    decayed sums are 0.8 * 16 + 16 tokens over 0.8 * c1 + c2 seconds; W, scaled to this machine's
    load now, is far above what two 16-token chunks take."""
    import time

    ids = mx.array(PROMPT)
    t0 = time.perf_counter()
    list(G.generate_step(ids, llama, max_tokens=1))  # warm-up: a first forward's one-off costs are no rate
    W = 1.0 + 6 * (time.perf_counter() - t0)
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 2:  # the first chunk's progress, inside the first piece's read
            time.sleep(W)

    with PrefixCache(llama, tmp_path, boundary=16) as pc:
        list(pc.generate_step(ids, max_tokens=2, prompt_progress_callback=progress))
        rate = pc.prefill_rate.tokens_per_s
    assert rate is not None
    seconds = (0.8 * 16 + 16) / rate
    assert seconds < 0.4 * W, (seconds, W)  # timing the callback too: >= 0.8 * W


def test_a_read_only_cache_generates_and_saves_nothing(llama: Any, tmp_path: Path) -> None:
    """A cache baked into a read-only image (issue 47 item 12): a prompt not stored is generated as
    mlx_lm generates it — nothing saved, each capture it does not take counted as skipped — instead
    of raising StateError; a stored one restores."""
    ids, other = mx.array(PROMPT), mx.array(mlx_models.PROMPT_B)
    with PrefixCache(llama, tmp_path, boundary=0) as pc:  # no cuts: one stop, the prompt's last token but one
        list(pc.generate_step(ids, max_tokens=4))
        before = pc.store.stats().snapshots
    ref = list(G.generate_step(other, llama, max_tokens=4))
    with PrefixCache(llama, tmp_path, boundary=0, read_only=True) as pc:
        assert pc.store.read_only
        assert _same(list(pc.generate_step(other, max_tokens=4)), ref)
        list(pc.generate_step(ids, max_tokens=4))
        st = pc.stats()
        stops = sorted({*pc.split(other.size), other.size - 1} - {0})
        assert st.hits == 1 and st.captures == st.committed == 0 and st.skipped == len(stops)
        assert pc.store.stats().snapshots == before


def _tuner_classes() -> list[type]:
    """Every layer class mlx_lm's tuner defines (LoRA and DoRA: linear, switch-linear, embedding)."""
    import inspect

    import mlx.nn as nn
    from mlx_lm.tuner import dora, lora

    return [c for mod in (lora, dora) for _, c in inspect.getmembers(mod, inspect.isclass)
            if issubclass(c, nn.Module) and c.__module__ == mod.__name__]


@pytest.mark.parametrize("cls", _tuner_classes(), ids=lambda c: c.__name__)
def test_an_adapter_scale_set_to_zero_changes_the_identity(cls: type, tmp_path: Path) -> None:
    """Walks mlx_lm's tuner layers (issue 47 item 4): each wraps a layer of a tiny model (its adapter
    weights made non-zero), a prompt is stored, then the layer's ``scale`` — a plain float, no array
    changes — is set to 0: the next call is under a new identity (nothing restored that the adapter
    computed) and equals mlx_lm with the adapter off."""
    from mlx.utils import tree_unflatten

    name = cls.__name__
    arch, base = ("qwen3_next", "SwitchLinear") if "Switch" in name else \
        ("llama", "Embedding") if name.endswith("Embedding") else ("llama", "Linear")
    model = mlx_models.build(arch)
    path, layer = next((p, m) for p, m in model.named_modules() if type(m).__name__ == base)
    tuned = cls.from_base(layer, r=4, scale=2.0)  # type: ignore[attr-defined]
    tuned.lora_b = mx.random.normal(tuned.lora_b.shape) * 0.5  # mlx_lm starts it at zero: no effect yet
    model.update_modules(tree_unflatten([(path, tuned)]))
    mx.eval(model.parameters())
    ids = mx.array(PROMPT)
    with PrefixCache(model, tmp_path, boundary=0) as pc:
        list(pc.generate_step(ids, max_tokens=4))
        key = pc.store.identity.key
        tuned.scale = 0.0
        ref = list(G.generate_step(ids, model, max_tokens=4))
        assert _same(list(pc.generate_step(ids, max_tokens=4)), ref)
        st = pc.stats()
        assert st.identity_changes == 1 and st.hits == 0 and pc.store.identity.key != key, (name, st)
        assert _same(list(pc.generate_step(ids, max_tokens=4)), ref)  # the new identity's own snapshot
        assert pc.stats().hits == 1


def test_dropout_in_training_mode_is_not_served_and_quantization_settings_are_seen(tmp_path: Path) -> None:
    """A LoRA layer with dropout in a model switched to training mode draws anew each forward: the
    call goes to mlx_lm unchanged; a quantized layer's bits and group size are in the look."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    from snapstore.engine.mlx._identify import module_settings

    model = mlx_models.build("llama")
    path, layer = next((p, m) for p, m in model.named_modules() if type(m).__name__ == "Linear")
    model.update_modules(tree_unflatten([(path, LoRALinear.from_base(layer, r=4, dropout=0.5))]))
    ids = mx.array(PROMPT)
    with PrefixCache(model, tmp_path, boundary=0) as pc:
        model.train()
        list(pc.generate_step(ids, max_tokens=2))
        assert pc.stats().bypassed == 1 and pc.stats().captures == 0
        model.eval()
        list(pc.generate_step(ids, max_tokens=2))
        assert pc.stats().captures == 1
    quantized = mlx_models.build("llama")
    nn.quantize(quantized, group_size=32, bits=4)
    attrs = {k: v for _, cls_name, kv in module_settings(quantized) if cls_name == "QuantizedLinear" for k, v in kv}
    assert attrs.get("bits") == 4 and attrs.get("group_size") == 32
