"""Serving engines (issue 14): paged K/V sources and destinations, plan-then-write, rows_from,
batch restores, capture chains, sessions that fit chats, engine metadata, errors that teach."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hst
from support import IDENT, LAYOUT, make_state, store_factory

import snapstore as ss

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
sys.path.insert(0, TESTS_DIR)
import paged_engine as pe  # noqa: E402

HERE = TESTS_DIR
ROOT = os.path.dirname(HERE)


_open = store_factory(identity=pe.IDENT, layout=pe.LAYOUT, staging_bytes=16384, budget=None, check_rows=None)


# -- PagedRows: byte ranges over scattered blocks ------------------------------------------------
@pytest.mark.parametrize("axes,shape", [((0, 1), (40, 7, 2, 3, 5)), ((1, 2), (2, 40, 7, 3, 5)),
                                        ((2, 0), (7, 3, 40, 2, 5))])
def test_paged_rows_any_byte_range_round_trips(axes: tuple[int, int], shape: tuple[int, ...]) -> None:
    """read_into / write_from at every kind of offset (mid-row starts and ends) match the
    canonical bytes of the sequence, for pools whose block/token axes sit anywhere."""
    rng = np.random.default_rng(3)
    pool = rng.standard_normal(shape).astype(np.float16)
    table = rng.permutation(40)[:9]
    src = ss.PagedRows(pool, table, axes)
    moved = np.moveaxis(pool, axes, (0, 1))
    canon = np.concatenate([moved[b] for b in table]).reshape(-1).view(np.uint8)
    assert src.nbytes == len(canon) == 9 * 7 * src.row_bytes
    for _ in range(200):
        a = int(rng.integers(0, len(canon)))
        b = int(rng.integers(a, min(len(canon), a + 3 * src.row_bytes) + 1))
        out = bytearray(b - a)
        src.read_into(a, memoryview(out))
        assert bytes(out) == canon[a:b].tobytes()
    dst_pool = np.zeros_like(pool)
    dst = ss.PagedRows(dst_pool, table[::-1].copy(), axes)
    cuts = sorted({0, len(canon), *map(int, rng.integers(0, len(canon), 30))})
    for a, b in zip(cuts, cuts[1:]):
        dst.write_from(a, memoryview(canon[a:b]))
    back = bytearray(len(canon))
    dst.read_into(0, memoryview(back))
    assert bytes(back) == canon.tobytes()
    # views(): the in-place read path of a restore, where blocks are contiguous runs
    pool3 = np.zeros_like(pool)
    dst3 = ss.PagedRows(pool3, table, axes)
    for a, b in zip(cuts, cuts[1:]):
        segs = dst3.views(a, b - a)
        if segs is None:
            assert axes != (0, 1)  # only a (block, slot, *row) C-order pool has contiguous blocks
            return
        assert sum(len(v) for v in segs) == b - a
        pos = a
        for v in segs:
            v[:] = canon[pos:pos + len(v)].tobytes()
            pos += len(v)
    back3 = bytearray(len(canon))
    dst3.read_into(0, memoryview(back3))
    assert bytes(back3) == canon.tobytes()


def test_paged_rows_refuse_bad_tables() -> None:
    pool = np.zeros((4, 2, 3), np.float32)
    with pytest.raises(ss.InvalidInputError, match="outside the pool"):
        ss.PagedRows(pool, [0, 4])
    with pytest.raises(ss.InvalidInputError, match="axes"):
        ss.PagedRows(pool, [0], (1, 1))
    with pytest.raises(ss.InvalidInputError, match="outside this block table"):
        ss.PagedRows(pool, [1]).write_from(0, memoryview(bytes(100)))


# -- row_span: the one head / whole rows / tail split every row-structured reader and writer uses --
@given(row_bytes=hst.integers(1, 64), offset=hst.integers(0, 700), n=hst.integers(0, 700))
def test_row_span_tiles_the_range_exactly(row_bytes: int, offset: int, n: int) -> None:
    """The head (inside one row, only when the range starts mid-row), the whole rows and the tail
    (the start of one row, shorter than a row) are, in order, exactly the bytes of the range."""
    sp = ss.row_span(offset, n, row_bytes)
    covered = [sp.head_row * row_bytes + sp.head_start + i for i in range(sp.head_len)]
    covered += range(sp.first * row_bytes, sp.stop * row_bytes)
    covered += [sp.stop * row_bytes + i for i in range(sp.tail_len)]
    assert covered == list(range(offset, offset + n))
    assert sp.head_start + sp.head_len <= row_bytes and sp.tail_len < row_bytes and sp.first <= sp.stop
    assert (sp.head_len > 0) == (offset % row_bytes != 0 and n > 0)
    assert sp.whole_rows == sp.stop - sp.first


def test_row_span_refuses_what_is_not_a_range() -> None:
    for args in ((-1, 4, 8), (0, -1, 8), (0, 4, 0)):
        with pytest.raises(ss.InvalidInputError):
            ss.row_span(*args)


# -- the paged engine: restore into another slot's scattered blocks after a restart --------------
def _check_slot(eng: pe.PagedEngine, slot: int, tokens: list[int]) -> None:
    kv, draft, state = eng.contiguous(slot)
    ekv, edraft, estate = pe.expected(tokens)
    assert eng.pos[slot] == len(tokens)
    assert kv.tobytes() == ekv.tobytes() and draft.tobytes() == edraft.tobytes()
    assert state.tobytes() == estate.tobytes()


def _restart_roundtrip(tmp_path: Any, backend: str, device: str = "cpu") -> None:
    d = str(tmp_path / "store")
    out = subprocess.run([sys.executable, os.path.join(HERE, "paged_engine.py"), "save", d], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert len(json.loads(out.stdout)) == 3
    eng = pe.PagedEngine(backend, device, seed=7)  # another shuffle: other blocks than the saver's
    eng.alloc(0, 300)  # slot 0 busy: restores land in other slots' blocks
    with _open(d) as st:
        for slot, p in zip((3, 1, 2), pe.prompts()):
            left = pe.restore(st, eng, slot, p + [5, 6])
            assert left == 2
            _check_slot(eng, slot, p)
            table = eng.tables[slot]
            assert all(abs(a - b) != 1 for a, b in zip(table, table[1:]))  # scattered
        assert pe.restore(st, eng, 0, [1, 2, 3]) == 3  # a miss


def test_paged_engine_numpy_bit_exact_after_restart(tmp_path: Any) -> None:
    _restart_roundtrip(tmp_path, "numpy")


def test_paged_engine_torch_cpu_bit_exact_after_restart(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    _restart_roundtrip(tmp_path, "torch", "cpu")


@pytest.mark.gpu
def test_paged_engine_torch_cuda_bit_exact_after_restart(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _restart_roundtrip(tmp_path, "torch", "cuda")


def test_torch_paged_save_restore_bf16_vllm_layout(tmp_path: Any) -> None:
    """A bf16 vLLM-style pool (2, blocks, BS, heads, dim) saves from and restores into scattered
    blocks bit-exact, chunk edges cutting rows (TorchPagedRows gathers / scatters with index ops)."""
    torch = pytest.importorskip("torch")
    from snapstore.engine import TorchPagedRows

    layout = ss.Layout(rows={"kv": ss.Rows("bfloat16", (2, 3, 5))})
    g = torch.Generator().manual_seed(0)
    pool = torch.randn((2, 50, 8, 3, 5), generator=g).to(torch.bfloat16)
    perm = torch.randperm(50, generator=g)
    n = 77
    with ss.Store.open(str(tmp_path), identity=IDENT, layout=layout, chunk_bytes=4096,
                       staging_bytes=8192) as st:
        r = st.save(list(range(n)), {"kv": TorchPagedRows(pool, perm[:10], (1, 2))})
        dst_pool = torch.zeros_like(pool)
        st.restore(r, into={"kv": TorchPagedRows(dst_pool, perm[20:30], (1, 2))})
    src = pool.movedim((1, 2), (0, 1))[perm[:10]].reshape(-1, 2, 3, 5)[:n]
    got = dst_pool.movedim((1, 2), (0, 1))[perm[20:30]].reshape(-1, 2, 3, 5)[:n]
    assert torch.equal(src.view(torch.int16), got.view(torch.int16))
    assert 60 * 77 % 4096 != 0 and 4096 % 60 != 0  # chunk edges fall inside rows


# -- plan, then write ----------------------------------------------------------------------------
def test_restore_with_callable_destination_gets_the_checked_plan(store: ss.Store) -> None:
    state = make_state(LAYOUT, 50)
    r = store.save(list(range(50)), state, rows={"mtp.kv": 40})
    seen: list[ss.MatchDetails] = []

    def allocate(plan: ss.MatchDetails) -> dict[str, Any]:
        seen.append(plan)
        return {"rec.state": np.empty((3, 5), np.float32),
                "attn.kv": np.empty((plan.rows["attn.kv"], 2, 4, 8), np.float16),
                "mtp.kv": np.empty((plan.rows["mtp.kv"], 2, 8), np.float16)}

    out = store.restore(r, into=allocate)
    assert len(seen) == 1 and seen[0].rows == {"attn.kv": 50, "mtp.kv": 40}
    assert seen[0].nbytes == out.bytes_restored
    with pytest.raises(ss.InvalidInputError, match="callable must return a mapping"):
        store.restore(r, into=lambda plan: None)


def test_callable_destination_not_called_when_the_plan_fails(store: ss.Store) -> None:
    """A plan that fails its checks never reaches the engine's allocator (nothing to free)."""
    r = store.save(list(range(20)), make_state(LAYOUT, 20))
    store.delete(r)
    called: list[int] = []
    with pytest.raises(ss.SnapshotUnavailableError) as e:
        store.restore(r, into=lambda plan: called.append(1) or {})
    assert not called and e.value.touched is False


