"""Core store behaviour: exact round trips, delta chains and branches, dedup, isolation,
validate-before-write, restart in a new process, two processes at once, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import IDENT, LAYOUT, empty_like_state, layouts, make_state, open_store, part_hashes, sha

import snapstore as ss

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there

# -- exactness -------------------------------------------------------------------------------

@settings(max_examples=settings.default.max_examples * 4 // 3,  # the profile sizes it: dev 13, ci 40
          deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts(), n1=st.integers(1, 600), extra=st.integers(0, 600), seed=st.integers(0, 2**32 - 1),
       codec=st.sampled_from(["raw", "zstd", "zstd-shuffle2"]))
def test_round_trip_exact_through_a_chain(tmp_path_factory: Any, layout: ss.Layout, n1: int, extra: int,
                                          seed: int, codec: str) -> None:
    path = str(tmp_path_factory.mktemp("rt"))
    n2 = n1 + extra
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 2**31 + 10, n2)
    state = make_state(layout, n2, seed)
    with open_store(path, layout=layout, codec=codec) as s:
        r1 = s.save(toks[:n1], state, session="a")
        assert r1.ok and r1.parent_id is None
        state2 = dict(state)
        for name in layout.fixed:  # the fixed parts change between boundaries
            state2[name] = make_state(layout, 1, seed + 1)[name]
        r2 = s.save(toks, state2, session="b")
        assert r2.ok
        if n2 > n1:
            assert r2.parent_id == r1.snapshot_id
        m = s.match(toks)
        assert m is not None and m.snapshot_id == r2.snapshot_id and m.n_tokens == n2
        dest = empty_like_state(state)
        res = s.restore(m, dest)
        assert res.rows == {k: n2 for k in layout.rows}
        assert part_hashes(layout, dest, res.rows) == part_hashes(layout, state2, res.rows)
        # and the older boundary, through its own one-link chain
        if extra:
            assert s.match(toks[:n1]).snapshot_id == r1.snapshot_id
        dest1 = empty_like_state(state)
        s.restore(r1, dest1)
        rows1 = {k: n1 for k in layout.rows}
        assert part_hashes(layout, dest1, rows1) == part_hashes(layout, state, rows1)


def test_chain_and_branch_scenario(tmp_path: Any) -> None:
    """A: 3 chunks + 300 tokens; B shares A's first chunk then diverges. Both saved at every
    boundary; each snapshot stores one chunk's rows + the fixed parts; everything restores."""
    C = 512
    row = ss.Rows("float16", (2, 2, 16))  # 128 bytes a row: one boundary = 64 KiB
    layout = ss.Layout(fixed={"gdn.state": ss.Fixed("float32", (4, 64))}, rows={"attn.kv": row})
    fixed_bytes = 4 * 64 * 4
    rng = np.random.default_rng(7)
    a_tok = rng.integers(0, 1000, 3 * C + 300)
    b_tok = np.concatenate([a_tok[:C], rng.integers(1000, 2000, C + 200)])
    a_kv = rng.integers(0, 256, (len(a_tok), 128), dtype=np.uint8).view(np.float16).reshape(-1, 2, 2, 16)
    b_kv = a_kv[: len(b_tok)].copy()
    b_kv[C:] = rng.integers(0, 256, (len(b_tok) - C, 128), dtype=np.uint8).view(np.float16).reshape(-1, 2, 2, 16)
    states: dict[int, dict[str, np.ndarray]] = {}
    with open_store(str(tmp_path / "s"), layout=layout, chunk_bytes=64 * 1024, staging_bytes=256 * 1024) as s:
        a_ids = []
        for k, n in enumerate([C, 2 * C, 3 * C, 3 * C + 300]):
            st_ = {"gdn.state": rng.standard_normal((4, 64)).astype(np.float32), "attn.kv": a_kv}
            r = s.save(a_tok[:n], st_, parent="auto")
            assert r.ok
            assert r.parent_id == (a_ids[-1] if a_ids else None)
            seg_rows = n - ([0, C, 2 * C, 3 * C][k])
            hdrs = 64 * (1 + max(1, -(-seg_rows * 128 // (64 * 1024))))
            assert r.stored_bytes == fixed_bytes + seg_rows * 128 + hdrs, (k, r)
            a_ids.append(r.snapshot_id)
            states[r.snapshot_id] = {"gdn.state": st_["gdn.state"].copy(), "attn.kv": a_kv[:n].copy()}
        b_ids = []
        for n in [C, 2 * C, 2 * C + 200]:
            st_ = {"gdn.state": rng.standard_normal((4, 64)).astype(np.float32), "attn.kv": b_kv}
            r = s.save(b_tok[:n], st_, parent="auto")
            assert r.ok
            b_ids.append(r.snapshot_id)
            states[r.snapshot_id] = {"gdn.state": st_["gdn.state"].copy(), "attn.kv": b_kv[:n].copy()}
        # B's first boundary has the same tokens as A's root but another fixed state: a new snapshot
        # whose K/V rows dedup against A's root; B's 2-chunk snapshot is a delta over it
        assert s.snapshots()[0].snapshot_id == a_ids[0]
        r = s.restore(s.match(a_tok), {"gdn.state": np.zeros((4, 64), np.float32),
                                       "attn.kv": np.zeros_like(a_kv)})
        assert r.chain == a_ids
        for sid in a_ids + b_ids:
            dest = {"gdn.state": np.zeros((4, 64), np.float32), "attn.kv": np.zeros_like(a_kv)}
            res = s.restore(sid, dest)
            n = res.n_tokens
            assert sha(dest["gdn.state"]) == sha(states[sid]["gdn.state"])
            assert sha(dest["attn.kv"][:n]) == sha(states[sid]["attn.kv"])
        # B's 2-chunk snapshot restores through B's root, a link whose K/V chunk is A's root's chunk
        mb = s.match(b_tok)
        assert mb.snapshot_id == b_ids[-1]
        res = s.restore(mb, {"gdn.state": np.zeros((4, 64), np.float32), "attn.kv": np.zeros_like(b_kv)})
        assert res.chain == b_ids


def test_delta_over_shared_root_costs_one_segment(tmp_path: Any) -> None:
    """B's 2-chunk snapshot is a delta over A's root when B names it as parent."""
    C = 256
    layout = ss.Layout(fixed={"f": ss.Fixed("float32", (8,))}, rows={"kv": ss.Rows("uint8", (64,))})
    rng = np.random.default_rng(1)
    a_tok = rng.integers(0, 100, 3 * C)
    b_tok = np.concatenate([a_tok[:C], rng.integers(100, 200, C + 50)])
    kv_a = rng.integers(0, 256, (3 * C, 64), dtype=np.uint8)
    kv_b = np.concatenate([kv_a[:C], rng.integers(0, 256, (C + 50, 64), dtype=np.uint8)])
    f = np.arange(8, dtype=np.float32)
    with open_store(str(tmp_path / "s"), layout=layout) as s:
        root = s.save(a_tok[:C], {"f": f, "kv": kv_a})
        s.save(a_tok, {"f": f + 1, "kv": kv_a})
        rb = s.save(b_tok, {"f": f + 2, "kv": kv_b}, parent=root.snapshot_id)
        assert rb.parent_id == root.snapshot_id
        assert rb.logical_bytes == 32 + (2 * C + 50) * 64
        assert rb.stored_bytes == 32 + 64 + (C + 50) * 64 + 64 * -(-((C + 50) * 64) // 4096)
        dest = {"f": np.zeros(8, np.float32), "kv": np.zeros_like(kv_b)}
        res = s.restore(s.match(list(b_tok) + [5, 6]), dest)
        assert res.chain == [root.snapshot_id, rb.snapshot_id]
        assert np.array_equal(dest["kv"], kv_b) and np.array_equal(dest["f"], f + 2)


# -- dedup and isolation ---------------------------------------------------------------------

def test_same_state_saved_twice_is_stored_once(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 300, 3)
    toks = list(range(300))
    r1 = store.save(toks, st_)
    before = store.stats().stored_bytes
    r2 = store.save(toks, st_)
    assert r2.snapshot_id == r1.snapshot_id and r2.stored_bytes == 0
    assert store.stats().stored_bytes == before
    assert len(store.snapshots()) == 1


_SAVER = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, sys.argv[2])
    import snapstore as ss
    from support import IDENT, LAYOUT, make_state
    s = ss.Store.open(sys.argv[1], identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0),
                      chunk_bytes=4096, staging_bytes=65536)
    r = s.save(list(range(400)), make_state(LAYOUT, 400, 11))
    print(json.dumps({"id": r.snapshot_id, "stored": r.stored_bytes}))
    s.close()
""")


def test_same_state_saved_by_two_processes_is_stored_once(store_dir: str) -> None:
    here = TESTS_DIR
    outs = [json.loads(subprocess.run([sys.executable, "-c", _SAVER, store_dir, here], check=True,
                                      capture_output=True, text=True).stdout) for _ in range(2)]
    assert outs[0]["stored"] > 0 and outs[1]["stored"] == 0 and outs[0]["id"] == outs[1]["id"]
    with open_store(store_dir) as s:
        st_ = s.stats()
        assert st_.snapshots == 1
        assert st_.stored_bytes == outs[0]["stored"]


def test_identity_isolation(store_dir: str) -> None:
    other = ss.Identity(build="test-1.0+abc", pack="sha256:0123", kv="q8_0", mtp=True, extra={"flash_attn": "1"})
    st_ = make_state(LAYOUT, 200, 5)
    toks = list(range(200))
    with open_store(store_dir) as a:
        ra = a.save(toks, st_)
    with open_store(store_dir, identity=other, drop_stale=False) as b:
        assert b.match(toks) is None
        rb = b.save(toks, st_)
        assert rb.stored_bytes == ra.stored_bytes  # no dedup across identities
        with pytest.raises(ss.IdentityError):
            b.restore(ra.snapshot_id, empty_like_state(st_))
    with open_store(store_dir, drop_stale=False) as a:
        m = a.match(toks)
        assert m is not None and m.snapshot_id == ra.snapshot_id


def test_namespace_isolation(store: ss.Store) -> None:
    st203 = make_state(LAYOUT, 203, 6)
    st_ = {k: (v[:200] if k in LAYOUT.rows else v) for k, v in st203.items()}
    toks = list(range(200))
    r1 = store.save(toks, st_, namespace="tenant-a")
    assert store.match(toks) is None
    assert store.match(toks, namespace="tenant-b") is None
    m = store.match(toks, namespace="tenant-a")
    assert m is not None and m.snapshot_id == r1.snapshot_id
    r2 = store.save(toks, st_, namespace="tenant-b")
    assert r2.snapshot_id != r1.snapshot_id
    assert r2.stored_bytes == r1.stored_bytes  # no dedup across namespaces
    r3 = store.save(toks + [1, 2, 3], st203, namespace="tenant-b")
    assert r3.parent_id == r2.snapshot_id  # auto parent never crosses namespaces


# -- validate before write -------------------------------------------------------------------

def _saved(store: ss.Store, n: int = 700, seed: int = 9) -> tuple[list[int], dict[str, np.ndarray], ss.SaveResult]:
    st_ = make_state(LAYOUT, n, seed)
    toks = list(range(n))
    store.save(toks[: n // 2], st_)
    return toks, st_, store.save(toks, st_)


def _sentinel(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, 7) for k, v in state.items()}


def _untouched(dest: dict[str, np.ndarray]) -> bool:
    return all(bool((v.view(np.uint8) == np.full_like(v, 7).view(np.uint8)).all()) for v in dest.values())


def test_missing_chunk_file_leaves_destination_untouched(store: ss.Store) -> None:
    toks, st_, r = _saved(store)
    leaf_chunk = store._repo.db.read(lambda c: c.execute(
        "SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'attn.kv' ORDER BY seq DESC LIMIT 1",
        (r.snapshot_id,)).fetchone()[0])
    os.unlink(store._repo.blob_path(bytes(leaf_chunk)))
    dest = _sentinel(st_)
    with pytest.raises(ss.SnapshotUnavailableError) as e:
        store.restore(r, dest)
    assert e.value.touched is False and _untouched(dest)


def test_wrong_destination_dtype_or_shape_leaves_it_untouched(store: ss.Store) -> None:
    toks, st_, r = _saved(store)
    for bad in ({"attn.kv": np.full((700, 2, 4, 8), 7, np.float32)},
                {"attn.kv": np.full((700, 2, 8, 4), 7, np.float16)},
                {"attn.kv": np.full((10, 2, 4, 8), 7, np.float16)},
                {"rec.state": np.full((5, 3), 7, np.float32)}):
        dest = _sentinel(st_)
        dest.update(bad)
        with pytest.raises(ss.DestinationError) as e:
            store.restore(r, dest)
        assert e.value.touched is False and _untouched(dest)
    dest = _sentinel(st_)
    del dest["rec.state"]
    with pytest.raises(ss.DestinationError):
        store.restore(r, dest)
    assert _untouched(dest)


def test_read_only_destination(store: ss.Store) -> None:
    toks, st_, r = _saved(store)
    dest = _sentinel(st_)
    dest["attn.kv"].flags.writeable = False
    with pytest.raises(ss.DestinationError):
        store.restore(r, dest)
    dest["attn.kv"].flags.writeable = True
    assert _untouched(dest)
    with pytest.raises(ss.DestinationError):
        store.restore(r, {**dest, "rec.state": bytes(60)})


def test_broken_chain_leaves_destination_untouched(store: ss.Store) -> None:
    toks, st_, r = _saved(store)
    # damage the chain: the leaf now claims to start at another token than its parent ends
    store._repo.db.write(lambda c: c.execute("UPDATE snapshots SET base_tokens = base_tokens + 1 WHERE id = ?",
                                             (r.snapshot_id,)))
    dest = _sentinel(st_)
    with pytest.raises(ss.SnapshotUnavailableError) as e:
        store.restore(r, dest)
    assert not e.value.touched and _untouched(dest)


def test_corrupt_chunk_is_never_a_silent_success(store: ss.Store) -> None:
    toks, st_, r = _saved(store)
    chunks = store._repo.db.read(lambda c: [bytes(x[0]) for x in c.execute(
        "SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'attn.kv' ORDER BY seq",
        (r.snapshot_id,))])
    # flip a payload byte of the LAST chunk written: earlier chunks land first, so touched=True
    path = store._repo.blob_path(chunks[-1])
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    dest = _sentinel(st_)
    with pytest.raises(ss.CorruptChunkError) as e:
        store.restore(r, dest)
    assert e.value.touched is True
    # a damaged header is found before anything is written
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    dest = _sentinel(st_)
    with pytest.raises(ss.RestoreError) as e2:
        store.restore(r, dest)
    assert e2.value.touched is False and _untouched(dest)


def test_corrupt_first_compressed_chunk_reports_untouched(store_dir: str) -> None:
    with open_store(store_dir, codec="zstd") as s:
        st_ = {k: np.zeros_like(v) for k, v in make_state(LAYOUT, 100, 1).items()}  # compressible
        r = s.save(list(range(100)), st_)
        cid = s._repo.db.read(lambda c: bytes(c.execute(  # the fixed part is the first chunk restored
            "SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'rec.state'",
            (r.snapshot_id,)).fetchone()[0]))
        path = s._repo.blob_path(cid)
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0x55
        os.chmod(path, 0o600)
        open(path, "wb").write(bytes(data))
        dest = _sentinel(st_)
        with pytest.raises(ss.RestoreError) as e:
            s.restore(r, dest)
        assert e.value.touched is False and _untouched(dest)


# -- restart ---------------------------------------------------------------------------------

_RESTORER = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, sys.argv[2])
    import numpy as np, snapstore as ss
    from support import IDENT, LAYOUT, make_state, part_hashes, empty_like_state
    s = ss.Store.open(sys.argv[1], identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0))
    toks = list(range(int(sys.argv[3]))) + [99999] * 5
    m = s.match(toks)
    dest = empty_like_state(make_state(LAYOUT, len(toks), 0))
    r = s.restore(m, dest)
    print(json.dumps({"n": m.n_tokens, "hashes": part_hashes(LAYOUT, dest, r.rows), "chain": r.chain}))
    s.close()
""")


def test_restart_restore_in_new_process(store_dir: str) -> None:
    st_ = make_state(LAYOUT, 900, 21)
    with open_store(store_dir) as s:
        s.save(list(range(450)), st_)
        r = s.save(list(range(900)), st_)
    out = json.loads(subprocess.run([sys.executable, "-c", _RESTORER, store_dir, TESTS_DIR, "900"],
                                    check=True, capture_output=True, text=True).stdout)
    assert out["n"] == 900 and out["chain"][-1] == r.snapshot_id
    assert out["hashes"] == part_hashes(LAYOUT, st_, {"attn.kv": 900, "mtp.kv": 900})


_WORKER = textwrap.dedent("""
    import sys, json, time
    sys.path.insert(0, sys.argv[2])
    import numpy as np, snapstore as ss
    from support import IDENT, LAYOUT, make_state, part_hashes, empty_like_state
    s = ss.Store.open(sys.argv[1], identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0),
                      chunk_bytes=4096, staging_bytes=65536)
    wid, end = int(sys.argv[3]), time.time() + float(sys.argv[4])
    rng = np.random.default_rng(wid)
    ops = 0
    while time.time() < end:
        seed = int(rng.integers(0, 20))
        n = 50 + seed * 20
        toks = [seed * 1000 + i for i in range(n)]
        st = make_state(LAYOUT, n, seed)
        r = s.save(toks, st)
        assert r.ok, r
        m = s.match(toks + [7])
        assert m is not None and m.n_tokens == n, (m, n)
        dest = empty_like_state(st)
        res = s.restore(m, dest)
        assert part_hashes(LAYOUT, dest, res.rows) == part_hashes(LAYOUT, st, res.rows)
        ops += 3
    print(json.dumps({"ops": ops}))
    s.close()
""")


@pytest.mark.slow  # two processes
def test_two_processes_save_match_restore_concurrently(store_dir: str) -> None:
    here = TESTS_DIR
    open_store(store_dir).close()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, store_dir, here, str(w), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out)["ops"] > 0
    with open_store(store_dir) as s:
        assert s.verify(deep=True).ok


