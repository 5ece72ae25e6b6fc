"""Hybrid (multi-group) vLLM caches as snapstore parts, without vLLM (issue 28): the group layouts
vLLM builds for Mamba2-style models (one Mamba group; Mamba + attention, as GraniteMoeHybrid) and
for Qwen3-Next, what is refused and why, the alignment of a hit, what enters the identity, and the
page copies on tensors laid out as vLLM's hybrid allocator lays them out (padded pages over one
shared buffer). The specs are stand-ins with vLLM's class names and fields (the module reads
nothing else); tests/engine/vllm/test_vllm_hybrid.py runs the real thing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import snapstore as ss
from snapstore.engine.vllm._groups import describe_groups, hybrid_layout, state_block_index
from snapstore.engine.vllm._hybrid import PageWriter, gather_pages, group_views, page_views


@dataclass(frozen=True)
class FullAttentionSpec:  # vllm.v1.kv_cache_interface.FullAttentionSpec's fields the connector reads
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def page_size_bytes(self) -> int:
        return int(2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 64
    extra_retained_tokens: int = 0


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    attention_chunk_size: int = 64


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    @property
    def page_size_bytes(self) -> int:
        real = sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))
        return self.page_size_padded or real


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any
    is_eagle_group: bool = False


@dataclass
class Config:
    kv_cache_groups: list[Group] = field(default_factory=list)


BS = 544
# vLLM's Mamba2 state per layer: conv (d_conv - 1, conv_dim) and SSM (heads, head_dim, d_state)
MAMBA2 = MambaSpec(BS, ((3, 1024 + 2 * 128), (16, 64, 128)), (torch.bfloat16, torch.float32))
# Qwen3-Next's gated delta net, as vLLM builds it for the tiny test model (tests/vllm_driver.py)
GDN = MambaSpec(BS, ((3, 512), (2, 128, 128)), (torch.bfloat16, torch.float32), mamba_type="gdn_attn")
ATTN = FullAttentionSpec(BS, 1, 64, torch.bfloat16)


def mamba2_config(layers: int = 4) -> Config:
    """Mamba2ForCausalLM: every layer Mamba, one group."""
    return Config([Group([f"backbone.layers.{i}.mixer" for i in range(layers)], MAMBA2)])


def granite_hybrid_config() -> Config:
    """GraniteMoeHybrid-style: Mamba layers and attention layers, one group each, one block size."""
    return Config([Group([f"model.layers.{i}.mamba" for i in (0, 1, 3)], MAMBA2),
                   Group(["model.layers.2.self_attn"], ATTN)])


def qwen3_next_config() -> Config:
    """Qwen3-Next as vLLM groups the tiny model: three one-layer GDN groups, one attention group."""
    return Config([Group([f"model.layers.{i}.linear_attn"], GDN) for i in range(3)] +
                  [Group(["model.layers.3.self_attn"], ATTN)])


def state_bytes(spec: MambaSpec) -> int:
    return sum(math.prod(s) * d.itemsize for s, d in zip(spec.shapes, spec.dtypes))


def test_mamba2_stores_the_state_alone_at_exact_boundaries() -> None:
    """A model without attention: one fixed part (every layer's state page), no row stream."""
    hy = hybrid_layout(mamba2_config())
    assert [(p.name, p.kind, len(p.layers), p.unit_bytes) for p in hy.parts] == \
        [("g0.state", "state", 4, state_bytes(MAMBA2))]
    lay = hy.layout()
    assert lay.rows == {} and lay.fixed["g0.state"] == ss.Fixed("uint8", (4, state_bytes(MAMBA2)))
    assert hy.block_size == hy.alignment == BS and hy.main == 0 and hy.rows(1088) == {}


def test_granite_style_hybrid_has_a_row_stream_and_a_state_part() -> None:
    hy = hybrid_layout(granite_hybrid_config())
    assert [(p.name, p.kind, p.draft) for p in hy.parts] == [("g0.state", "state", False), ("g1.kv", "attn", False)]
    assert hy.parts[1].unit_bytes == ATTN.page_size_bytes and hy.main == 1
    assert hy.rows(3 * BS) == {"g1.kv": 3}
    lay = hy.layout()
    assert lay.rows["g1.kv"] == ss.Rows("uint8", (1, ATTN.page_size_bytes)) and lay.tokens_per_row is None


def test_qwen3_next_groups() -> None:
    hy = hybrid_layout(qwen3_next_config())
    assert [p.name for p in hy.parts] == ["g0.state", "g1.state", "g2.state", "g3.kv"]
    assert hy.parts[0].unit_bytes == 3 * 512 * 2 + 2 * 128 * 128 * 4


@given(st.integers(0, 20 * BS))
def test_a_hit_is_rounded_down_to_the_alignment(n: int) -> None:
    hy = hybrid_layout(qwen3_next_config())
    b = hy.boundary(n)
    assert b % BS == 0 and b <= n < b + BS
    if b:
        assert state_block_index(b, BS) == b // BS - 1


def test_prefill_checkpoint_alignment_coarsens_the_boundaries() -> None:
    cfg = Config([Group(["m"], replace(MAMBA2, prefill_checkpoint_alignment=2 * BS)), Group(["a"], ATTN)])
    hy = hybrid_layout(cfg)
    assert hy.alignment == 2 * BS and hy.boundary(3 * BS + 5) == 2 * BS


def test_state_block_index_needs_an_aligned_boundary() -> None:
    assert state_block_index(3 * BS, BS) == 2
    for bad in (0, BS + 1, -BS):
        with pytest.raises(ss.InvalidInputError):
            state_block_index(bad, BS)


@pytest.mark.parametrize(("cfg", "words"), [
    (Config([Group(["m"], replace(MAMBA2, mamba_cache_mode="none")), Group(["a"], ATTN)]),
     ["KV cache group 0", "'none' cache mode", "enable_prefix_caching"]),
    (Config([Group(["m"], replace(MAMBA2, mamba_cache_mode="all")), Group(["a"], ATTN)]),
     ["KV cache group 0", "'all' cache mode"]),
    (Config([Group(["m"], replace(MAMBA2, num_speculative_blocks=1)), Group(["a"], ATTN)]),
     ["KV cache group 0", "speculative state block"]),
    (Config([Group(["a"], ATTN), Group(["c"], ChunkedLocalAttentionSpec(BS, 1, 64, torch.bfloat16))]),
     ["KV cache group 1", "ChunkedLocalAttentionSpec"]),
    (Config([Group(["m"], MAMBA2), Group(["a"], replace(ATTN, block_size=32))]), ["block sizes [32, 544]"]),
    (Config([Group(["a"], replace(ATTN, head_size_v=32))]), ["value heads"]),
    (Config([]), ["no KV cache groups"]),
])
def test_what_cannot_be_saved_exactly_is_refused_by_name(cfg: Config, words: list[str]) -> None:
    with pytest.raises(ss.LayoutError) as e:
        hybrid_layout(cfg)
    for w in words:
        assert w in str(e.value)


def test_sliding_groups_store_the_window_below_each_boundary() -> None:
    """Issue 50: a sliding-window group is a fixed part ``g<i>.win`` of the blocks a hit at a
    boundary needs — vLLM skips tokens before ``H - window + 1`` for the token after ``H``, so
    ``ceil((window - 1) / block)`` blocks below it — and a snapshot is never shorter than that."""
    swa = SlidingWindowSpec(32, 2, 32, torch.float32, sliding_window=64)
    full = FullAttentionSpec(32, 2, 32, torch.float32)
    gemma = hybrid_layout(Config([Group(["l0", "l2"], swa), Group(["l1", "l3"], full)]))
    assert [(p.name, p.kind, p.window_blocks) for p in gemma.parts] == [("g0.win", "window", 2), ("g1.kv", "attn", 0)]
    assert gemma.main == 1 and not gemma.has_state and gemma.min_boundary == 64
    lay = gemma.layout()
    assert lay.fixed["g0.win"] == ss.Fixed("uint8", (2, 2, swa.page_size_bytes)) and gemma.rows(576) == {"g1.kv": 18}
    ids = list(range(100, 119))  # a request's 19 blocks in one group
    assert gemma.parts[0].blocks_at(ids, 576, 32) == [116, 117]  # tokens 512..575: the window of token 576
    assert gemma.parts[1].blocks_at(ids, 576, 32) == ids[:18]
    with pytest.raises(IndexError):
        gemma.parts[0].blocks_at(ids, 32, 32)  # below the window: no such snapshot
    mistral = hybrid_layout(Config([Group(["l0", "l1"], swa)]))
    assert [p.name for p in mistral.parts] == ["g0.win"] and mistral.main == 0 and mistral.layout().rows == {}
    odd = hybrid_layout(Config([Group(["l0"], replace(swa, sliding_window=65, extra_retained_tokens=1))]))
    assert odd.parts[0].window_blocks == 3  # 65 tokens kept below the next one: 3 blocks of 32


def test_a_window_writer_drops_the_blocks_vllm_already_holds() -> None:
    """A negative block id (a window block inside vLLM's own prefix-cache hit) is never written."""
    pool = np.zeros((4, 8), dtype=np.uint8)
    w = PageWriter([pool], [2, -1])
    w.write_from(0, memoryview(bytes(range(1, 17))))
    assert pool[2].tolist() == list(range(1, 9)) and not pool[[0, 1, 3]].any()


def test_mla_is_refused() -> None:
    with pytest.raises(ss.LayoutError, match="MLA"):
        hybrid_layout(granite_hybrid_config(), use_mla=True)


def test_a_draft_group_is_the_draft_component() -> None:
    """An EAGLE / MTP attention group is saved and restored with the target, as ``draft``."""
    cfg = granite_hybrid_config()
    cfg.kv_cache_groups.append(Group(["mtp.layers.0.self_attn"], ATTN, is_eagle_group=True))
    hy = hybrid_layout(cfg)
    assert hy.parts[2].name == "g2.kv" and hy.parts[2].draft and hy.main == 1
    lay = hy.layout()
    assert lay.components == frozenset({"draft"}) and lay.rows["g2.kv"].component == "draft"


def test_identity_covers_the_group_layout() -> None:
    """Every field that changes a page's bytes changes ``describe_groups`` (the identity's
    ``kv_groups``): spec kind, block size, dtypes, shapes, page padding, layer count, draft."""
    base = describe_groups(granite_hybrid_config())
    assert base == describe_groups(granite_hybrid_config())
    variants = [
        Config([Group(["m0", "m1", "m3"], replace(MAMBA2, dtypes=(torch.bfloat16, torch.bfloat16))),
                Group(["a"], ATTN)]),
        Config([Group(["m0", "m1", "m3"], replace(MAMBA2, shapes=((3, 1280), (16, 64, 64)))), Group(["a"], ATTN)]),
        Config([Group(["m0", "m1", "m3"], replace(MAMBA2, page_size_padded=state_bytes(MAMBA2) + 4096)),
                Group(["a"], ATTN)]),
        Config([Group(["m0", "m1", "m3"], replace(MAMBA2, block_size=1088)),
                Group(["a"], replace(ATTN, block_size=1088))]),
        Config([Group(["m0", "m1", "m3"], MAMBA2), Group(["a"], replace(ATTN, dtype=torch.float16))]),
        Config([Group(["m0", "m1", "m3"], MAMBA2), Group(["a"], replace(ATTN, num_kv_heads=2))]),
        Config([Group(["m0", "m1"], MAMBA2), Group(["a"], ATTN)]),
        Config([Group(["m0", "m1", "m3"], MAMBA2), Group(["a"], ATTN, is_eagle_group=True)]),
        Config([Group(["m0", "m1", "m3"], replace(MAMBA2, mamba_type="gdn_attn")), Group(["a"], ATTN)]),
    ]
    seen = {base}
    for v in variants:
        d = describe_groups(v)
        assert d not in seen
        seen.add(d)


def _vllm_like_buffers(num_blocks: int, spec: MambaSpec, attn: FullAttentionSpec) -> tuple[Any, Any]:
    """As vLLM's hybrid allocator: one raw buffer per layer pair, pages of the larger size, the
    Mamba state tensors as strided views over it (conv then SSM in each page), the attention
    layer's ``[blocks, heads, block_size, 2 * head]`` over another."""
    page = max(spec.page_size_bytes, attn.page_size_bytes)
    raw_m = torch.zeros(num_blocks * page, dtype=torch.uint8)
    conv_shape, ssm_shape = spec.shapes
    conv = torch.as_strided(raw_m.view(spec.dtypes[0]), (num_blocks, *conv_shape),
                            (page // 2, conv_shape[1], 1))
    ssm_off = math.prod(conv_shape) * 2
    ssm = torch.as_strided(raw_m.view(torch.float32), (num_blocks, *ssm_shape),
                           (page // 4, ssm_shape[1] * ssm_shape[2], ssm_shape[2], 1), ssm_off // 4)
    raw_a = torch.zeros(num_blocks * page, dtype=torch.uint8)
    kv = torch.as_strided(raw_a.view(torch.bfloat16), (num_blocks, attn.num_kv_heads, attn.block_size,
                                                      2 * attn.head_size),
                          (page // 2, attn.block_size * 2 * attn.head_size, 2 * attn.head_size, 1))
    g = torch.Generator().manual_seed(3)
    conv.copy_(torch.randn(conv.shape, generator=g).to(conv.dtype))
    ssm.copy_(torch.randn(ssm.shape, generator=g))
    kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))
    return [conv, ssm], kv


SMALL_M = MambaSpec(16, ((3, 40), (2, 8, 16)), (torch.bfloat16, torch.float32), page_size_padded=2048)
SMALL_A = FullAttentionSpec(16, 2, 16, torch.bfloat16)


def test_page_views_share_memory_and_skip_padding() -> None:
    mamba, kv = _vllm_like_buffers(6, SMALL_M, SMALL_A)
    views = [page_views(t) for t in mamba]
    assert [v.shape for v in views] == [(6, 3 * 40 * 2), (6, 2 * 8 * 16 * 4)]
    assert views[1][4].tobytes() == mamba[1][4].contiguous().numpy().tobytes()
    views[0][2, :] = 7  # a write lands in the tensor
    assert (mamba[0][2].contiguous().view(torch.uint8) == 7).all()
    assert page_views(kv).shape == (6, SMALL_A.page_size_bytes)
    with pytest.raises(ss.LayoutError):
        page_views(mamba[1][:, :, :4])  # a block that is not one dense byte range


def test_group_views_check_the_spec() -> None:
    mamba, kv = _vllm_like_buffers(4, SMALL_M, SMALL_A)
    hy = hybrid_layout(Config([Group(["m"], SMALL_M), Group(["a"], SMALL_A)]))
    views = group_views(hy.parts[0], {"m": mamba, "a": kv})
    assert sum(v.shape[1] for v in views) == hy.parts[0].unit_bytes
    with pytest.raises(ss.LayoutError, match="holds"):
        group_views(hy.parts[0], {"m": mamba[:1], "a": kv})
    with pytest.raises(ss.LayoutError, match="no cache tensor"):
        group_views(hy.parts[1], {"m": mamba})


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_page_writer_restores_what_gather_copied(data: st.DataObject) -> None:
    """Property: the canonical bytes of any blocks, written back in arbitrary ranges (as the
    store's chunks cut them, through a row or a layer's state), land exactly where they came from."""
    mamba, kv = _vllm_like_buffers(8, SMALL_M, SMALL_A)
    views = [page_views(t) for t in mamba]
    src = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True))
    dst = data.draw(st.permutations([b for b in range(8) if b not in src]).map(lambda p: p[:len(src)]))
    pages = gather_pages(views, src, 1)
    before = gather_pages(views, [b for b in range(8) if b not in dst], 1).copy()
    flat = pages.reshape(-1).tobytes()
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(flat) - 1), max_size=6))))
    w = PageWriter(views, dst)
    assert w.nbytes == len(flat)
    for a, b in zip([0, *cuts], [*cuts, len(flat)]):
        w.write_from(a, memoryview(flat[a:b]))
    assert np.array_equal(gather_pages(views, dst, 1), pages)
    assert np.array_equal(gather_pages(views, [b for b in range(8) if b not in dst], 1), before)
    with pytest.raises(ss.InvalidInputError):
        w.write_from(len(flat) - 1, memoryview(b"xy"))