# -- rows_from -------------------------------------------------------------------------------------
def test_rows_from_skips_rows_the_engine_holds(store_dir: str) -> None:
    """rows_from=k leaves rows below k untouched, writes the rest exactly, and reads fewer bytes."""
    with ss.Store.open(store_dir, identity=IDENT, layout=LAYOUT, chunk_bytes=4096, staging_bytes=16384,
                       budget=ss.Budget(ram_bytes=0)) as st:
        state = make_state(LAYOUT, 300, seed=5)
        r = st.save(list(range(300)), state)
        rb = LAYOUT.rows["attn.kv"].row_bytes
        for k in (0, 1, 97, 128, 299, 300):
            dest = {"rec.state": np.zeros((3, 5), np.float32), "attn.kv": np.full((300, 2, 4, 8), 7, np.float16),
                    "mtp.kv": np.full((300, 2, 8), 7, np.float16)}
            out = st.restore(r, into=dest, rows_from=k)
            assert (dest["attn.kv"][:k] == 7).all() and (dest["mtp.kv"][:k] == 7).all()
            assert dest["attn.kv"][k:].tobytes() == state["attn.kv"][k:].tobytes()
            assert dest["mtp.kv"][k:].tobytes() == state["mtp.kv"][k:].tobytes()
            assert dest["rec.state"].tobytes() == state["rec.state"].tobytes()
            assert out.rows == {"attn.kv": 300, "mtp.kv": 300}
            assert out.bytes_restored == LAYOUT.fixed_bytes + (300 - k) * LAYOUT.bytes_per_token
            assert st.describe(r, rows_from=k).part_bytes["attn.kv"] == (300 - k) * rb
        with pytest.raises(ss.InvalidInputError, match="rows_from"):
            st.restore(r, into=dest, rows_from=301)
        with pytest.raises(ss.InvalidInputError, match="rows_from"):
            st.restore(r, into=dest, rows_from=-1)


