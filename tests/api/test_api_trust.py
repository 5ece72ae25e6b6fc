"""Issue 46, items 2, 3, 4, 13, 14 (API side) and 15: references, paged sources, lagging streams,
numeric arguments, Store.open's arguments and the engine-author calls (load, turns, handles).

Each test reproduces the failure the issue reports with the public API (it fails on the code
before the fix) and checks the behaviour the docs now promise."""

from __future__ import annotations

import fractions
import threading
from typing import Any

import numpy as np
import pytest
from conftest import IDENT, LAYOUT, make_state

import snapstore as ss

G = 16  # tokens per row of the block-granular layout
BLOCKS = ss.Layout(rows={"kv": ss.Rows("float32", (2, 64))}, tokens_per_row=G)  # 512-byte rows: 8 a chunk


def _open(path: Any, layout: ss.Layout = BLOCKS, **kw: Any) -> ss.Store:
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("staging_bytes", 65536)
    return ss.Store.open(str(path), identity=IDENT, layout=layout, budget=ss.Budget(reserve_bytes=0), **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50000, n)]


# -- item 2: one reading of a snapshot reference ---------------------------------------------------

def test_match_details_as_a_ref_restores_only_the_matched_prefix(tmp_path: Any) -> None:
    """lookup() found 4 blocks (64 tokens) of a 16-block snapshot: restoring, describing and
    estimating that MatchDetails covers those 4 rows — never the rows past the point where the
    snapshot leaves the prompt (before: 16 rows written, n_tokens=256)."""
    a = _prompt(16 * G, 1)
    kv = np.random.default_rng(2).standard_normal((16, 2, 64)).astype(np.float32)
    with _open(tmp_path / "s") as st:
        res = st.save(a, {"kv": kv})
        prompt = a[:4 * G] + _prompt(40, 3)
        d = st.lookup(prompt)
        assert d is not None and d.n_tokens == 4 * G and d.snapshot_tokens == 16 * G and d.rows == {"kv": 4}
        dest = np.full((16, 2, 64), -1.0, np.float32)
        out = st.restore(d, into={"kv": dest})
        assert out.n_tokens == 4 * G and out.rows == {"kv": 4}
        assert np.array_equal(dest[:4], kv[:4]) and (dest[4:] == -1.0).all()
        again = st.describe(d)
        assert again.n_tokens == 4 * G and again.rows == {"kv": 4}
        assert st.estimate_restore(d).bytes < st.estimate_restore(res).bytes
        # restore_many reads a ref the same way
        dest2 = np.full((16, 2, 64), -1.0, np.float32)
        (out2,) = st.restore_many([(d, {"kv": dest2})])
        assert out2.rows == {"kv": 4} and (dest2[4:] == -1.0).all()
        # a numpy integer id and the LoadResult of a load name the snapshot too
        assert st.describe(np.int64(res.snapshot_id)).n_tokens == 16 * G
        got = st.load(prompt, allocate=lambda p: {"kv": np.zeros((p.rows["kv"], 2, 64), np.float32)})
        assert got is not None and st.describe(got).n_tokens == 4 * G


@pytest.mark.parametrize("bad", ["7", 7.0, True, None, object(), {"snapshot_id": 1}, [1]])
def test_anything_else_as_a_ref_is_a_clear_invalid_input_error(tmp_path: Any, bad: Any) -> None:
    """A string, float, bool, dict, ... is refused naming what a ref is, by every call taking one."""
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        tokens = list(range(50))
        st.save(tokens, make_state(LAYOUT, len(tokens)))
        for call in (lambda: st.restore(bad, into={}), lambda: st.describe(bad),
                     lambda: st.estimate_restore(bad), lambda: st.delete(bad), lambda: st.commit(bad)):
            with pytest.raises(ss.InvalidInputError, match="snapshot reference|snapshot id"):
                call()


def test_a_snapshot_info_is_not_mistaken_for_a_prefix(tmp_path: Any) -> None:
    """Objects that merely carry a ``snapshot_id`` attribute used to be taken as refs; a
    SnapshotInfo (snapshots()) names its whole snapshot, other look-alikes are refused."""
    class LooksLike:
        snapshot_id = 1
        n_tokens = 3

    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        tokens = list(range(50))
        st.save(tokens, make_state(LAYOUT, len(tokens)))
        info = st.snapshots()[0]
        assert st.describe(info).n_tokens == 50
        with pytest.raises(ss.InvalidInputError, match="snapshot reference"):
            st.describe(LooksLike())


