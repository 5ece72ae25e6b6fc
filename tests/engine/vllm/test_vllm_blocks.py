"""The vLLM connector's block plumbing without vLLM (issue 17): per-layer paged caches as torch
tensors, whole blocks of every layer as one row, saved from scattered blocks and restored into
other blocks bit-exact — also through chunk edges that cut a block — and a cache that is not
what the identity says refused before anything is read or written. Issue 24: every input vLLM's
prefix cache keys a request by, and every deployment setting that changes the numbers, changes
the key (a stored prompt is no longer offered), or the request is declined."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import snapstore as ss
from snapstore.engine.vllm._blocks import BlockGeometry, BlockWriter, gather_blocks, host_pools, weights_hash
from snapstore.engine.vllm._key import MM_TOKEN_BASE, config_digest, request_key

GEO = BlockGeometry(layers=3, kv_heads=2, block_size=32, entry=64, dtype=torch.bfloat16)


def _caches(seed: int, n_blocks: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((n_blocks, *GEO.block_shape), generator=g).to(torch.bfloat16) for _ in range(GEO.layers)]


def test_blocks_round_trip_between_block_tables_through_cut_chunks(tmp_path: Any) -> None:
    """Save 9 scattered blocks of 3 layers as 9 rows; restore the first 5 (a block-granular prefix)
    into 5 other blocks of fresh caches: every byte equal, nothing else written."""
    src = _caches(1)
    ids = [31, 2, 17, 9, 38, 4, 22, 13, 0]
    ident = GEO.identity(build="vllm-test", pack="sha256:00", kv="bfloat16", backend="CPU_ATTN:vec", tp=(0, 1))
    # 12 KiB chunks: chunk edges fall inside a layer's 8 KiB block
    with ss.Store.open(str(tmp_path / "s"), identity=ident, layout=GEO.layout(), chunk_bytes=12288,
                       staging_bytes=65536, budget=ss.Budget(reserve_bytes=0)) as st:
        tokens = list(range(1000, 1000 + 9 * 32))
        res = st.save(tokens, {"kv": gather_blocks(host_pools(src, GEO), ids)}, rows=9)
        assert res.ok
        m = st.match(tokens[:5 * 32] + [7] * 40)
        assert m is not None and m.n_tokens == 160
        dst = [torch.zeros_like(t) for t in src]
        dst_ids = [5, 6, 30, 1, 12]
        st.restore(m, into={"kv": BlockWriter(host_pools(dst, GEO), dst_ids)})
    for layer in range(GEO.layers):
        for k, (a, b) in enumerate(zip(ids[:5], dst_ids)):
            assert torch.equal(dst[layer][b].view(torch.int16), src[layer][a].view(torch.int16)), (layer, k)
        untouched = [b for b in range(40) if b not in dst_ids]
        assert not dst[layer][untouched].view(torch.int16).any()


def test_block_writer_views_are_the_blocks_themselves() -> None:
    """Issue 31: views() lends the cache blocks for any byte range (a restore reads chunks straight
    into them): bytes written through the views land exactly where write_from puts them."""
    rng = np.random.default_rng(31)
    for _ in range(20):
        ids = [int(b) for b in rng.permutation(8)[:int(rng.integers(1, 6))]]
        via_views = [torch.zeros((8, *GEO.block_shape), dtype=torch.bfloat16) for _ in range(GEO.layers)]
        via_write = [torch.zeros_like(t) for t in via_views]
        wv, ww = BlockWriter(host_pools(via_views, GEO), ids), BlockWriter(host_pools(via_write, GEO), ids)
        a, b = sorted(int(x) for x in rng.integers(0, wv.nbytes + 1, 2))
        data = rng.integers(0, 256, b - a, dtype=np.uint8)
        views = wv.views(a, b - a)
        assert views is not None and sum(len(v) for v in views) == b - a
        pos = 0
        for v in views:
            v[:] = data[pos:pos + len(v)].tobytes()
            pos += len(v)
        ww.write_from(a, memoryview(data))
        for x, y in zip(via_views, via_write):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    with pytest.raises(ss.InvalidInputError):
        wv.views(0, wv.nbytes + 1)


def test_block_writer_any_byte_range() -> None:
    """write_from at offsets that start and end inside a layer's block lands each byte in place."""
    dst = [torch.zeros((8, *GEO.block_shape), dtype=torch.bfloat16) for _ in range(GEO.layers)]
    w = BlockWriter(host_pools(dst, GEO), [3, 0, 6])
    rng = np.random.default_rng(4)
    canon = rng.integers(0, 256, w.nbytes, dtype=np.uint8)
    cuts = sorted({0, w.nbytes, *map(int, rng.integers(0, w.nbytes, 25))})
    for a, b in zip(cuts, cuts[1:]):
        w.write_from(a, memoryview(canon[a:b]))
    back = gather_blocks(host_pools(dst, GEO), [3, 0, 6])
    assert np.array_equal(back.reshape(-1), canon)
    with pytest.raises(ss.InvalidInputError):
        w.write_from(w.nbytes - 2, memoryview(canon[:4]))


