"""PrefixCache keys everything that changes the numbers, or steps aside (issue 24, items 6 and 7).

The table of docs/engine.md section 9, walked: each input that changes the numbers (weights changed
in place on the same model object, config, attention implementation, LoRA adapters, non-persistent
buffers, numerics settings) is changed after a prompt was stored, and the next call must miss and
equal the uncached reference under the changed input; each generate argument that a restored call
cannot serve exactly (hidden states, attentions, a static or caller's cache, chunked prefill,
assisted decoding, ...) must give exactly ``model.generate``'s result, restoring and saving nothing.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import snapstore as ss  # noqa: E402
from snapstore.engine import hf  # noqa: E402
from snapstore.engine.hf._generate import _DECODE_FIELDS, _NEUTRAL_FIELDS, bypass_reason  # noqa: E402

# tests/: the shared helper modules live there
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, TESTS_DIR)
from test_engine_hf import build  # noqa: E402
from test_prefix_cache import BOUNDARY, S, cuts, digest, kw, pinned, prompts, reference, tokens  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # transformers models built at test time: the slow tier


def _pc(model: Any, path: Any, **kw_: Any) -> Any:
    """A PrefixCache with a real model's prefill rate (``pinned``: what these tests check is what a
    restore gives, not the restore-or-recompute choice, which a tiny model's own rate may flip)."""
    return pinned(hf.PrefixCache(model, str(path), budget=ss.Budget(reserve_bytes=0), boundary=BOUNDARY, **kw_))


def _restored(pc: Any, ids: Any, **gen: Any) -> tuple[Any, int]:
    """One call with the shared system prompt as cut: its output and the tokens it restored."""
    r0 = pc.stats().restored_tokens
    out = pc.generate(ids, cache_prefix=S, **gen)
    return out, pc.stats().restored_tokens - r0


def _expected(model: Any, ids: Any) -> str:
    return digest(reference(model, ids, cuts(ids.shape[1], [S]), **kw()))


def _deep_digest(out: Any) -> str:
    """SHA-256 over the ids and every tensor of the output (scores, logits, hidden states, attentions)."""
    h = hashlib.sha256()

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(repr((tuple(x.shape), str(x.dtype))).encode())
            h.update(x.detach().float().cpu().numpy().tobytes())
        elif isinstance(x, (tuple, list)):
            h.update(f"[{len(x)}".encode())
            for y in x:
                add(y)
        elif x is not None:
            h.update(repr(x).encode())

    if isinstance(out, torch.Tensor):
        add(out)
    else:
        for k in sorted(out.keys()):
            h.update(k.encode())
            add(out[k])
    return h.hexdigest()


# -- item 6: the identity follows the model as it is now --------------------------------------------

def _noise(model: Any) -> None:
    g = torch.Generator().manual_seed(7)
    model.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)
                           for k, v in model.state_dict().items()})


def _sgd_step(model: Any) -> None:
    ids = tokens("llama", "train", 24)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _data_assign(model: Any) -> None:
    w = model.model.layers[0].self_attn.k_proj.weight
    w.data = w.data * 1.5  # a new storage under the same Parameter (its version counter stays)


def _new_parameter(model: Any) -> None:
    att = model.model.layers[0].self_attn
    att.k_proj.weight = torch.nn.Parameter(att.k_proj.weight.detach() * 1.5)


def _dtype(model: Any) -> None:
    model.double()  # every tensor converted: new storages, another K/V dtype and layout


def _buffer_in_place(model: Any) -> None:
    model.model.rotary_emb.inv_freq.mul_(1.1)  # a non-persistent buffer: not in the state dict


def _attn_eager(model: Any) -> None:
    model.set_attn_implementation("eager")


def _config_field(model: Any) -> None:
    model.config.sliding_window = 6  # Mistral reads it at every forward (the mask) and the cache its window


def _threads(model: Any) -> None:
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)


def _matmul_precision(model: Any) -> None:
    torch.set_float32_matmul_precision("medium" if torch.get_float32_matmul_precision() != "medium" else "high")


WEIGHTS: dict[str, Callable[[Any], None]] = {
    "load_state_dict": _noise, "optimizer_step": _sgd_step, "param_data_assigned": _data_assign,
    "parameter_replaced": _new_parameter, "buffer_in_place": _buffer_in_place, "dtype": _dtype,
}
SETTINGS: dict[str, Callable[[Any], None]] = {
    "attn_implementation": _attn_eager, "config_field": _config_field, "num_threads": _threads,
    "float32_matmul_precision": _matmul_precision,
}


@pytest.fixture
def numerics() -> Any:
    """Put the process-wide settings the table changes back as they were."""
    threads, prec = torch.get_num_threads(), torch.get_float32_matmul_precision()
    yield
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(prec)