def test_rows_from_through_a_paged_destination(tmp_path: Any) -> None:
    """A shared system prompt resident in blocks: only the rest is written into the slot."""
    with _open(str(tmp_path)) as st:
        eng = pe.PagedEngine(seed=2)
        p = pe.prompts()[0]
        eng.prefill(0, p)
        r = pe.save(st, eng, 0, p)
        eng.prefill(1, p[:83])  # the system prompt is resident in slot 1
        eng.alloc(1, len(p))
        kv0, _, _ = eng.contiguous(1)
        meta = pe.META.empty()
        st.restore(r, into=pe.parts(eng, 1, meta), rows_from=83)
        eng.pos[1] = pe.META.unpack(meta)["position"]
        _check_slot(eng, 1, p)


# -- batches ---------------------------------------------------------------------------------------
def test_restore_many_reads_a_shared_chain_once(store_dir: str) -> None:
    with ss.Store.open(store_dir, identity=IDENT, layout=LAYOUT, chunk_bytes=4096, staging_bytes=16384,
                       budget=ss.Budget(ram_bytes=0)) as st:
        sys_prompt = list(range(200))
        full = make_state(LAYOUT, 260, seed=9)
        root = st.save(sys_prompt, {k: v[:200] if k in LAYOUT.rows else v for k, v in full.items()})
        convs = [sys_prompt + [1000 + i] * 60 for i in range(3)]
        states = []
        for i, c in enumerate(convs):
            own = make_state(LAYOUT, 260, seed=20 + i)  # own rows above the shared 200, own fixed part
            states.append({k: np.concatenate([full[k][:200], own[k][200:]]) if k in LAYOUT.rows else own[k]
                           for k in own})
            st.save(c, states[-1], parent=root)
        ms = st.match_many([c + [1] for c in convs])
        assert [m.n_tokens for m in ms] == [260] * 3
        dests = [{"rec.state": np.zeros((3, 5), np.float32), "attn.kv": np.zeros((260, 2, 4, 8), np.float16),
                  "mtp.kv": np.zeros((260, 2, 8), np.float16)} for _ in ms]
        reads: list[int] = []
        real_pread = os.preadv

        def counting(fd: int, bufs: Any, offset: int, *a: Any) -> int:
            reads.append(sum(len(b) for b in bufs))
            return real_pread(fd, bufs, offset, *a)

        os.preadv = counting  # type: ignore[assignment]
        try:
            outs = st.restore_many(list(zip(ms, dests)))
        finally:
            os.preadv = real_pread  # type: ignore[assignment]
        for d, out, want in zip(dests, outs, states):
            assert out.n_tokens == 260
            for k in LAYOUT.parts:
                assert d[k].tobytes() == want[k].tobytes()
        # the root's rows once, each conversation's own rows and fixed part once
        assert sum(reads) == 200 * LAYOUT.bytes_per_token + 3 * (LAYOUT.fixed_bytes + 60 * LAYOUT.bytes_per_token)
        assert st.match_many([[5, 5]]) == [None]