# -- item 13: numeric arguments ----------------------------------------------------------------

@pytest.mark.parametrize("rate", [np.float32(2000), np.int64(2000), np.float64(2000.5), fractions.Fraction(4001, 2)])
def test_numpy_and_other_real_numbers_are_numbers(tmp_path: Any, rate: Any) -> None:
    """prefill_tokens_per_s and ttl_s take what numbers.Real accepts (before: numpy scalars were
    "not a positive number")."""
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        tokens = list(range(50))
        res = st.save(tokens, make_state(LAYOUT, len(tokens)))
        st.match(tokens, prefill_tokens_per_s=rate)
        st.lookup(tokens, prefill_tokens_per_s=rate)
        st.name(res, "n", ttl_s=rate)
        assert st.named("n") is not None


@pytest.mark.parametrize("bad", [10**400, float("nan"), float("inf"), -1, 0, True, "2000", None, np.nan])
def test_bad_numbers_are_refused_naming_the_argument(tmp_path: Any, bad: Any) -> None:
    """10**400 used to escape as a raw OverflowError; every refusal is an InvalidInputError naming
    the argument, and the store is unchanged."""
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        tokens = list(range(50))
        res = st.save(tokens, make_state(LAYOUT, len(tokens)))
        if bad is not None:  # None is the default of both: no weighing, no expiry
            with pytest.raises(ss.InvalidInputError, match="prefill_tokens_per_s"):
                st.match(tokens, prefill_tokens_per_s=bad)
            with pytest.raises(ss.InvalidInputError, match="prefill_tokens_per_s"):
                st.lookup(tokens, prefill_tokens_per_s=bad)
            with pytest.raises(ss.InvalidInputError, match="ttl_s"):
                st.name(res, "n", ttl_s=bad)
            assert st.named("n") is None
        if bad not in (0,) and not (isinstance(bad, int) and not isinstance(bad, bool) and 0 <= bad < 2**63):
            dest = {k: np.empty_like(v) for k, v in make_state(LAYOUT, len(tokens)).items()}
            with pytest.raises(ss.InvalidInputError, match="rows_from"):
                st.restore(res, into=dest, rows_from=bad)


@pytest.mark.parametrize("field", ["disk_bytes", "ram_bytes", "max_entries", "ttl", "reserve_bytes",
                                   "write_bytes_per_hour"])
def test_budget_fields_take_numpy_scalars_and_refuse_the_rest(field: str) -> None:
    """Every Budget field: numpy scalars accepted (normalised to plain numbers), 10**400, nan,
    inf, bool and strings refused naming the field."""
    b = ss.Budget(**{field: np.int64(4096)})
    assert type(getattr(b, field)) in (int, float) and getattr(b, field) == 4096
    for bad in (10**400, float("nan"), float("inf"), True, "4096", -1, np.float64("nan")):
        with pytest.raises(ss.ConfigError, match=f"Budget.{field}"):
            ss.Budget(**{field: bad})


def test_store_open_sizes_take_numpy_integers_and_refuse_floats(tmp_path: Any) -> None:
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT, chunk_bytes=np.int64(8192),
                       staging_bytes=np.int32(65536), pending_lease=np.float32(30)) as st:
        assert st.chunk_bytes == 8192 and type(st.chunk_bytes) is int
    for kw in ({"chunk_bytes": 8192.0}, {"staging_bytes": 10**400}, {"pending_lease": float("nan")},
               {"chunk_bytes": True}):
        with pytest.raises(ss.ConfigError, match=next(iter(kw))):
            ss.Store.open(str(tmp_path / "t"), identity=IDENT, layout=LAYOUT, **kw)