def test_cache_that_does_not_match_the_identity_is_refused() -> None:
    """Another head layout, dtype or a non-contiguous view: LayoutError (the connector disables)."""
    with pytest.raises(ss.LayoutError, match="expects"):
        host_pools([torch.zeros((4, 2, 32, 32), dtype=torch.bfloat16)], GEO)
    with pytest.raises(ss.LayoutError, match="expects"):
        host_pools([torch.zeros((4, *GEO.block_shape), dtype=torch.float16)], GEO)
    wide = torch.zeros((4, 2, 32, 128), dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ss.LayoutError, match="non-contiguous"):
        host_pools([wide], GEO)


def test_identity_names_everything_that_changes_block_bytes(tmp_path: Any) -> None:
    """Kernel variant, TP rank, dtype and weights each give another identity; the weights hash
    follows the files' bytes."""
    base = dict(build="vllm-0.32.0", pack="sha256:aa", kv="bfloat16", backend="CPU_ATTN:vec", tp=(0, 1))
    keys = {GEO.identity(**base).key}  # type: ignore[arg-type]
    for change in ({"backend": "CPU_ATTN:amx"}, {"tp": (1, 2)}, {"kv": "float32"}, {"pack": "sha256:bb"}):
        keys.add(GEO.identity(**{**base, **change}).key)  # type: ignore[arg-type]
    assert len(keys) == 5
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights-1")
    h1 = weights_hash(str(d))
    (d / "model.safetensors").write_bytes(b"weights-2, retrained")
    assert weights_hash(str(d)) != h1
    with pytest.raises(ss.ConfigError, match="weights_hash"):
        weights_hash(str(tmp_path / "nothing-here"))


# -- issue 24: what keys a request and a deployment (engine/_vllm_key.py; vLLM's call order) ------

BS = GEO.block_size


def _req(ids: list[int], **kw: Any) -> SimpleNamespace:
    """A stand-in for vLLM's ``Request``: the fields its prefix cache keys blocks by."""
    fields = {"prompt_token_ids": ids, "prompt_embeds": None, "mm_features": None, "lora_request": None,
              "cache_salt": None, **kw}
    return SimpleNamespace(**fields)


def _lora(name: str, path: Any) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def _image(ident: str | None, offset: int, length: int = 40) -> SimpleNamespace:
    pos = SimpleNamespace(offset=offset, length=length)
    return SimpleNamespace(identifier=ident, modality="image", mm_position=pos)