# -- capture chains --------------------------------------------------------------------------------
def test_turn_captures_are_deltas_committed_root_first(store: ss.Store) -> None:
    state = make_state(LAYOUT, 400, seed=4)
    toks = list(range(400))

    def at(n: int) -> dict[str, Any]:
        return {k: v[:n] if k in LAYOUT.rows else v for k, v in state.items()}

    with store.turn(session="conv-1") as t:
        for n in (100, 200, 300, 400):
            res = t.capture(toks[:n], at(n))
            assert res.pending and res.stored_bytes <= LAYOUT.fixed_bytes + 100 * LAYOUT.bytes_per_token + 512
        assert store.match(toks) is None
    assert [c.parent_id for c in t.captures[1:]] == [c.snapshot_id for c in t.captures[:-1]]
    assert t.result is not None and t.result.ok
    assert store.match(toks).snapshot_id == t.captures[-1].snapshot_id
    assert store.stats().pending == 0


def test_turn_abandons_every_capture_on_error(store: ss.Store) -> None:
    state = make_state(LAYOUT, 300, seed=4)
    with pytest.raises(RuntimeError):
        with store.turn(session="conv-2") as t:
            for n in (100, 200, 300):
                t.capture(list(range(n)), {k: v[:n] if k in LAYOUT.rows else v for k, v in state.items()})
            raise RuntimeError("the client went away")
    assert store.stats().pending == 0 and store.snapshots() == []
    with pytest.raises(ss.StateError):
        t.capture([1], {})


# -- sessions that fit chats -------------------------------------------------------------------------
def test_shared_root_outside_sessions_survives_every_conversation(store: ss.Store) -> None:
    """The engine.md recipe: the shared prefix saved with session=None stays matchable for a new
    conversation after other conversations' turns superseded their own snapshots."""
    st = make_state(LAYOUT, 500, seed=1)
    sysp = list(range(200))

    def at(toks: list[int]) -> dict[str, Any]:
        return {k: v[:len(toks)] if k in LAYOUT.rows else v for k, v in st.items()}

    root = store.save(sysp, at(sysp))  # outside any session
    for conv, tok in (("A", 9), ("B", 8)):
        first = store.save(sysp + [tok] * 50, at(sysp + [tok] * 50), session=conv)
        assert first.parent_id == root.snapshot_id
        store.save(sysp + [tok] * 150, at(sysp + [tok] * 150), session=conv)  # the next turn
        assert store.match(sysp + [tok] * 50 + [1]).n_tokens == 200  # superseded in its session
    m = store.match(sysp + [7, 7])  # a new conversation with the same system prompt
    assert m is not None and m.snapshot_id == root.snapshot_id