@pytest.mark.parametrize("change", [*WEIGHTS, *SETTINGS])
def test_a_changed_input_is_a_miss_and_equals_the_model_as_it_is_now(tmp_path: Any, change: str,
                                                                       numerics: Any) -> None:
    """Before: the K/V of the old weights/config was restored (restored == S, another output), or
    (config) transformers' restore refused it with an IdentityError."""
    key = "mistral_sliding" if change == "config_field" else "llama"
    model = build(key, "cpu")
    p = prompts(key)
    with _pc(model, tmp_path) as pc:
        pc.generate(p["a1"], cache_prefix=S, **kw())
        ident = pc.store.identity
        {**WEIGHTS, **SETTINGS}[change](model)
        out, restored = _restored(pc, p["b"], **kw())
        assert restored == 0 and pc.stats().identity_changes == 1 and pc.store.identity != ident
        assert digest(out) == _expected(model, p["b"])  # the numbers of the model as it is now
        again, restored = _restored(pc, p["b"], **kw())  # the new identity serves its own snapshots
        assert restored == cuts(p["b"].shape[1], [S])[-1] and digest(again) == digest(out)
        # the old weights or settings are another model or configuration (another pack or extra): their
        # cuts 16, S and prompt are never deleted at open, only evicted by LRU under the budget
        assert pc.store.stats().stale_dropped == 0


def test_weights_loaded_back_find_their_snapshots_again(tmp_path: Any) -> None:
    """The identity is the weights' hash as they are now: a checkpoint loaded back is the old identity."""
    model = build("llama", "cpu")
    p = prompts("llama")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with _pc(model, tmp_path, drop_stale=False) as pc:
        pc.generate(p["a1"], cache_prefix=S, **kw())
        first = pc.store.identity
        _noise(model)
        assert _restored(pc, p["b"], **kw())[1] == 0
        model.load_state_dict(original)
        out, restored = _restored(pc, p["b"], **kw())
        assert restored == S and pc.store.identity == first and pc.stats().identity_changes == 2
        assert digest(out) == _expected(model, p["b"])


def test_an_unseen_in_place_write_is_found_by_refresh(tmp_path: Any) -> None:
    """A write through ``.data`` bumps no version counter: ``refresh()`` re-hashes on the caller's word."""
    model = build("llama", "cpu")
    p = prompts("llama")
    with _pc(model, tmp_path) as pc:
        pc.generate(p["a1"], cache_prefix=S, **kw())
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(1.5)
        pc.refresh()
        out, restored = _restored(pc, p["b"], **kw())
        assert restored == 0 and digest(out) == _expected(model, p["b"])
        pc.close()
        with pytest.raises(ss.StateError):
            pc.refresh()


def test_a_change_during_the_call_commits_none_of_its_captures(tmp_path: Any) -> None:
    """A callback that updates the weights mid-call: the call's captures may mix two models; none is kept."""
    model = build("llama", "cpu")
    p = prompts("llama")

    class Step:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == 2:
                with torch.no_grad():
                    model.lm_head.weight.mul_(1.01)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with _pc(model, tmp_path) as pc:
        pc.generate(p["a1"], cache_prefix=S, stopping_criteria=[Step()], **kw())
        st = pc.stats()
        assert st.captures >= 1 and st.committed == 0 and st.abandoned == st.captures
        assert pc.store.snapshots() == []