def test_the_other_numeric_arguments_go_through_the_same_check(tmp_path: Any) -> None:
    """gc(grace=), flush(timeout=), async_copy_bytes, EngineMeta fields, PrefillRate, PagedRows axes:
    numpy scalars accepted, the rest refused naming the argument (before: 10**400 / nan / strings
    slipped through or escaped as raw TypeError / OverflowError)."""
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT,
                       async_copy_bytes=np.int64(1 << 20)) as st:
        assert st.gc(grace=np.float32(10), dry_run=True) is not None
        assert st.flush(timeout=np.int64(5))
        for bad in ("10", float("nan"), -1.0):
            with pytest.raises(ss.InvalidInputError, match="grace"):
                st.gc(grace=bad, dry_run=True)
            with pytest.raises(ss.InvalidInputError, match="timeout"):
                st.flush(timeout=bad)
    with pytest.raises(ss.ConfigError, match="async_copy_bytes"):
        ss.Store.open(str(tmp_path / "t"), identity=IDENT, layout=LAYOUT, async_copy_bytes=1.5)
    meta = ss.EngineMeta(["position"])
    assert meta.unpack(meta.pack(position=np.int32(7))) == {"position": 7}
    with pytest.raises(ss.InvalidInputError, match="position"):
        meta.pack(position=7.0)
    rate = ss.PrefillRate(decay=np.float32(0.5))
    rate.observe(np.int64(1000), np.float64(0.5))
    assert rate.tokens_per_s == 2000.0
    with pytest.raises(ss.InvalidInputError, match="seconds"):
        rate.observe(1000, "0.5")
    with pytest.raises(ss.InvalidInputError, match="decay"):
        ss.PrefillRate(decay=float("nan"))
    pool = np.zeros((4, 16, 8), np.float16)
    assert ss.PagedRows(pool, [0], axes=(np.int64(0), np.int8(1))).axes == (0, 1)
    with pytest.raises(ss.InvalidInputError, match="axes"):
        ss.PagedRows(pool, [0], axes=(0.0, 1))


def test_layout_shapes_take_numpy_integers() -> None:
    """A shape taken from a numpy array's .shape arithmetic (np.int64) is a shape."""
    assert ss.Rows("float16", (np.int64(2), 8)).row_shape == (2, 8)
    assert ss.Fixed("float32", (np.int32(4),)).nbytes == 16
    with pytest.raises(ss.LayoutError, match="row_shape"):
        ss.Rows("float16", (2.0, 8))


# -- item 14 (API side) --------------------------------------------------------------------------

def test_store_open_with_a_number_as_budget_says_what_a_budget_is(tmp_path: Any) -> None:
    """Before: AttributeError: 'int' object has no attribute 'resolved'."""
    with pytest.raises(ss.ConfigError, match=r"budget must be None or a snapstore.Budget"):
        ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT, budget=1000)  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()  # refused before anything was created


def test_store_path_that_is_a_file_is_refused_clearly(tmp_path: Any) -> None:
    """Before: "cannot examine …/blobs: Not a directory"."""
    f = tmp_path / "notes.txt"
    f.write_bytes(b"mine")
    for ro in (False, True):
        with pytest.raises(ss.ConfigError, match="is a file, not a directory"):
            ss.Store.open(str(f), identity=IDENT, layout=LAYOUT, read_only=ro)
    assert f.read_bytes() == b"mine"


# -- item 4: a stream that lags the tokens ------------------------------------------------------

def _lagged() -> ss.Layout:
    """A K/V stream in step with the tokens and a draft stream one row behind (built per test: a
    layout the code before the fix cannot express fails that test alone)."""
    return ss.Layout(fixed={"h": ss.Fixed("float32", (4,))},
                     rows={"kv": ss.Rows("float16", (2, 8)),
                           "draft": ss.Rows("float16", (8,), component="draft", lag=1)})


def _lagged_state(n: int, cap: int = 2048) -> dict[str, np.ndarray]:
    """An engine's arenas after ``n`` tokens: K/V rows [0, n), draft rows [0, n - 1) — the rest of
    each arena zeros, as a preallocated arena is."""
    rng = np.random.default_rng(7)
    kv = np.zeros((cap, 2, 8), np.float16)
    draft = np.zeros((cap, 8), np.float16)
    full_kv = rng.standard_normal((cap, 2, 8)).astype(np.float16)
    full_draft = rng.standard_normal((cap, 8)).astype(np.float16) + 5  # never zero: a stale row shows
    kv[:n], draft[:n - 1] = full_kv[:n], full_draft[:n - 1]
    return {"h": np.full(4, n, np.float32), "kv": kv, "draft": draft}


