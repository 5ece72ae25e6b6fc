"""The vLLM connector's block plumbing without vLLM (issue 17): per-layer paged caches as torch
tensors, whole blocks of every layer as one row, saved from scattered blocks and restored into
other blocks bit-exact — also through chunk edges that cut a block — and a cache that is not
what the identity says refused before anything is read or written."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import snapstore as ss
from snapstore.engine._vllm_blocks import BlockGeometry, BlockWriter, gather_blocks, host_pools, weights_hash

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