def test_threads_share_one_store(store: ss.Store) -> None:
    import threading
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for i in range(15):
                n = 40 + i * 7 + w
                toks = [w * 100000 + t for t in range(n)]
                st_ = make_state(LAYOUT, n, w * 100 + i)
                r = store.save(toks, st_, parent=None)
                dest = empty_like_state(st_)
                res = store.restore(store.match(toks), dest)
                assert res.chain == [r.snapshot_id]
                assert part_hashes(LAYOUT, dest, res.rows) == part_hashes(LAYOUT, st_, res.rows)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


# -- bad input -------------------------------------------------------------------------------

def _store_bytes(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            if f.startswith("snapstore.db"):
                continue
            p = os.path.join(root, f)
            out[p] = sha(np.frombuffer(open(p, "rb").read(), np.uint8))
    return out


@pytest.mark.parametrize("case", ["dtype_name", "negative_token", "unknown_part", "missing_part", "bad_rows",
                                  "short_buffer", "wrong_dtype", "string_tokens", "empty_tokens", "bad_parent",
                                  "float_tokens", "bad_namespace"])
def test_bad_input_is_a_clear_error_and_changes_nothing(store: ss.Store, case: str) -> None:
    st_ = make_state(LAYOUT, 100, 1)
    toks: Any = list(range(100))
    store.save(toks[:50], st_)
    before = (_store_bytes(store.path), store.stats().snapshots, store.stats().stored_bytes)
    kw: dict[str, Any] = {}
    parts: Any = dict(st_)
    if case == "dtype_name":
        with pytest.raises(ss.LayoutError, match="unknown dtype"):
            ss.Layout(rows={"x": ss.Rows("float17", (2,))})
        return
    if case == "negative_token":
        toks = toks[:-1] + [-1]
    elif case == "unknown_part":
        parts["nope"] = np.zeros(3)
    elif case == "missing_part":
        del parts["rec.state"]
    elif case == "bad_rows":
        kw["rows"] = {"attn.kv": -3}
    elif case == "short_buffer":
        parts["attn.kv"] = st_["attn.kv"][:10]
    elif case == "wrong_dtype":
        parts["attn.kv"] = st_["attn.kv"].astype(np.float32)
    elif case == "string_tokens":
        toks = "hello"
    elif case == "empty_tokens":
        toks = []
    elif case == "bad_parent":
        kw["parent"] = 987654
    elif case == "float_tokens":
        toks = [1.5] * 100
    elif case == "bad_namespace":
        kw["namespace"] = ""
    with pytest.raises(ss.SnapstoreError) as e:
        store.save(toks, parts, **kw)
    assert str(e.value)
    assert (_store_bytes(store.path), store.stats().snapshots, store.stats().stored_bytes) == before


def test_errors_subclass_builtins() -> None:
    assert issubclass(ss.LayoutError, ValueError) and issubclass(ss.NotFoundError, KeyError)
    assert issubclass(ss.StoreIOError, OSError) and issubclass(ss.CorruptChunkError, ss.RestoreError)
    for name in ss.__all__:
        obj = getattr(ss, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, ss.SnapstoreError)


def test_public_names_are_exactly_the_intended_ones() -> None:
    import types
    public = {n for n in dir(ss) if not n.startswith("_") and not isinstance(getattr(ss, n), types.ModuleType)}
    assert set(ss.__all__) - {"__version__"} <= public
    assert public - set(ss.__all__) <= {"annotations"}


def test_tokens_beyond_int32_and_numpy_inputs(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 64, 2)
    toks = np.array([2**40 + i for i in range(64)], dtype=np.int64)
    r = store.save(toks, st_)
    assert store.match(list(toks) + [1]).snapshot_id == r.snapshot_id
    assert store.match(np.array([2**40 + i for i in range(63)] + [5])) is None


def test_match_needs_exact_tokens_and_returns_longest(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 1200, 4)
    toks = list(range(1200))
    ids = [store.save(toks[:n], st_).snapshot_id for n in (100, 256, 257, 600, 1200)]
    assert store.match(toks[:99]) is None
    assert store.match(toks[:256]).snapshot_id == ids[1]
    assert store.match(toks[:300]).snapshot_id == ids[2]
    assert store.match(toks[:599] + [5]).snapshot_id == ids[2]
    assert store.match(toks + [1]).snapshot_id == ids[4]
    changed = list(toks)
    changed[10] = 77777
    assert store.match(changed) is None


def test_pending_captures(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 300, 8)
    toks = list(range(300))
    root = store.save(toks[:100], st_, commit=False)
    child = store.save(toks[:200], st_, parent=root.snapshot_id, commit=False)
    assert root.pending and child.pending
    assert store.match(toks) is None
    store.commit(child)  # commits the pending parent first
    assert store.match(toks).snapshot_id == child.snapshot_id
    assert store.match(toks[:150]).snapshot_id == root.snapshot_id
    p = store.save(toks[:300], st_, commit=False)
    store.abandon(p)
    assert store.match(toks).snapshot_id == child.snapshot_id
    with pytest.raises(ss.StateError):
        store.abandon(child)
    # a refused (abandoned) parent drops its pending children
    a = store.save([5] * 10 + toks[:90], st_, commit=False)
    b = store.save([5] * 10 + toks[:190], st_, parent=a.snapshot_id, commit=False)
    store.abandon(a)
    assert {s.snapshot_id for s in store.snapshots()}.isdisjoint({a.snapshot_id, b.snapshot_id})


_PENDING = textwrap.dedent("""
    import sys, os
    sys.path.insert(0, sys.argv[2])
    import snapstore as ss
    from support import IDENT, LAYOUT, make_state
    s = ss.Store.open(sys.argv[1], identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0))
    r = s.save(list(range(100)), make_state(LAYOUT, 100, 0), commit=False)
    print(r.snapshot_id, flush=True)
    os._exit(0)   # dies without closing: the capture is left pending
""")


def test_pending_of_dead_process_dropped_at_open(store_dir: str) -> None:
    out = subprocess.run([sys.executable, "-c", _PENDING, store_dir, TESTS_DIR],
                         check=True, capture_output=True, text=True).stdout
    sid = int(out.split()[0])
    with open_store(store_dir) as s:
        assert all(x.snapshot_id != sid for x in s.snapshots())
        assert s.stats().stored_bytes == 0
        assert s.verify(deep=True).ok


def test_sqlite_settings_and_permissions(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 100, 1)
    store.save(list(range(100)), st_)
    c = store._repo.db.conn()
    assert c.pragma("journal_mode") == "wal"
    assert c.pragma("application_id") == 0x534E5053
    assert c.pragma("user_version") >= 1
    for root, dirs, files in os.walk(store.path):
        assert os.stat(root).st_mode & 0o777 == 0o700, root
        for f in files:
            assert os.stat(os.path.join(root, f)).st_mode & 0o777 == 0o600, f


def test_newer_schema_is_refused(store_dir: str) -> None:
    open_store(store_dir).close()
    import apsw
    c = apsw.Connection(os.path.join(store_dir, "snapstore.db"))
    c.pragma("user_version", 999)
    c.close()
    with pytest.raises(ss.StoreFormatError, match="newer"):
        open_store(store_dir)


def test_default_location_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("SNAPSTORE_DIR", str(tmp_path / "env-dir"))
    with ss.Store.open(identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0)) as s:
        assert s.path == str(tmp_path / "env-dir")
        assert os.path.isfile(os.path.join(s.path, "snapstore.db"))