def test_a_lagging_stream_is_saved_and_restored_without_rows(tmp_path: Any) -> None:
    """A draft head one row behind the tokens: a save of 1,300 tokens stores 1,299 draft rows (before:
    1,300, the last a zero row), a delta over it continues at row 1,299, and the restore writes
    1,299 valid draft rows, exact; rows_from counts rows in step with the tokens."""
    tokens = _prompt(1400, 9)
    lagged = _lagged()
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=lagged, budget=ss.Budget(reserve_bytes=0),
                       check_rows=True) as st:
        p = st.save(tokens[:1300], _lagged_state(1300))
        assert st.describe(p).rows == {"kv": 1300, "draft": 1299}
        c = st.save(tokens, _lagged_state(1400))
        assert c.parent_id == p.snapshot_id
        want = _lagged_state(1400)
        dest = {"h": np.zeros(4, np.float32), "kv": np.full((1400, 2, 8), -1, np.float16),
                "draft": np.full((1400, 8), -1, np.float16)}
        out = st.restore(c, into=dest)
        assert out.rows == {"kv": 1400, "draft": 1399}
        assert np.array_equal(dest["kv"], want["kv"][:1400])
        assert np.array_equal(dest["draft"][:1399], want["draft"][:1399])
        assert (dest["draft"][1399] == -1).all()  # the row the head has not computed is not written
        # the engine holds 1,300 tokens: 1,300 K/V rows and 1,299 draft rows are not rewritten
        d = st.describe(c, rows_from=1300)
        assert d.part_bytes["kv"] == 100 * lagged.rows["kv"].row_bytes
        assert d.part_bytes["draft"] == 100 * lagged.rows["draft"].row_bytes


def test_rows_past_a_lagging_streams_valid_ones_are_refused(tmp_path: Any) -> None:
    """rows= claiming the stale row is refused (it cannot be told from data), nothing stored; an int
    rows= counts rows in step with the tokens (the lagging stream gets one fewer)."""
    tokens = _prompt(300, 11)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=_lagged(), budget=ss.Budget(reserve_bytes=0)) as st:
        with pytest.raises(ss.InvalidInputError, match=r"lags the tokens by 1.*299 valid rows"):
            st.save(tokens, _lagged_state(300), rows={"draft": 300})
        assert st.snapshots() == []
        r = st.save(tokens, _lagged_state(300), rows=250)
        assert st.describe(r).rows == {"kv": 250, "draft": 249}


def test_lag_keeps_old_layout_hashes_and_is_checked() -> None:
    """A layout without lag describes and hashes exactly as before (the key in docs/format.md);
    a lag is an integer >= 0 and needs one row per token."""
    plain = ss.Layout(rows={"kv": ss.Rows("float16", (2, 8))})
    assert plain.canonical == '{"fixed":{},"rows":{"kv":{"component":null,"dtype":"float16","row_shape":[2,8]}}}'
    assert ss.Rows("float16", (2, 8), lag=0) == ss.Rows("float16", (2, 8))
    lagged = ss.Layout(rows={"kv": ss.Rows("float16", (2, 8), lag=1)})
    assert lagged.key != plain.key and '"lag":1' in lagged.canonical
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ss.LayoutError, match="lag"):
            ss.Rows("float16", (2, 8), lag=bad)
    with pytest.raises(ss.LayoutError, match="lag"):
        ss.Layout(rows={"kv": ss.Rows("float16", (2, 8), lag=1)}, tokens_per_row=16)


# -- item 3: paged sources and destinations are checked against the layout's rows --------------

PAGED = ss.Layout(rows={"kv": ss.Rows("float16", (2, 4, 4, 32))})  # (K/V, layers, heads, dim) per token