def test_every_request_input_vllm_keys_enters_the_match(tmp_path: Any) -> None:
    """The docs/engine.md table, request rows: a stored prompt is offered whole to the same
    request, and to a request that differs in one input only up to where that input starts to
    change the K/V — nothing for another LoRA adapter (name, or the same name and path with
    retrained bytes) or another cache_salt; the blocks before an image that is another image, or
    the same image elsewhere."""
    ids = [4 + (i * 7) % 500 for i in range(300)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"adapter a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "adapter_model.safetensors").write_bytes(b"adapter b")
    base = {"lora_request": _lora("a", tmp_path / "a"), "cache_salt": "t1", "mm_features": [_image("x", 100)]}
    stored = request_key(_req(ids, **base))
    assert stored.declined is None and stored.namespace is not None
    assert all(t >= MM_TOKEN_BASE for t in stored.tokens[100:140]) and max(stored.tokens) < 2**63
    ident = GEO.identity(build="vllm-test", pack="sha256:00", kv="bfloat16", backend="CPU_ATTN:vec", tp=(0, 1))
    with ss.Store.open(str(tmp_path / "s"), identity=ident, layout=GEO.layout(),
                       budget=ss.Budget(reserve_bytes=0)) as st:
        n = len(ids) // BS * BS
        rows = gather_blocks(host_pools(_caches(2), GEO), list(range(n // BS)))
        assert st.save(stored.tokens[:n], {"kv": rows}, rows=n // BS, namespace=stored.namespace).ok

        def offered(**change: Any) -> int:
            k = request_key(_req(ids, **{**base, **change}))
            assert k.declined is None
            m = st.match(k.tokens, namespace=k.namespace)
            return 0 if m is None else m.n_tokens

        assert offered() == n
        assert offered(lora_request=_lora("b", tmp_path / "b")) == 0
        assert offered(lora_request=_lora("a2", tmp_path / "a")) == 0  # vLLM keys the name too
        assert offered(lora_request=None) == 0  # the base model
        assert offered(cache_salt="t2") == 0 and offered(cache_salt=None) == 0
        assert offered(mm_features=[_image("y", 100)]) == 96  # the blocks before the image
        assert offered(mm_features=[_image("x", 132)]) == 96
        assert offered(mm_features=None) == 96  # the placeholder tokens without the image
        assert offered(mm_features=[_image("x", 100), _image("z", 250)]) == 224
        (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"adapter a, retrained one more step")
        assert offered() == 0  # same name and path, other bytes: the adapter as it is now


def test_requests_the_key_cannot_cover_are_declined(tmp_path: Any) -> None:
    """Prompt embeddings, a multimodal item without a hash and a LoRA adapter that is not a local
    directory are declined (the connector neither loads nor saves them), with the reason."""
    ids = list(range(4, 100))
    assert request_key(_req(ids)).declined is None and request_key(_req(ids)).namespace is None
    assert request_key(_req(ids, prompt_embeds=object())).declined == "prompt embeddings"
    assert request_key(_req(None)).declined == "no prompt token ids"
    assert "multimodal item without a hash" in str(request_key(_req(ids, mm_features=[_image(None, 3)])).declined)
    remote = request_key(_req(ids, lora_request=_lora("r", "some-org/some-adapter"))).declined
    assert remote is not None and "not a local directory" in remote


class _HfConfig:
    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


def _deployment(**change: Any) -> SimpleNamespace:
    """A stand-in for vLLM's ``VllmConfig``: the fields config_digest reads; ``change`` as
    ``section.field=value`` (sections: hf, model, cache, lora, parallel, compile)."""
    hf = {"_name_or_path": "/models/a", "transformers_version": "4.57", "rope_theta": 10000.0,
          "rope_scaling": None, "sliding_window": None, "num_hidden_layers": 2}
    sections: dict[str, dict[str, Any]] = {
        "model": {"dtype": "torch.bfloat16", "quantization": None, "max_model_len": 4096,
                  "disable_sliding_window": False, "model_impl": "auto", "enforce_eager": False},
        "cache": {"cache_dtype": "auto", "calculate_kv_scales": False},
        "lora": {"max_lora_rank": 16, "lora_dtype": "auto"}, "parallel": {"pipeline_parallel_size": 1},
        "compile": {"mode": 3}}
    for k, v in change.items():
        sec, name = k.split("__")
        (hf if sec == "hf" else sections[sec])[name] = v
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=_HfConfig(**hf), **sections["model"]),
                           cache_config=SimpleNamespace(**sections["cache"]),
                           lora_config=SimpleNamespace(**sections["lora"]),
                           parallel_config=SimpleNamespace(**sections["parallel"]),
                           compilation_config=SimpleNamespace(**sections["compile"]))


def test_config_digest_follows_every_setting_that_changes_the_numbers() -> None:
    """The docs/engine.md table, deployment rows: each setting gives another identity; where the
    model lives and which transformers wrote its config.json do not."""
    base = config_digest(_deployment())
    assert base.startswith("sha256:") and config_digest(_deployment()) == base
    assert config_digest(_deployment(hf___name_or_path="/elsewhere", hf__transformers_version="4.58")) == base
    changes = [{"hf__rope_theta": 500000.0}, {"hf__rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
               {"hf__sliding_window": 4096}, {"hf__num_hidden_layers": 3}, {"model__dtype": "torch.float16"},
               {"model__quantization": "fp8"}, {"model__max_model_len": 8192},
               {"model__disable_sliding_window": True}, {"model__model_impl": "transformers"},
               {"model__enforce_eager": True}, {"cache__cache_dtype": "fp8"}, {"cache__calculate_kv_scales": True},
               {"lora__lora_dtype": "float32"}, {"lora__max_lora_rank": 64},
               {"parallel__pipeline_parallel_size": 2}, {"compile__mode": 0}]
    digests = {config_digest(_deployment(**c)) for c in changes}
    assert len(digests) == len(changes) and base not in digests