def test_check_rows_refuses_a_parent_whose_rows_changed(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 300, 12)
    toks = list(range(300))
    root = store.save(toks[:100], st_)
    changed = {k: v.copy() for k, v in st_.items()}
    changed["attn.kv"].view(np.uint16)[5] ^= 1  # a row below the boundary differs from what the parent stored
    auto = store.save(toks, changed)
    assert auto.parent_id is None  # stored whole instead of linking
    with pytest.raises(ss.InvalidInputError, match="check_rows"):
        store.save(toks[:200], changed, parent=root.snapshot_id)
    dest = empty_like_state(st_)
    store.restore(auto, dest)
    assert sha(dest["attn.kv"]) == sha(changed["attn.kv"])


def test_components_four_directions(store_dir: str) -> None:
    base_layout = ss.Layout(fixed=LAYOUT.fixed, rows={"attn.kv": LAYOUT.rows["attn.kv"]})
    st_ = make_state(LAYOUT, 120, 13)
    toks = list(range(120))
    with open_store(store_dir, layout=LAYOUT) as s:
        with_draft = s.save(toks, st_)
        without = s.save(toks + [1], {k: st_[k] if k != "attn.kv" else make_state(LAYOUT, 121, 13)["attn.kv"]
                                      for k in ("rec.state", "attn.kv")}, parent=None)
        # with draft, asking for it
        d = empty_like_state(st_)
        r = s.restore(with_draft, d)
        assert r.missing_components == frozenset() and sha(d["mtp.kv"]) == sha(st_["mtp.kv"])
        # with draft, not asking: draft destination not needed and untouched
        d = {k: v for k, v in _sentinel(st_).items() if k != "mtp.kv"}
        r = s.restore(with_draft, d, components=[])
        assert "mtp.kv" not in r.rows
        # without draft, asking: reported missing, destination left empty
        d = _sentinel(make_state(LAYOUT, 121, 0))
        r = s.restore(without, d)
        assert r.missing_components == frozenset({"draft"}) and (d["mtp.kv"] == 7).all()
        # without draft, not asking
        r = s.restore(without, {k: v for k, v in d.items() if k != "mtp.kv"}, components=())
        assert r.missing_components == frozenset()
    # an older reader whose layout has no draft component ignores the newer part
    with open_store(store_dir, layout=base_layout) as s:
        d = {k: np.zeros_like(st_[k]) for k in ("rec.state", "attn.kv")}
        r = s.restore(s.match(toks), d)
        assert sha(d["attn.kv"]) == sha(st_["attn.kv"])