# -- engine metadata -----------------------------------------------------------------------------------
def test_engine_meta_round_trips_and_refuses_bad_values(tmp_path: Any) -> None:
    meta = ss.EngineMeta(["position", "prefix_hash", "draft_rows"])
    layout = ss.Layout(fixed=meta.layout(), rows={"kv": ss.Rows("float16", (4,))})
    with ss.Store.open(str(tmp_path), identity=IDENT, layout=layout) as st:
        r = st.save([1, 2, 3], {meta.name: meta.pack(position=3, prefix_hash=-(2**62), draft_rows=2),
                                "kv": np.ones((3, 4), np.float16)})
        buf = meta.empty()
        st.restore(r, into={meta.name: buf, "kv": np.empty((3, 4), np.float16)})
    assert meta.unpack(buf) == {"position": 3, "prefix_hash": -(2**62), "draft_rows": 2}
    with pytest.raises(ss.InvalidInputError, match="missing fields"):
        meta.pack(position=1)
    with pytest.raises(ss.InvalidInputError, match="int64 range"):
        meta.pack(position=2**64, prefix_hash=0, draft_rows=0)


# -- errors that teach ------------------------------------------------------------------------------------
def test_commit_of_a_skipped_save_says_it_was_skipped(store_dir: str) -> None:
    with ss.Store.open(store_dir, identity=IDENT, layout=LAYOUT, budget=ss.Budget(disk_bytes=1024)) as st:
        res = st.save(list(range(50)), make_state(LAYOUT, 50), commit=False)
        assert res.skipped == "larger_than_budget"
        with pytest.raises(ss.InvalidInputError, match=r"skipped \(larger_than_budget\).*nothing to commit"):
            st.commit(res)


def test_restore_of_superseded_and_abandoned_names_the_cause(store: ss.Store) -> None:
    st = make_state(LAYOUT, 300)
    old = store.save(list(range(200)), {k: v[:200] if k in LAYOUT.rows else v for k, v in st.items()}, session="s")
    store.save(list(range(300)), st, session="s")  # supersedes `old`, a chain link now
    dest = {"rec.state": np.empty((3, 5), np.float32), "attn.kv": np.empty((300, 2, 4, 8), np.float16),
            "mtp.kv": np.empty((300, 2, 8), np.float16)}
    with pytest.raises(ss.SnapshotUnavailableError, match="superseded by a longer snapshot of its session 's'"):
        store.restore(old, into=dest)
    c = store.save([5] * 10, make_state(LAYOUT, 10), commit=False)
    store.abandon(c)
    with pytest.raises(ss.SnapshotUnavailableError, match="abandoned"):
        store.restore(c, into=dest)


def test_reader_without_nbytes_names_the_protocol(store: ss.Store) -> None:
    class NoSize:
        def read_into(self, offset: int, out: memoryview) -> None:
            out[:] = bytes(len(out))

    state = make_state(LAYOUT, 10)
    with pytest.raises(ss.LayoutError, match=r"read_into\(\) but no `nbytes`.*PartReader"):
        store.save(list(range(10)), {**state, "attn.kv": NoSize()})


def test_token_axis_elsewhere_suggests_moveaxis_and_short_destination_gives_rows(store: ss.Store) -> None:
    state = make_state(LAYOUT, 10)
    with pytest.raises(ss.LayoutError, match=r"np\.moveaxis\(arr, 1, 0\)") as e:
        store.save(list(range(10)), {**state, "attn.kv": np.ascontiguousarray(np.moveaxis(state["attn.kv"], 0, 1))})
    assert "torch" not in str(e.value)
    r = store.save(list(range(10)), state)
    with pytest.raises(ss.DestinationError, match=r"\(4 rows of 128 bytes\), 10 rows"):
        store.restore(r, into={**state, "attn.kv": bytearray(4 * 128 + 3)})


def test_rows_beyond_the_token_count_are_refused(store: ss.Store) -> None:
    state = make_state(LAYOUT, 11)
    with pytest.raises(ss.InvalidInputError, match=r"rows\['attn.kv'\] = 11 but only 10 tokens"):
        store.save(list(range(10)), state, rows={"attn.kv": 11})


# -- docs: the glue docs/engine.md shows is this module's, and short -------------------------------------
def test_engine_doc_shows_the_tested_glue() -> None:
    doc = open(os.path.join(ROOT, "docs", "engine.md")).read()
    block = re.search(r"<!-- paged-glue -->\n```python\n(.*?)```", doc, re.S)
    assert block is not None
    src = open(os.path.join(HERE, "paged_engine.py")).read()
    glue = src.split("# --- glue: begin (docs/engine.md shows these lines) ---\n")[1].split("# --- glue: end ---")[0]
    strip = [ln for ln in glue.splitlines() if ln.strip()]
    assert [ln for ln in block.group(1).splitlines() if ln.strip()] == strip
    assert len(strip) <= 30
