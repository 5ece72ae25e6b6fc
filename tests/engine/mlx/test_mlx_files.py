"""mlx_lm prompt-cache files <-> snapshots, and mlx_lm.server's prompt cache over a store, in one process.

A file as ``mlx_lm.cache_prompt`` writes it (generate_step with max_tokens=0 over a fresh prompt
cache, then save_prompt_cache) is imported, exported back as the deepest stored prefix of a longer
prompt, loaded with mlx_lm's load_prompt_cache, and generates exactly what the original file
generates: for llama, a KV cache quantized from token 0, gemma3's sliding window (rotated) and
falcon_h1's Mamba2 hybrid. Files for another model are refused by what differs. StorePromptCache:
what one instance inserted, a second one (a restarted server) restores, and generation from it
equals generation from the cache that was inserted (llama, falcon_h1, and a target with a draft).
The server over HTTP is tests/servers/test_mlx_server.py.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="needs the mlx extra (mlx[cpu], mlx-lm)")

import mlx.core as mx  # noqa: E402
import mlx_models  # noqa: E402
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402

import snapstore  # noqa: E402
from snapstore.cli.main import main  # noqa: E402
from snapstore.engine.mlx import (  # noqa: E402
    PromptCacheMismatchError,
    StorePromptCache,
    export_prompt_cache,
    import_prompt_cache,
)

G = importlib.import_module("mlx_lm.generate")
A, A2 = mlx_models.PROMPT_A, mlx_models.PROMPT_A2
KV8 = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
CASES = {"llama": ("llama", {}), "llama_kv8": ("llama", KV8), "gemma3": ("gemma3_text", {}),
         "falcon_h1": ("falcon_h1", {})}


def cache_file(model: Any, prompt: list[int], path: Path, name: str, **kw: Any) -> Path:
    """What mlx_lm.cache_prompt writes: the prompt read by generate_step (max_tokens=0), saved with its metadata."""
    cache = make_prompt_cache(model)
    for _ in G.generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache, **kw):
        pass
    save_prompt_cache(str(path), cache, {"model": name, "tokenizer_config": "{}"})
    return path


def continue_from(model: Any, cache: list[Any], rest: list[int], kw: dict[str, Any]) -> list[tuple[int, bytes]]:
    """Tokens and log-probability bytes of generating from ``cache`` after reading ``rest``."""
    out = G.generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=6, **kw)
    return [(int(t), np.array(lp.astype(mx.float32)).tobytes()) for t, lp in out]


@pytest.mark.parametrize("case", sorted(CASES))
def test_file_round_trip_generates_what_the_original_generates(case: str, tmp_path: Path) -> None:
    arch, kw = CASES[case]
    model = mlx_models.build(arch)
    f = cache_file(model, A, tmp_path / "a.safetensors", "tiny", **kw)
    store = tmp_path / "store"
    res = import_prompt_cache(f, model, store, tokens=A, model_name="tiny")
    assert res.save.snapshot_id is not None and res.n_tokens == len(A)
    again = import_prompt_cache(f, model, store, tokens=A, model_name="tiny")  # the same bytes: nothing new
    assert again.save.stored_bytes == 0
    out = tmp_path / "out.safetensors"
    ex = export_prompt_cache(out, model, store, tokens=A2, model_name="tiny",
                             kv_bits=kw.get("kv_bits"), kv_group_size=kw.get("kv_group_size", 64))
    assert (ex.n_tokens, ex.tokens_recorded) == (len(A), True)
    cache, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == "tiny" and json.loads(meta["snapstore_tokens"]) == A
    want = continue_from(model, load_prompt_cache(str(f)), A2[len(A):], kw)
    assert continue_from(model, cache, A2[len(A):], kw) == want
    # the exported file records its tokens: it imports without them (into another store), and verifies clean
    back = import_prompt_cache(out, model, tmp_path / "store2", model_name="tiny")
    assert back.n_tokens == len(A)
    assert main(["--dir", str(store), "--json", "verify", "--deep"]) == 0  # every chunk re-hashed: clean


def test_a_file_for_another_model_is_refused_by_what_differs(tmp_path: Path) -> None:
    llama = mlx_models.build("llama")
    f = cache_file(llama, A, tmp_path / "a.safetensors", "tiny-llama")
    with pytest.raises(PromptCacheMismatchError, match="holds 2 layer caches, the model makes 3"):
        import_prompt_cache(f, mlx_models.build("gemma3_text"), tmp_path / "s", tokens=A)
    with pytest.raises(PromptCacheMismatchError, match="layer 0 is a KVCache in the file, a CacheList for the model"):
        import_prompt_cache(f, mlx_models.build("falcon_h1"), tmp_path / "s", tokens=A)
    with pytest.raises(PromptCacheMismatchError, match="made for model 'tiny-llama', not 'other'"):
        import_prompt_cache(f, llama, tmp_path / "s", tokens=A, model_name="other")
    q = cache_file(llama, A, tmp_path / "q.safetensors", "tiny-llama", **KV8)
    bf16 = r"row stream 0\.k1 is float32 \(2, 1\) in the file, bfloat16 \(2, 1\) for the model"  # the scales
    with pytest.raises(PromptCacheMismatchError, match=bf16):
        import_prompt_cache(q, mlx_models.build("llama", dtype="bfloat16"), tmp_path / "s", tokens=A)
    with pytest.raises(snapstore.InvalidInputError, match="records no token ids"):
        import_prompt_cache(f, llama, tmp_path / "s")
    with pytest.raises(snapstore.InvalidInputError, match="holds the state of 37 tokens, but 36"):
        import_prompt_cache(f, llama, tmp_path / "s", tokens=A[:-1])
    # an exported file records the weights: the same config with other weights is refused
    import_prompt_cache(f, llama, tmp_path / "s", tokens=A)
    export_prompt_cache(tmp_path / "e.safetensors", llama, tmp_path / "s", tokens=A)
    with pytest.raises(PromptCacheMismatchError, match="other weights"):
        import_prompt_cache(tmp_path / "e.safetensors", mlx_models.build("llama", seed=1), tmp_path / "s")
    with pytest.raises(snapstore.NotFoundError, match="no prefix of these tokens"):
        export_prompt_cache(tmp_path / "x.safetensors", llama, tmp_path / "s", tokens=[200, 201])
    with pytest.raises(snapstore.InvalidInputError, match="not an mlx_lm prompt-cache file"):
        (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
        import_prompt_cache(tmp_path / "bad.safetensors", llama, tmp_path / "s", tokens=A)


def test_cli_import_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "model"
    model = mlx_models.write_model_dir("llama", d)
    f = cache_file(model, A, tmp_path / "a.safetensors", str(d))
    store = str(tmp_path / "store")
    assert main(["--dir", store, "--json", "import-mlx-cache", str(f), "--model", str(d),
                 "--tokens", ",".join(map(str, A))]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_tokens"] == len(A) and doc["snapshot_id"] >= 1
    (tmp_path / "ids.json").write_text(json.dumps(A2))
    out = tmp_path / "out.safetensors"
    assert main(["--dir", store, "export-mlx-cache", str(out), "--model", str(d), "--tokens",
                 f"@{tmp_path / 'ids.json'}"]) == 0
    assert f"snapshot {doc['snapshot_id']}, {len(A)} tokens" in capsys.readouterr().out
    assert continue_from(model, load_prompt_cache(str(out)), A2[len(A):], {}) == \
        continue_from(model, load_prompt_cache(str(f)), A2[len(A):], {})
    assert main(["--dir", store, "export-mlx-cache", str(tmp_path / "o2.safetensors"), "--model", str(d),
                 "--id", str(doc["snapshot_id"])]) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    mlx_models.write_model_dir("gemma3_text", other)
    assert main(["--dir", store, "import-mlx-cache", str(f), "--model", str(other), "--name", str(d),
                 "--tokens", ",".join(map(str, A))]) == 2
    assert "holds 2 layer caches, the model makes 3" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "falcon_h1"])
def test_store_prompt_cache_restores_what_another_instance_inserted(arch: str, tmp_path: Path) -> None:
    model = mlx_models.build(arch)
    key = ("model", None, None)

    def models(k: Any) -> Any:
        return (model, None) if k == key else None

    system = mlx_models.SYSTEM
    cache = make_prompt_cache(model)
    model(mx.array(system)[None], cache=cache)
    mx.eval([c.state for c in cache])
    first = StorePromptCache(4, path=tmp_path, models=models)
    first.insert_cache(key, list(system), cache, cache_type="system")
    first.insert_cache(key, [7, ("image", 1)], cache, cache_type="user")  # not token ids: memory only
    assert first.stats()["saved"] == 1 and first.stats()["not_persisted"] == 1
    first.close()

    second = StorePromptCache(4, path=tmp_path, models=models)  # a restarted server: memory is empty
    assert len(second) == 0
    got, rest = second.fetch_nearest_cache(key, list(A))
    assert got is not None and rest == A[len(system):]
    want = continue_from(model, cache, rest, {})
    assert continue_from(model, got, rest, {}) == want
    assert second.fetch_nearest_cache(("other", None, None), list(A)) == (None, list(A))  # not the loaded model
    got, rest = second.fetch_nearest_cache(key, list(system))  # at most all but the last token: not this one
    assert got is None and rest == list(system)
    st = second.stats()
    assert (st["store_hits"], st["restored_tokens"]) == (1, len(system))
    second.close()


def test_store_prompt_cache_with_a_draft_model_restores_both_caches(tmp_path: Path) -> None:
    """A speculative server's cache is the target's then the draft's: both are stored and restored, and
    speculative decoding from the restored cache equals decoding from the inserted one."""
    target, draft = mlx_models.draft_pair()
    key = ("model", None, "draft")

    def models(k: Any) -> Any:
        return (target, draft) if k == key else None

    system = mlx_models.SYSTEM
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    n = len(make_prompt_cache(target))
    target(mx.array(system)[None], cache=cache[:n])
    draft(mx.array(system)[None], cache=cache[n:])
    mx.eval([c.state for c in cache])
    first = StorePromptCache(4, path=tmp_path, models=models)
    first.insert_cache(key, list(system), cache, cache_type="system")
    first.close()
    second = StorePromptCache(4, path=tmp_path, models=models)
    got, rest = second.fetch_nearest_cache(key, list(A))
    second.close()
    assert got is not None and len(got) == len(cache) and rest == A[len(system):]
    assert all(c.offset == len(system) for c in got)

    def spec(c: list[Any]) -> list[tuple[int, bool, bytes]]:
        out = G.speculative_generate_step(mx.array(rest), target, draft, prompt_cache=c, max_tokens=6,
                                          num_draft_tokens=3)
        return [(int(t), bool(d), np.array(lp).tobytes()) for t, lp, d in out]

    assert spec(got) == spec(cache)


@pytest.mark.parametrize("max_tokens", [4, 5])  # the draft's cache lags the key; the target's too (4)
def test_a_speculative_servers_reply_is_stored_as_the_prefix_both_caches_hold(max_tokens: int,
                                                                                tmp_path: Path) -> None:
    """After speculative decoding (issue 47 item 6) mlx_lm.server inserts the reply's cache under
    prompt + reply, and the target's or the draft's cache holds one token fewer: the prefix both
    hold is stored (it was refused: "kept in memory only"), and a restarted server's next turn
    restores it into both caches."""
    target, draft = mlx_models.draft_pair()
    key = ("model", None, "draft")

    def models(k: Any) -> Any:
        return (target, draft) if k == key else None

    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    n = len(make_prompt_cache(target))
    cache_key = list(A)
    for t, _lp, _d in G.speculative_generate_step(mx.array(A), target, draft, prompt_cache=cache,
                                                   max_tokens=max_tokens, num_draft_tokens=3):
        cache_key.append(int(t))  # as mlx_lm.server does with each token it streams
    held = min(cache[0].offset, cache[n].offset)
    assert held < len(cache_key)  # one of the caches lags the key
    first = StorePromptCache(4, path=tmp_path, models=models)
    first.insert_cache(key, cache_key, cache, cache_type="assistant")
    assert first.stats()["saved"] == 1 and first.stats()["not_persisted"] == 0, first.stats()
    first.close()
    turn2 = cache_key + [60, 61, 62]
    second = StorePromptCache(4, path=tmp_path, models=models)
    got, rest = second.fetch_nearest_cache(key, turn2)
    second.close()
    assert got is not None and rest == turn2[held:] and all(c.offset == held for c in got)
    want = [np.array(x) for c in cache for x in (c.keys[..., :held, :], c.values[..., :held, :])]
    assert all(np.array_equal(np.array(a), b) for a, b in
               zip([x for c in got for x in (c.keys[..., :held, :], c.values[..., :held, :])], want))


def test_mlx_server_passes_mlx_lm_server_arguments_through_in_order() -> None:
    from snapstore.cli.parser import ArgumentsError, parse_command_line

    args = parse_command_line(["--dir", "/s", "mlx-server", "--model", "m", "--disk-mib", "5", "--port", "8080",
                               "--prompt-cache-size", "3"])
    assert (args.command, args.dir, args.disk_mib) == ("mlx-server", "/s", 5)
    assert args.passthrough == ["--model", "m", "--port", "8080", "--prompt-cache-size", "3"]
    with pytest.raises(ArgumentsError, match="unrecognized arguments: --model m"):  # only mlx-server passes through
        parse_command_line(["stats", "--model", "m"])


def test_export_mlx_cache_keeps_the_override_mark_and_the_store_safe(tmp_path: Path) -> None:
    """Issue 46 items 1 and 10 through export-mlx-cache: a snapshot imported under an identity override
    (state another model's weights computed) is not written as a plain prompt-cache file — imported
    again it would pass as this model's own state — unless accept_identity names who computed it (then
    exact=False); and the file never lands on a store's own files."""
    ours, theirs = mlx_models.build("llama"), mlx_models.build("llama", seed=1)
    store = tmp_path / "s"
    import_prompt_cache(cache_file(ours, A, tmp_path / "a.safetensors", "tiny"), ours, store, tokens=A,
                        model_name="tiny")
    other = import_prompt_cache(cache_file(theirs, A, tmp_path / "b.safetensors", "tiny"), theirs, store, tokens=A,
                                model_name="tiny")
    assert main(["--dir", str(store), "export", "--id", str(other.save.snapshot_id), str(tmp_path / "b.snapx")]) == 0
    ident = {i["id"]: i["identity"] for i in _all_snapshots(store)}
    our_key, their_key = ident[1], ident[other.save.snapshot_id]
    assert our_key != their_key
    assert main(["--dir", str(store), "import", str(tmp_path / "b.snapx"), "--identity", our_key,
                 "--accept-identity", their_key]) == 0
    marked = next(i["id"] for i in _all_snapshots(store) if i.get("imported_from") == their_key)
    out = tmp_path / "out.safetensors"
    with pytest.raises(snapstore.IdentityError, match="cannot carry that mark"):
        export_prompt_cache(out, ours, store, snapshot_id=marked)
    assert not out.exists()
    ex = export_prompt_cache(out, ours, store, snapshot_id=marked, accept_identity=their_key)
    assert ex.exact is False and out.exists()
    assert export_prompt_cache(out, ours, store, tokens=A).exact is True  # the model's own state, replacing the file
    db = store / "snapstore.db"
    before = db.read_bytes()
    with pytest.raises(snapstore.ConfigError, match="inside the snapstore store"):
        export_prompt_cache(db, ours, store, tokens=A)
    with pytest.raises(snapstore.ConfigError, match="a file is there already"):
        export_prompt_cache(out, ours, store, tokens=A, overwrite=False)
    assert db.read_bytes() == before
    assert main(["--dir", str(store), "--json", "verify", "--deep"]) == 0


def _all_snapshots(store: Path) -> list[dict[str, Any]]:
    """Every snapshot in ``store``, of every identity, as ``snapstore inspect --json`` lists them."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--dir", str(store), "--json", "inspect"]) == 0
    snaps: list[dict[str, Any]] = json.loads(buf.getvalue())["snapshots"]
    return snaps