def test_strided_sources_and_destinations(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 200, 14)
    big = np.zeros((200, 2, 4, 8, 2), np.float16)
    big[..., 1] = st_["attn.kv"]
    strided = big[..., 1]  # not contiguous
    assert not strided.flags.c_contiguous
    r = store.save(list(range(200)), {**st_, "attn.kv": strided})
    dest_big = np.zeros_like(big)
    dest = {**empty_like_state(st_), "attn.kv": dest_big[..., 0]}
    store.restore(r, dest)
    assert sha(dest_big[..., 0]) == sha(st_["attn.kv"])


def test_timing_restore_reports(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 50, 1)
    r = store.save(list(range(50)), st_)
    t0 = time.perf_counter()
    res = store.restore(r, empty_like_state(st_))
    assert 0 <= res.seconds <= time.perf_counter() - t0 + 1e-3
    assert res.bytes_restored == r.logical_bytes


def test_restore_by_id_does_not_cross_namespaces(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 80, 30)
    r = store.save(list(range(80)), st_, namespace="tenant-a")
    with pytest.raises(ss.IdentityError):
        store.restore(r.snapshot_id, empty_like_state(st_))
    with pytest.raises(ss.IdentityError):
        store.restore(r.snapshot_id, empty_like_state(st_), namespace="tenant-b")
    store.restore(r, empty_like_state(st_))  # the SaveResult carries its namespace
    store.restore(r.snapshot_id, empty_like_state(st_), namespace="tenant-a")
    p = store.save(list(range(90)), make_state(LAYOUT, 90, 30), namespace="tenant-a", commit=False)
    with pytest.raises(ss.IdentityError):
        store.commit(p.snapshot_id)
    store.commit(p)