def test_a_paged_pool_read_with_the_wrong_axes_is_refused_on_save_and_restore(tmp_path: Any) -> None:
    """A pool [block, 2, L, slot, H, D] with the default axes=(0, 1) has rows (4, 16, 4, 32) where the
    layout says (2, 4, 4, 32): the byte counts agree, so before the fix the save succeeded and the
    restore was not exact. Both are refused naming both shapes and the axes that fit."""
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((6, 2, 4, 16, 4, 32)).astype(np.float16)
    tokens = _prompt(40, 4)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=PAGED, budget=ss.Budget(reserve_bytes=0)) as st:
        with pytest.raises(ss.LayoutError, match=r"\(4, 16, 4, 32\).*\(2, 4, 4, 32\).*axes=\(0, 3\)"):
            st.save(tokens, {"kv": ss.PagedRows(pool, [4, 1, 2])})
        assert st.snapshots() == []
        res = st.save(tokens, {"kv": ss.PagedRows(pool, [4, 1, 2], axes=(0, 3))})
        out_pool = np.zeros_like(pool)
        with pytest.raises(ss.DestinationError, match=r"axes=\(0, 3\)") as e:
            st.restore(res, into={"kv": ss.PagedRows(out_pool, [0, 5, 3])})
        assert not e.value.touched and not out_pool.any()
        st.restore(res, into={"kv": ss.PagedRows(out_pool, [0, 5, 3], axes=(0, 3))})
        got = np.concatenate([np.moveaxis(out_pool[b], 2, 0) for b in (0, 5, 3)])[:40]
        want = np.concatenate([np.moveaxis(pool[b], 2, 0) for b in (4, 1, 2)])[:40]
        assert np.array_equal(got, want)


def test_a_paged_pool_of_another_dtype_is_refused_and_raw_bytes_pass_on_row_bytes() -> None:
    """PagedRows reports its dtype; float32 rows of the same byte size are not float16 rows. A uint8
    view of the pool is raw bytes, checked on its row bytes as a raw array is."""
    with pytest.raises(ss.LayoutError, match=r"float32.*float16"):
        from snapstore.parts.buffers import as_source
        as_source("kv", ss.PagedRows(np.zeros((2, 16, 2, 4, 4, 16), np.float32), [0]), PAGED.rows["kv"], 4)
    raw = np.zeros((2, 16, 2 * 4 * 4 * 32 * 2), np.uint8)
    from snapstore.parts.buffers import as_sink
    assert as_sink("kv", ss.PagedRows(raw, [0, 1]), PAGED.rows["kv"], 20).nbytes == 20 * PAGED.rows["kv"].row_bytes
    with pytest.raises(ss.DestinationError, match="rows are"):
        as_sink("kv", ss.PagedRows(raw[..., :-2], [0, 1]), PAGED.rows["kv"], 20)


def test_a_typed_memoryview_is_checked_like_the_array_it_views(tmp_path: Any) -> None:
    """A memoryview that says its element type and shape is checked on them, as its array would be
    (before: on its byte count alone, so rows of (8, 8) passed for rows of (2, 4, 8)). Flat raw bytes
    still pass on their size."""
    tokens = list(range(30))
    state = make_state(LAYOUT, 30)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        wrong = np.ascontiguousarray(state["attn.kv"]).reshape(30, 8, 8)  # same bytes, rows (8, 8)
        with pytest.raises(ss.LayoutError, match=r"row shape is \(8, 8\)"):
            st.save(tokens, {**state, "attn.kv": memoryview(wrong)})
        assert st.snapshots() == []
        raw = memoryview(np.ascontiguousarray(state["attn.kv"]).tobytes())
        res = st.save(tokens, {**state, "attn.kv": raw})
        dest = {k: np.empty_like(v) for k, v in state.items()}
        with pytest.raises(ss.DestinationError, match=r"row shape is \(8, 8\)"):
            st.restore(res, into={**dest, "attn.kv": memoryview(np.empty((30, 8, 8), np.float16))})
        st.restore(res, into={**dest, "attn.kv": memoryview(dest["attn.kv"])})
        assert dest["attn.kv"].tobytes() == state["attn.kv"].tobytes()


def test_torch_paged_rows_report_their_rows_too(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    from snapstore.engine import TorchPagedRows

    pool = torch.zeros((6, 2, 4, 16, 4, 32), dtype=torch.float16)
    tokens = _prompt(40, 4)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=PAGED, budget=ss.Budget(reserve_bytes=0)) as st:
        with pytest.raises(ss.LayoutError, match=r"axes=\(0, 3\)"):
            st.save(tokens, {"kv": TorchPagedRows(pool, [4, 1, 2])})
        assert st.save(tokens, {"kv": TorchPagedRows(pool, [4, 1, 2], axes=(0, 3))}).ok