IDENT = ss.Identity(build="t", pack="sha256:0", kv="bfloat16", mtp=False)


def test_a_hybrid_store_hits_only_where_a_state_was_saved(tmp_path: Path) -> None:
    """Real store, the Qwen3-Next layout: boundaries saved as a delta chain (one state page per
    boundary, rows only above the parent); a prompt is offered the deepest saved boundary it
    contains, never a block-granular part of one (that would be attention without its state); a
    damaged state chunk fails the restore (the connector then reports the load failed)."""
    hy = hybrid_layout(Config([Group(["m"], SMALL_M), Group(["a"], SMALL_A)]))
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(4, 500, 5 * 16)]
    rows = rng.integers(0, 255, (5, 1, SMALL_A.page_size_bytes), dtype=np.uint8)
    states = {b: rng.integers(0, 255, (1, hy.parts[0].unit_bytes), dtype=np.uint8) for b in (32, 64)}
    with ss.Store.open(tmp_path / "s", identity=IDENT, layout=hy.layout()) as store:
        parent: int | str | None = None
        for b in (32, 64):
            res = store.save(tokens[:b], {"g0.state": states[b], "g1.kv": rows}, rows=hy.rows(b), parent=parent)
            parent = res.snapshot_id
        assert store.describe(res).rows == {"g1.kv": 4}
        short = store.match(tokens[:60])
        assert short is not None and short.n_tokens == 32  # a part of the 64 boundary is never offered
        m = store.match(tokens[:70] + [1, 2, 3])
        assert m is not None and m.n_tokens == 64
        st_out = np.zeros((1, hy.parts[0].unit_bytes), np.uint8)
        kv_out = np.zeros((4, 1, SMALL_A.page_size_bytes), np.uint8)
        r = store.restore(m, into={"g0.state": st_out, "g1.kv": kv_out}, rows_from=1)
        assert r.rows == {"g1.kv": 4} and np.array_equal(st_out, states[64])
        assert np.array_equal(kv_out[1:], rows[1:4]) and not kv_out[0].any()
    # damage the 64 boundary's state chunk: its restore fails, the 32 boundary still restores
    with ss.Store.open(tmp_path / "s", identity=IDENT, layout=hy.layout()) as store:
        victim = _state_chunk_file(tmp_path / "s", store, m.snapshot_id)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 1
        victim.write_bytes(bytes(raw))
        with pytest.raises(ss.SnapstoreError):
            store.restore(m, into={"g0.state": st_out, "g1.kv": kv_out})
        m2 = store.match(tokens[:70])
        assert m2 is None or m2.n_tokens == 32


def _state_chunk_file(root: Path, store: ss.Store, sid: int) -> Path:
    """The chunk file of snapshot ``sid``'s state part (the CLI's ``inspect ID --json`` lists it)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(root), "inspect", str(sid), "--json"],
                         capture_output=True, text=True, check=True)
    part = next(p for p in json.loads(out.stdout)["snapshot"]["parts"] if p["name"] == "g0.state")
    cid = part["chunks"][0]["id"]
    return next(p for p in (root / "blobs").rglob(f"*{cid}*") if p.is_file())