def test_committed_child_of_pending_parent_is_refused(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 200, 31)
    par = store.save(list(range(100)), st_, commit=False)
    with pytest.raises(ss.InvalidInputError, match="parents commit before children"):
        store.save(list(range(200)), st_, parent=par.snapshot_id)


def test_dedup_does_not_depend_on_part_order(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 100, 32)
    a = store.save(list(range(100)), st_)
    b = store.save(list(range(100)), dict(reversed(list(st_.items()))))
    assert a.snapshot_id == b.snapshot_id


def test_drop_stale_spares_a_live_process_pending_capture(store_dir: str) -> None:
    other = ss.Identity(build="other", pack=IDENT.pack, extra=IDENT.extra)  # the same model, another build: stale
    st_ = make_state(LAYOUT, 100, 33)
    with open_store(store_dir, identity=other) as live:
        committed = live.save(list(range(50)), st_)
        pend = live.save(list(range(100)), st_, commit=False)
        with open_store(store_dir):  # drop_stale=True: the other identity's committed-only leaves go
            pass
        ids = {x.snapshot_id for x in live.snapshots()}
        assert pend.snapshot_id in ids and committed.snapshot_id in ids  # pinned by the live capture
        live.commit(pend)
        r = live.save(list(range(300)), make_state(LAYOUT, 300, 34))  # identity row still usable
        assert r.ok