# -- item 15: the engine author's calls ----------------------------------------------------------

def test_load_takes_the_details_of_an_earlier_lookup_and_counts_the_hit_once(tmp_path: Any) -> None:
    """A scheduler sizes its blocks with lookup(), then loads that prefix: before, load() matched
    again (hits and hit tokens counted twice, and the second match could pick another snapshot)."""
    a = _prompt(16 * G, 1)
    kv = np.random.default_rng(2).standard_normal((16, 2, 64)).astype(np.float32)
    with _open(tmp_path / "s") as st:
        st.save(a, {"kv": kv})
        d = st.lookup(a[:4 * G] + _prompt(40, 3))
        assert d is not None
        before = st.stats()
        got = st.load(d, allocate=lambda p: {"kv": np.zeros((p.rows["kv"], 2, 64), np.float32)})
        assert got is not None and got.n_tokens == 4 * G and got.match.snapshot_id == d.snapshot_id
        assert np.array_equal(got.into["kv"], kv[:4])
        after = st.stats()
        assert (after.hits, after.hit_tokens, after.misses) == (before.hits, before.hit_tokens, before.misses)
        m = st.match(a)
        assert m is not None
        assert st.load(m, allocate=lambda p: {"kv": np.zeros((p.rows["kv"], 2, 64), np.float32)}).n_tokens == 16 * G
        with pytest.raises(ss.InvalidInputError, match="exclude"):
            st.load(m, allocate=lambda p: {}, exclude=[m])


def test_an_allocate_that_raises_is_released(tmp_path: Any) -> None:
    """allocate took blocks and then failed: release({}) is called (before: nothing, the blocks
    leaked), and the allocate's error is the one raised."""
    tokens = list(range(60))
    freed: list[Any] = []
    taken: list[int] = []

    def allocate(plan: ss.MatchDetails) -> dict[str, Any]:
        taken.append(plan.rows["attn.kv"])
        raise MemoryError("out of blocks")

    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        st.save(tokens, make_state(LAYOUT, len(tokens)))
        with pytest.raises(MemoryError, match="out of blocks"):
            st.load(tokens, allocate=allocate, release=freed.append)
        assert taken == [60] and freed == [{}]
        assert st.load([9, 9, 9], allocate=allocate, release=freed.append) is None and freed == [{}]


def test_turn_commit_without_waiting_commits_when_the_captures_land(tmp_path: Any, monkeypatch: Any) -> None:
    """Turn.commit(wait=False) returns at once and commits when the last capture in flight lands;
    the turn lists its in-flight handles; store.commit() of a handle in flight says what to do."""
    from snapstore.store import store as _store

    tokens = list(range(300))
    gate = threading.Event()
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        monkeypatch.setitem(_store._HOOKS, "save_committed", lambda: gate.wait(20))  # holds the writer thread
        t = st.turn(session="conv")
        h1 = t.capture(tokens[:100], make_state(LAYOUT, 100), wait=False)
        h2 = t.capture(tokens[:200], make_state(LAYOUT, 200), wait=False)
        assert t.in_flight == [h1, h2]
        fut = t.commit(wait=False)
        assert not fut.done() and t.result is None
        with pytest.raises(ss.StateError, match=r"in flight.*handle\.result\(\)"):
            st.commit(h2)
        gate.set()
        res = fut.result(timeout=20)
        assert res is not None and res.ok and not res.pending and t.result == res
        assert res.snapshot_id == h2.result().snapshot_id and t.in_flight == []
        m = st.match(tokens)
        assert m is not None and m.n_tokens == 200
        # a handle that landed is a reference like its SaveResult
        h3 = st.save(tokens, make_state(LAYOUT, 300), commit=False, wait=False, parent=h2)
        h3.result(timeout=20)
        assert st.commit(h3).ok and st.match(tokens).n_tokens == 300  # type: ignore[union-attr]


def test_turn_commit_without_waiting_and_nothing_in_flight(tmp_path: Any) -> None:
    tokens = list(range(100))
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as st:
        t = st.turn()
        t.capture(tokens, make_state(LAYOUT, 100))
        fut = t.commit(wait=False)
        assert fut.done() and fut.result() is not None and fut.result().ok  # type: ignore[union-attr]
        assert st.turn().commit(wait=False).result() is None  # nothing captured