def test_lora_adapters_on_the_same_model_enter_the_key(tmp_path: Any) -> None:
    """PEFT LoRA via transformers' integration: adding, switching and disabling adapters write no
    tensor of the model; each is a miss, and the output is the model's with that adapter state."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = build("llama", "cpu")
    p = prompts("llama")

    def lora(name: str) -> None:
        torch.manual_seed(sum(map(ord, name)))
        model.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False),
                          adapter_name=name)

    steps: list[tuple[str, Callable[[], None]]] = [
        ("add a", lambda: lora("a")), ("add b", lambda: lora("b")), ("switch to a", lambda: model.set_adapter("a")),
        ("disable", model.disable_adapters), ("enable", model.enable_adapters)]
    with _pc(model, tmp_path, drop_stale=False) as pc:
        pc.generate(p["a1"], cache_prefix=S, **kw())
        seen = [pc.store.identity]
        for what, step in steps:
            step()
            out, restored = _restored(pc, p["d"], **kw())
            assert digest(out) == _expected(model, p["d"]), what
            if what == "enable":  # back to adapter a, as after "switch to a": that identity, its snapshots
                assert restored > 0 and pc.store.identity == seen[3], what
                continue
            assert restored == 0 and pc.store.identity not in seen, what
            seen.append(pc.store.identity)
            assert _restored(pc, p["d"], **kw())[1] > 0, what


# -- item 7: what a restored call cannot serve goes to model.generate ------------------------------

def _static(model: Any) -> dict[str, Any]:
    model.generation_config.cache_implementation = "static"
    return {}


def _gc_hidden(model: Any) -> dict[str, Any]:
    from transformers import GenerationConfig

    return {"generation_config": GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0,  # type: ignore[no-untyped-call]
                                                  return_dict_in_generate=True, output_hidden_states=True)}


BYPASSED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "output_hidden_states": lambda m: {**kw(), "output_hidden_states": True},
    "output_attentions": lambda m: {**kw(), "output_attentions": True},
    "generation_config_hidden_states": _gc_hidden,
    "cache_implementation_static": lambda m: {**kw(), "cache_implementation": "static"},
    "model_generation_config_static": lambda m: {**kw(), **_static(m)},
    "prefill_chunk_size": lambda m: {**kw(), "prefill_chunk_size": 8},
    "callers_past_key_values": lambda m: {**kw(), "past_key_values": transformers.DynamicCache(config=m.config)},
    "use_cache_false": lambda m: {**kw(), "use_cache": False},
    "assistant_model": lambda m: {**kw(), "assistant_model": m},
    "prompt_lookup": lambda m: {**kw(), "prompt_lookup_num_tokens": 3},
    "position_ids": lambda m: {**kw(), "position_ids": torch.arange(50)[None] + 3},
    "guidance_scale": lambda m: {**kw(), "guidance_scale": 1.5},
}


@pytest.mark.parametrize("case", list(BYPASSED))
def test_calls_a_restore_cannot_serve_equal_model_generate(tmp_path: Any, case: str) -> None:
    """Before: hidden states/attentions of the tokens read after the restore only, transformers' own
    ValueError for a static cache, InvalidInputError for a caller's cache; now model.generate's result."""
    model = build("llama", "cpu")
    if case == "output_attentions":
        model.set_attn_implementation("eager")
    b = prompts("llama")["b"]
    with _pc(model, tmp_path) as pc:
        pc.generate(prompts("llama")["a1"], cache_prefix=S, **kw())  # the system prompt is stored
        before = [s.snapshot_id for s in pc.store.snapshots()]
        gen = BYPASSED[case](model)
        out = pc.generate(b, cache_prefix=S, **gen)
        st = pc.stats()
        assert st.bypassed == 1 and st.restored_tokens == 0 and st.calls == 2
        assert [s.snapshot_id for s in pc.store.snapshots()] == before  # nothing saved either
        ref = model.generate(b, **BYPASSED[case](model))
        assert _deep_digest(out) == _deep_digest(ref)
        if case.endswith("hidden_states"):
            assert out.hidden_states[0][0].shape[1] == b.shape[1]  # every prompt token, not the last piece
        ref2 = pc.uncached_generate(b, cache_prefix=S, **BYPASSED[case](model))
        assert _deep_digest(ref2) == _deep_digest(ref)


def test_training_mode_goes_to_model_generate(tmp_path: Any) -> None:
    """Dropout draws anew each forward: a model in training mode is never served from (or into) the store."""
    model = build("llama", "cpu")
    p = prompts("llama")
    with _pc(model, tmp_path) as pc:
        pc.generate(p["a1"], cache_prefix=S, **kw())
        before = len(pc.store.snapshots())
        model.train()
        out = pc.generate(p["b"], cache_prefix=S, **kw())
        assert pc.stats().bypassed == 1 and pc.stats().restored_tokens == 0 and len(pc.store.snapshots()) == before
        assert digest(out) == digest(model.generate(p["b"], **kw()))


def test_the_allow_list_covers_every_generation_field_and_what_it_serves_is_equal(tmp_path: Any) -> None:
    """Every GenerationConfig field of this transformers is classified (a new one is served only at its
    default); what is served (scores, logits, processors, constraints on the next token, sampling)
    restores and equals the uncached reference."""
    from transformers import GenerationConfig, LogitsProcessorList, MinLengthLogitsProcessor

    fields = set(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
    assert fields <= _DECODE_FIELDS | set(_NEUTRAL_FIELDS), sorted(fields - _DECODE_FIELDS - set(_NEUTRAL_FIELDS))
    model = build("llama", "cpu")
    assert bypass_reason(model, kw()) is None
    assert "forward" in (bypass_reason(model, {**kw(), "brand_new_kwarg": 1}) or "")
    p = prompts("llama")

    class Stream:
        def __init__(self) -> None:
            self.seen: list[Any] = []

        def put(self, value: Any) -> None:
            self.seen.append(value.clone())

        def end(self) -> None:
            pass

    served: list[Callable[[], dict[str, Any]]] = [
        lambda: {**kw(), "output_logits": True},
        lambda: {**kw(), "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 3},
        lambda: {**kw(), "prefix_allowed_tokens_fn": lambda batch, ids: list(range(0, 256, 3))},
        lambda: {**kw(), "logits_processor": LogitsProcessorList([MinLengthLogitsProcessor(60, eos_token_id=2)])},
        lambda: {**kw(), "do_sample": True, "top_k": 20, "temperature": 0.7},
    ]
    with _pc(model, tmp_path) as pc:
        pc.generate(p["a1"], cache_prefix=S, **kw())
        for make in served:
            torch.manual_seed(3)
            out, restored = _restored(pc, p["b"], **make())
            torch.manual_seed(3)
            ref = reference(model, p["b"], cuts(p["b"].shape[1], [S]), **make())
            assert restored > 0 and _deep_digest(out) == _deep_digest(ref)
        mine, theirs = Stream(), Stream()
        _restored(pc, p["b"], streamer=mine, **kw())
        reference(model, p["b"], cuts(p["b"].shape[1], [S]), streamer=theirs, **kw())
        assert [t.tolist() for t in mine.seen] == [t.tolist() for t in theirs.seen]
        assert pc.stats().bypassed == 0