def test_env_flags_are_parsed_strictly(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTORE_CHECK_ROWS", "maybe")
    with pytest.raises(ss.ConfigError):
        open_store(store_dir, check_rows=None)
    monkeypatch.setenv("SNAPSTORE_CHECK_ROWS", "off")
    with open_store(store_dir, check_rows=None) as s:
        assert s.check_rows is False
    monkeypatch.setenv("SNAPSTORE_CHUNK_MIB", "0")
    with pytest.raises(ss.ConfigError):
        ss.Store.open(store_dir, identity=IDENT, layout=LAYOUT)
    with pytest.raises(ss.ConfigError):
        ss.Identity(build="b", pack="p", extra={"x": float("inf")})


def test_saving_the_same_chain_again_reuses_it(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 600, 40)
    toks = list(range(600))
    a1 = store.save(toks[:300], st_, session="s")
    b1 = store.save(toks, st_, session="s")  # supersedes a1 (kept as a chain link)
    a2 = store.save(toks[:300], st_, session="s")  # a1 is not matchable: a new root...
    b2 = store.save(toks, st_, session="s")  # ...but the same chain content: b1 again, and a2 retired
    assert b2.snapshot_id == b1.snapshot_id and b2.stored_bytes == 0 and b2.parent_id == b1.parent_id
    live = [x.snapshot_id for x in store.snapshots() if x.matchable]
    assert live == [b1.snapshot_id]
    assert a2.snapshot_id not in {x.snapshot_id for x in store.snapshots()}
    assert a1.snapshot_id in {x.snapshot_id for x in store.snapshots()}


def test_old_sqlite_library_is_refused(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import apsw
    monkeypatch.setattr(apsw, "sqlite_lib_version", lambda: "3.51.2")
    with pytest.raises(ss.StoreFormatError, match="too old"):
        open_store(store_dir)
    monkeypatch.setattr(apsw, "sqlite_lib_version", lambda: "3.51.3")
    open_store(store_dir).close()


def test_migrations_ship_with_the_package() -> None:
    from importlib import resources
    names = [p.name for p in resources.files("snapstore.migrations").iterdir()]
    assert "0001_initial.sql" in names


def test_identity_ids_are_never_reused(store_dir: str) -> None:
    """A running store's identity must not come to name another identity after a stale drop."""
    x = ss.Identity(build="x", pack="p")
    y = ss.Identity(build="y", pack="p")
    z = ss.Identity(build="z", pack="p")
    st_ = make_state(LAYOUT, 3, 1)
    a = open_store(store_dir, identity=x)
    b = open_store(store_dir, identity=y, drop_stale=False)
    open_store(store_dir, identity=x).close()  # drops y's identity row
    with open_store(store_dir, identity=z, drop_stale=False) as c:
        assert c.save([1, 2, 3], st_).ok
        assert b.match([1, 2, 3]) is None  # y must not see z's snapshot
        with pytest.raises(ss.IdentityError):
            b.restore(c.match([1, 2, 3]).snapshot_id, empty_like_state(st_))
    a.close()
    b.close()


def test_threads_do_not_leak_connections(store: ss.Store) -> None:
    import gc
    import threading
    st_ = make_state(LAYOUT, 20, 1)
    store.save(list(range(20)), st_)
    for _ in range(60):
        t = threading.Thread(target=store.match, args=(list(range(20)),))
        t.start()
        t.join()
    gc.collect()
    assert len(store._repo.db._all) <= 8  # the main thread's, the pool's; not one per dead thread


def test_rows_must_be_ints_and_open_errors_are_snapstore_errors(store: ss.Store, tmp_path: Any) -> None:
    st_ = make_state(LAYOUT, 20, 1)
    for bad in ({"attn.kv": 2.7}, {"attn.kv": "x"}, {"attn.kv": None}):
        with pytest.raises(ss.InvalidInputError):
            store.save(list(range(20)), st_, rows=bad)
    with pytest.raises(ss.InvalidInputError):
        store.restore(1, empty_like_state(st_), components="draft")
    store.save(list(range(20)), st_)
    for comps in ([["draft"]], [{"a": 1}], 5):  # unhashable names, or no collection: not a TypeError
        for into in (empty_like_state(st_), lambda _d: empty_like_state(st_)):
            with pytest.raises(ss.InvalidInputError, match="components"):
                store.restore(1, into, components=comps)  # type: ignore[arg-type]
        with pytest.raises(ss.InvalidInputError, match="components"):
            store.describe(1, components=comps)  # type: ignore[arg-type]
        with pytest.raises(ss.InvalidInputError, match="components"):
            store.lookup(list(range(20)), components=comps)  # type: ignore[arg-type]
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    with pytest.raises(ss.StoreIOError):
        ss.Store.open(str(blocker / "store"), identity=IDENT, layout=LAYOUT)
