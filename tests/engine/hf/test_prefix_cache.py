"""PrefixCache(model).generate: equal to model.generate, restored in new processes, exact across conversations.

The proof (slow, one child process per phase, every model in each): process 1 answers conversation A
(system prompt S + question) on a fresh store, then is killed inside a later call; process 2 (a
restart) answers conversation B (same S, new question: restores S), turn 2 of A (restores A's
prompt), and a call interrupted by a raising StoppingCriteria. Every output (sequences and every
score) equals a reference computed here with plain ``model.generate`` calls over one DynamicCache
prefilled at the same cuts (no store); the shared root is stored once; the interrupted and the
killed calls leave no committed snapshot.

Run as a script (``python tests/engine/hf/test_prefix_cache.py child <phase> <dir> <models...>``) it is the child.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import snapstore as ss  # noqa: E402
from snapstore.engine import hf  # noqa: E402
from snapstore.engine.hf._prefix_cache import BatchNotSupportedError, PrefixCacheStats, default_boundary  # noqa: E402

# tests/: the shared helper modules live there
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, TESTS_DIR)
from test_engine_hf import build  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # transformers models built at test time: the slow tier

V = 256
THREADS = 1
BOUNDARY = 16
S = 20  # the shared system prompt (not a multiple of BOUNDARY: cache_prefix makes it a cut)
Q_A, Q_B, Q_A2, Q_D = 9, 30, 7, 40  # question lengths: A turn 1, B, A turn 2, D (the killed call)
N = 5  # new tokens per call
MODELS = ["llama", "mistral_sliding", "bamba", "qwen3_next"]  # full attn, sliding window, Mamba2, gated DeltaNet
KILLED = 17


def kw() -> dict[str, Any]:
    """Greedy generate kwargs that return sequences and every score."""
    return dict(max_new_tokens=N, do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0)


def tokens(key: str, tag: str, n: int) -> Any:
    """Seeded random token ids in [1, V): no pad id (0), so plain generate infers no padding."""
    g = torch.Generator().manual_seed(sum(map(ord, key + tag)))
    return torch.randint(1, V, (1, n), generator=g)


def prompts(key: str) -> dict[str, Any]:
    system = tokens(key, "system", S)
    return {q: torch.cat([system, tokens(key, q, n)], dim=1) for q, n in (("a1", Q_A), ("b", Q_B), ("d", Q_D))}


def digest(out: Any) -> str:
    """SHA-256 of the generated sequences and of every score tensor, in order."""
    h = hashlib.sha256(out.sequences.cpu().numpy().tobytes())
    for s in out.scores:
        h.update(s.float().cpu().numpy().tobytes())
    return h.hexdigest()


def cuts(n: int, cache_prefix: list[int]) -> list[int]:
    """The split, written out independently of PrefixCache.split: multiples of BOUNDARY and cache_prefix."""
    return sorted({*range(BOUNDARY, n, BOUNDARY), *(p for p in cache_prefix if p < n)})


@torch.no_grad()
def reference(model: Any, ids: Any, at: list[int], **gen: Any) -> Any:
    """Plain model.generate with no store: pieces read by generate (one token each, dropped), then the call."""
    from transformers import DynamicCache

    if not at:
        return model.generate(ids, **gen)
    cache = DynamicCache(config=model.config)
    for c in at:
        model.generate(ids[:, :c], attention_mask=torch.ones_like(ids[:, :c]), past_key_values=cache,
                       max_new_tokens=1, do_sample=False, pad_token_id=0)
    return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **gen)


class EngineRate(ss.PrefillRate):
    """A real model's prefill rate, pinned (100 tokens/s). These tiny models read a token in
    microseconds, often faster than a disk restores its rows, so with their own measured rate the
    store may rightly read a short prefix instead of restoring it (docs/api.md "Restore or
    recompute"), and a test's restore would depend on the machine's load. These tests are about
    what a restore gives; the rate and the choice have their own tests (``measured=True``)."""

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    @property
    def tokens_per_s(self) -> float:
        return 100.0


def pinned(pc: Any, measured: bool = False) -> Any:
    """``pc`` with a real model's rate (:class:`EngineRate`), unless ``measured``: its own."""
    if not measured:
        pc.prefill_rate = EngineRate()
    return pc


def open_pc(model: Any, root: str, key: str, **kw_: Any) -> Any:
    return pinned(hf.PrefixCache(model, os.path.join(root, key), boundary=BOUNDARY,
                                 budget=ss.Budget(reserve_bytes=0), check_rows=True, **kw_))


def listing(pc: Any) -> list[dict[str, Any]]:
    return [{"id": s.snapshot_id, "n": s.n_tokens, "session": s.session, "matchable": s.matchable,
             "pending": s.pending} for s in pc.store.snapshots()]


class Raise:
    """A StoppingCriteria that raises on its ``at``-th call (a client that went away)."""

    def __init__(self, at: int = 2):
        self.at, self.calls = at, 0

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls >= self.at:
            raise KeyboardInterrupt("client went away")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class Die:
    """A StoppingCriteria that kills the process (no cleanup at all) once the prompt has been read."""

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        sys.stdout.flush()
        os._exit(KILLED)


# -- the child process ---------------------------------------------------------------------------

@torch.no_grad()
def phase1(key: str, root: str) -> dict[str, Any]:
    """A fresh store: conversation A, turn 1 (a miss)."""
    model = build(key, "cpu")
    p = prompts(key)
    with open_pc(model, root, key) as pc:
        out = pc.generate(p["a1"], cache_prefix=S, session="A", **kw())
        st = pc.stats()
        return {"a1": digest(out), "a1_sequences": out.sequences[0].tolist(), "hits": st.hits,
                "captures": st.captures, "committed": st.committed, "snapshots": listing(pc)}


@torch.no_grad()
def killed(key: str, root: str) -> None:
    """Conversation D: captures at every cut are pending when the process dies."""
    model = build(key, "cpu")
    pc = open_pc(model, root, key)
    pc.generate(prompts(key)["d"], cache_prefix=S, session="D", stopping_criteria=[Die()], **kw())


@torch.no_grad()
def phase2(key: str, root: str, a1_sequences: list[int]) -> dict[str, Any]:
    """After a restart: conversation B, A's turn 2, an interrupted call; what the store holds then."""
    model = build(key, "cpu")
    p = prompts(key)
    out: dict[str, Any] = {}
    with open_pc(model, root, key) as pc:
        out["after_restart"] = listing(pc)
        d = pc.store.match(p["d"][0].tolist())
        out["d_match"] = d.n_tokens if d else 0
        out["b"] = digest(pc.generate(p["b"], cache_prefix=S, session="B", **kw()))
        out["b_restored"] = pc.stats().restored_tokens
        a2 = torch.cat([torch.tensor([a1_sequences]), tokens(key, "a2", Q_A2)], dim=1)
        r0 = pc.stats().restored_tokens
        out["a2"] = digest(pc.generate(a2, cache_prefix=[S, len(a1_sequences) - N], session="A", **kw()))
        out["a2_restored"] = pc.stats().restored_tokens - r0
        before = listing(pc)
        try:
            pc.generate(p["d"], cache_prefix=S, session="D", stopping_criteria=[Raise()], **kw())
            out["interrupted"] = False
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["before_interrupt"], out["after_interrupt"] = before, listing(pc)
        st = pc.stats()
        out["captures"], out["abandoned"] = st.captures, st.abandoned
        out["verify_ok"] = pc.store.verify(deep=True).ok
    return out


def _child_main(argv: list[str]) -> None:
    phase, root, keys = argv[0], argv[1], argv[2:]
    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    if phase == "1":
        print(json.dumps({k: phase1(k, root) for k in keys}))
        killed(keys[-1], root)  # never returns
    else:
        prior = json.loads(sys.stdin.read())
        print(json.dumps({k: phase2(k, root, prior[k]["a1_sequences"]) for k in keys}))


def _child(phase: str, root: str, keys: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, os.path.abspath(__file__), "child", phase, root, *keys], input=stdin,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"})


@torch.no_grad()
def references(key: str, a1_sequences: list[int]) -> dict[str, str]:
    model = build(key, "cpu")
    p = prompts(key)
    a2 = torch.cat([torch.tensor([a1_sequences]), tokens(key, "a2", Q_A2)], dim=1)
    n1 = len(a1_sequences) - N
    return {"a1": digest(reference(model, p["a1"], cuts(p["a1"].shape[1], [S]), **kw())),
            "b": digest(reference(model, p["b"], cuts(p["b"].shape[1], [S]), **kw())),
            "a2": digest(reference(model, a2, cuts(a2.shape[1], [S, n1]), **kw()))}


@pytest.fixture(scope="module")
def proof(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("prefixproof"))
    p1 = _child("1", root, MODELS)
    assert p1.returncode == KILLED, p1.stderr[-4000:]
    first = json.loads(p1.stdout.strip().splitlines()[-1])
    p2 = _child("2", root, MODELS, stdin=json.dumps(first))
    assert p2.returncode == 0, p2.stderr[-4000:]
    second = json.loads(p2.stdout.strip().splitlines()[-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        refs = {k: references(k, first[k]["a1_sequences"]) for k in MODELS}
    finally:
        torch.set_num_threads(threads)
    return {k: (first[k], second[k], refs[k]) for k in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize("key", MODELS)
def test_equal_to_model_generate_across_processes_and_conversations(proof: dict[str, Any], key: str) -> None:
    first, second, ref = proof[key]
    n1 = S + Q_A
    # process 1, a miss on a fresh store: equal to model.generate with the same cuts, nothing restored
    assert first["a1"] == ref["a1"] and first["hits"] == 0
    assert sorted(s["n"] for s in first["snapshots"]) == [BOUNDARY, S, n1]  # the cuts and the prompt's own end
    assert first["committed"] == first["captures"] == 3
    # process 2 (a restart): conversation B restores the shared system prompt and equals model.generate
    assert second["b"] == ref["b"] and second["b_restored"] == S
    # turn 2 of A restores A's whole turn-1 prompt (cache_prefix names it) and equals model.generate
    assert second["a2"] == ref["a2"] and second["a2_restored"] == n1
    final = second["after_interrupt"]
    assert [s["n"] for s in final].count(S) == 1  # the shared root is stored once
    turn1 = [s for s in final if s["session"] == "A" and s["n"] == n1]
    assert turn1 and not turn1[0]["matchable"]  # superseded by turn 2 (kept only as turn 2's parent rows)
    assert any(s["session"] == "A" and s["n"] == n1 + N + Q_A2 and s["matchable"] for s in final)
    # the interrupted call (raised from a StoppingCriteria) left nothing: no new snapshot, nothing pending
    assert second["interrupted"] and second["before_interrupt"] == final
    assert second["abandoned"] >= 1 and not any(s["pending"] for s in final)
    assert second["verify_ok"]


@pytest.mark.slow
def test_killed_call_leaves_no_committed_snapshot(proof: dict[str, Any]) -> None:
    """Process 1 died inside conversation D's call, after its pending captures: none survives the restart."""
    first, second, _ = proof[MODELS[-1]]
    assert sorted(s["n"] for s in second["after_restart"]) == sorted(s["n"] for s in first["snapshots"])
    assert second["d_match"] == S  # only the shared root (saved by process 1's first call) matches D
    assert not any(s["pending"] for s in second["after_restart"])


# -- in-process behaviour (llama unless said otherwise) -------------------------------------------

@pytest.fixture(scope="module")
def llama() -> Any:
    transformers.logging.set_verbosity_error()
    return build("llama", "cpu")


def _pc(model: Any, path: Any, measured: bool = False, **kw_: Any) -> Any:
    return pinned(hf.PrefixCache(model, str(path), budget=ss.Budget(reserve_bytes=0),
                                 **{"boundary": BOUNDARY, **kw_}), measured)


def _same(a: Any, b: Any) -> bool:
    return digest(a) == digest(b)


def test_without_cuts_equals_plain_generate_and_saves_each_prompt_once(llama: Any, tmp_path: Any) -> None:
    ids = tokens("llama", "short", 12)
    with _pc(llama, tmp_path, boundary=0) as pc:
        assert pc.split(12) == []
        first, second = pc.generate(ids, session="s", **kw()), pc.generate(ids, session="s", **kw())
        plain = llama.generate(ids, **kw())
        assert _same(first, plain) and _same(second, plain)
        assert torch.equal(pc.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0),
                           llama.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))  # a bare tensor
        assert [(s.n_tokens, s.session) for s in pc.store.snapshots()] == [(12, "s")]  # once per distinct prompt
        assert pc.stats().captures == 1


def test_hit_equals_uncached_and_the_plain_generate_reference(llama: Any, tmp_path: Any) -> None:
    a, b = prompts("llama")["a1"], prompts("llama")["b"]
    with _pc(llama, tmp_path) as pc:
        pc.generate(a, cache_prefix=S, **kw())
        hit = pc.generate(b, cache_prefix=S, **kw())
        st = pc.stats()
        assert isinstance(st, PrefixCacheStats) and st.calls == 2 and st.hits == 1 and st.restored_tokens == S
        assert st.prefilled_tokens == a.shape[1] + b.shape[1] - S and st.store.snapshots >= 1
        assert json.dumps(st.to_dict())
        ref = reference(llama, b, cuts(b.shape[1], [S]), **kw())
        assert _same(hit, ref) and _same(pc.uncached_generate(b, cache_prefix=S, **kw()), ref)
        assert pc.split(b.shape[1], [S, 999]) == cuts(b.shape[1], [S])


@pytest.mark.parametrize("how", ["stopping_criteria", "streamer"])
def test_interrupted_call_commits_nothing(llama: Any, tmp_path: Any, how: str) -> None:
    class RaisingStreamer:
        def __init__(self) -> None:
            self.puts = 0

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts >= 3:  # the prompt, the first token, then the client is gone
                raise ConnectionResetError("client went away")

        def end(self) -> None:
            pass

    ids = prompts("llama")["d"]
    extra = {"stopping_criteria": [Raise()]} if how == "stopping_criteria" else {"streamer": RaisingStreamer()}
    with _pc(llama, tmp_path) as pc:
        with pytest.raises((KeyboardInterrupt, ConnectionResetError)):
            pc.generate(ids, cache_prefix=S, session="x", **extra, **kw())
        st = pc.stats()
        assert st.captures == len(cuts(ids.shape[1], [S])) + 1 and st.abandoned == st.captures
        assert pc.store.snapshots() == [] and pc.store.match(ids[0].tolist()) is None
        assert st.committed == 0 and st.store.pending == 0


def test_batch_and_beams_refused_with_a_snapstore_error(llama: Any, tmp_path: Any) -> None:
    with _pc(llama, tmp_path) as pc:
        for ids, extra in ((torch.ones((2, 8), dtype=torch.long), {}), (tokens("llama", "x", 8), {"num_beams": 2}),
                           (tokens("llama", "x", 8), {"num_return_sequences": 2, "do_sample": True})):
            with pytest.raises(BatchNotSupportedError) as e:
                pc.generate(ids, max_new_tokens=2, **extra)
            assert isinstance(e.value, ss.SnapstoreError) and isinstance(e.value, NotImplementedError)
            assert "one sequence" in str(e.value)
        ids = tokens("llama", "x", 8)
        # a caller's cache, use_cache=False, embeddings: passed to model.generate (test_prefix_cache_keys.py)
        bad: list[dict[str, Any]] = [{"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])},
                                     {"cache_prefix": -3}, {"cache_prefix": "12"}, {"cache_prefix": [4, 2.5]},
                                     {"session": ""}]
        for extra in bad:
            with pytest.raises(ss.InvalidInputError):
                pc.generate(ids, max_new_tokens=2, **extra)
        with pytest.raises(ss.InvalidInputError):
            pc.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=2)
        assert pc.store.snapshots() == [] and pc.stats().calls == 0
    with pytest.raises(ss.ConfigError):
        hf.PrefixCache(llama, str(tmp_path), boundary=-1)
    with pytest.raises(ss.ConfigError):
        hf.PrefixCache(llama, str(tmp_path), resume="sometimes")


def test_split_and_default_boundary(llama: Any, tmp_path: Any) -> None:
    with _pc(llama, tmp_path) as pc:
        assert pc.split(50, [20, 70]) == [16, 20, 32, 48]
        assert pc.split(48, 16) == [16, 32]  # the prompt's end is never a cut: generate reads the last piece
        assert pc.split(10, [3, 3, 7]) == [3, 7]
    with hf.PrefixCache(llama, str(tmp_path)) as pc:
        assert pc.boundary == 8192  # 512 bytes per token: one 8192-token segment is 4 MiB

    def lay(row_bytes: int) -> ss.Layout:
        return ss.Layout(rows={"kv": ss.Rows("uint8", (row_bytes,))})

    assert default_boundary(lay(128 << 10)) == 8192  # e.g. an 8B model: 1 GiB per 8192 tokens
    assert default_boundary(lay(320 << 10)) == 4096  # a 70B GQA model: 2.5 GiB per 8192 -> 4096
    assert default_boundary(lay(64 << 20)) == 512  # never below 512
    assert default_boundary(ss.Layout(fixed={"s": ss.Fixed("float32", (4,))})) == 8192  # no rows at all


def test_resume_longest_restores_the_previous_turn_without_naming_it(llama: Any, tmp_path: Any) -> None:
    a1 = prompts("llama")["a1"]
    n1 = a1.shape[1]
    for resume, restored in (("cut", S), ("longest", n1)):
        with _pc(llama, tmp_path / resume, resume=resume) as pc:
            first = pc.generate(a1, cache_prefix=S, session="A", **kw())
            a2 = torch.cat([first.sequences, tokens("llama", "a2", Q_A2)], dim=1)
            r0 = pc.stats().restored_tokens
            out = pc.generate(a2, cache_prefix=S, session="A", **kw())  # turn 1's end is not named
            assert pc.stats().restored_tokens - r0 == restored
            # "cut": the split of the call alone; "longest": the split with the restored position added
            at = [S] if resume == "cut" else [S, n1]
            assert _same(out, reference(llama, a2, cuts(a2.shape[1], at), **kw()))


def test_damaged_snapshot_falls_back_to_reading_the_prompt(llama: Any, tmp_path: Any,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    a, b = prompts("llama")["a1"], prompts("llama")["b"]
    with _pc(llama, tmp_path) as pc:
        pc.generate(a, cache_prefix=S, **kw())
    blobs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "blobs") for f in fs]
    assert blobs
    for path in blobs:  # flip the last byte of every chunk file
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    with _pc(llama, tmp_path) as pc, caplog.at_level(logging.WARNING, logger="snapstore.engine.prefix_cache"):
        out = pc.generate(b, cache_prefix=S, **kw())
        st = pc.stats()
        assert st.restore_fallbacks == 1 and st.hits == 0 and st.restored_tokens == 0
        assert "reading the prompt from token 0" in caplog.text
        assert _same(out, reference(llama, b, cuts(b.shape[1], [S]), **kw()))  # the same split: the same bytes


def test_captures_over_budget_are_skipped_not_fatal(llama: Any, tmp_path: Any) -> None:
    b = prompts("llama")["b"]
    with hf.PrefixCache(llama, str(tmp_path), boundary=BOUNDARY,
                        budget=ss.Budget(disk_bytes=4096, reserve_bytes=0)) as pc:
        out = pc.generate(b, cache_prefix=S, **kw())
        st = pc.stats()
        assert st.skipped == len(cuts(b.shape[1], [S])) + 1 and st.captures == st.committed == 0
        assert _same(out, reference(llama, b, cuts(b.shape[1], [S]), **kw()))  # the call itself is unaffected
        assert pc.store.snapshots() == [] and st.store.stored_bytes == 0 and st.store.skipped


def test_closed_cache_refuses_calls(llama: Any, tmp_path: Any) -> None:
    pc = _pc(llama, tmp_path)
    with pc:
        pass
    pc.close()  # twice is fine
    with pytest.raises(ss.StateError):
        pc.generate(tokens("llama", "x", 4), max_new_tokens=1)


def test_readme_prefix_cache_example_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SNAPSTORE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("SNAPSTORE_RESERVE_MIB", "0")
    src = open(os.path.join(TESTS_DIR, "..", "README.md")).read()
    code = next(c for c in re.findall(r"```python\n(.*?)```", src, re.S) if "PrefixCache" in c)
    assert len(code.strip().splitlines()) <= 15
    ns: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    assert capsys.readouterr().out.split() == ["300", "True"]  # chat-2 restored the system prompt, same output
    assert ns["system"].shape[1] == 300 and torch.equal(ns["b"], ns["same"])
    assert os.path.isfile(tmp_path / "store" / "snapstore.db")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    _child_main(sys.argv[2:])


def test_the_cache_measures_its_prefill_rate_and_passes_it_to_match(llama: Any, tmp_path: Any) -> None:
    """Restore or recompute (issue 32): the first call's prompt read is timed; later matches carry the rate."""
    a, b = prompts("llama")["a1"], prompts("llama")["b"]
    with _pc(llama, tmp_path, measured=True) as pc:
        assert pc.prefill_rate.tokens_per_s is None
        seen: list[Any] = []
        match = pc.store.match

        def spy(*args: Any, **kwargs: Any) -> Any:  # records what the cache asks; the store answers
            seen.append(kwargs.get("prefill_tokens_per_s"))
            return match(*args, **kwargs)

        pc.store.match = spy  # type: ignore[method-assign]
        pc.generate(a, cache_prefix=S, **kw())
        assert seen and seen[0] is None  # nothing measured before the first read
        rate = pc.prefill_rate.tokens_per_s
        assert rate is not None and rate > 0
        out = pc.generate(b, cache_prefix=S, **kw())
        assert seen[-1] is not None and seen[-1] > 0
        assert _same(out, reference(llama, b, cuts(b.shape[1], [S]), **kw()))  # restored or read: the same bytes


def test_the_prefill_rate_times_the_forwards_only(llama: Any, tmp_path: Any) -> None:
    """A known trace (issue 47 item 9): every forward of the model takes at least F more (a hook on
    a layer, inside the forward), and the caller's streamer sleeps W when generate hands it the
    prompt (outside the forward, before the prompt's forward). The prompt is read in one forward (no
    cuts), so the prompt's seconds (n / rate) are F and the forward's compute, never W. W is scaled
    to this machine's load now: several times a warm-up call's whole time."""
    import time

    F = 0.05
    ids = tokens("llama", "rate", 40)
    hook = llama.model.layers[0].register_forward_hook(lambda *_: time.sleep(F))
    try:
        with _pc(llama, tmp_path, measured=True, boundary=0) as pc:
            t0 = time.perf_counter()
            pc.uncached_generate(ids, **kw())  # warm-up: a first forward's one-off costs are no rate either
            W = 2.0 + 3 * (time.perf_counter() - t0)  # the warm-up: six forwards, each F and compute

            class Sleepy:
                puts = 0

                def put(self, value: Any) -> None:
                    self.puts += 1
                    if self.puts == 1:  # the prompt
                        time.sleep(W)

                def end(self) -> None:
                    pass

            pc.generate(ids, streamer=Sleepy(), **kw())
            rate = pc.prefill_rate.tokens_per_s
    finally:
        hook.remove()
    assert rate is not None
    seconds = ids.shape[1] / rate
    assert F <= seconds < W / 2, (seconds, W)  # timing the call to the prompt's end: >= W + F


def test_a_read_only_cache_generates_and_saves_nothing(llama: Any, tmp_path: Any) -> None:
    """A cache baked into a read-only image (issue 47 item 12): a stored prompt restores, a prompt
    not stored is generated as without the store — nothing saved, each capture it does not take
    counted as skipped — instead of raising StateError."""
    stored, other = prompts("llama")["a1"], prompts("llama")["b"]
    with _pc(llama, tmp_path) as pc:
        pc.generate(stored, cache_prefix=S, **kw())
        before = pc.store.stats().snapshots
    with _pc(llama, tmp_path, read_only=True) as pc:
        assert pc.store.read_only
        out = pc.generate(other, cache_prefix=S, **kw())
        assert _same(out, reference(llama, other, cuts(other.shape[1], [S]), **kw()))
        again = pc.generate(stored, cache_prefix=S, **kw())
        assert _same(again, reference(llama, stored, cuts(stored.shape[1], [S]), **kw()))
        st = pc.stats()
        assert st.hits == 2 and st.restored_tokens > 0  # S is stored: both restore it
        # the new prompt's cuts past the restored S and its end; the stored prompt is whole in the store
        assert st.captures == 0 and st.committed == 0
        assert st.skipped == len([c for c in cuts(other.shape[1], [S]) if c > S]) + 1
        assert pc.store.stats().snapshots == before
