"""Prefixes at block granularity (issue 17): for row-stream-only layouts that declare
``tokens_per_row``, match() returns the longest common prefix with any stored snapshot at the row
granularity and restore() writes rows [0, k) of it; layouts with fixed parts keep exact boundaries."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import IDENT, LAYOUT, make_state

import snapstore as ss

G = 32  # tokens per row: one paged block
BLOCKS = ss.Layout(rows={"l0": ss.Rows("float32", (2, G, 8)), "l1": ss.Rows("float32", (2, G, 8))},
                   tokens_per_row=G)


def _open(path: Any, layout: ss.Layout = BLOCKS, **kw: Any) -> ss.Store:
    kw.setdefault("chunk_bytes", 8192)
    kw.setdefault("staging_bytes", 65536)
    return ss.Store.open(str(path), identity=IDENT, layout=layout, budget=ss.Budget(reserve_bytes=0),
                         check_rows=True, **kw)


def _blocks(n_rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((n_rows, 2, G, 8)).astype(np.float32) for n in ("l0", "l1")}


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50000, n)]


def test_match_returns_any_block_aligned_common_prefix_and_restores_its_rows(tmp_path: Any) -> None:
    """A stored 9-block prompt serves a prompt sharing only its first 5 blocks (and a few tokens
    more): 5 blocks, bit-exact, and nothing beyond row 5 of the destination is written."""
    a = _prompt(300, 1)
    state = _blocks(9, 2)
    with _open(tmp_path / "s") as st:
        res = st.save(a, state)
        assert res.ok and st.snapshots()[0].n_tokens == 300
        c = a[:5 * G + 7] + _prompt(100, 3)
        m = st.match(c)
        assert m is not None and m.snapshot_id == res.snapshot_id and m.n_tokens == 5 * G
        d = st.describe(m)
        assert d.n_tokens == 5 * G and d.rows == {"l0": 5, "l1": 5}
        dest = {n: np.full((12, 2, G, 8), -1.0, np.float32) for n in state}
        out = st.restore(m, into=dest)
        assert out.n_tokens == 5 * G and out.rows == {"l0": 5, "l1": 5}
        for n in state:
            assert np.array_equal(dest[n][:5], state[n][:5])
            assert (dest[n][5:] == -1.0).all()  # the straddling chunk is clipped
        # the whole prompt still matches whole; a prompt sharing less than a block does not match
        assert st.match(a + [7]).n_tokens == 300  # type: ignore[union-attr]
        assert st.match(a[:G - 1] + [1, 2, 3]) is None
        assert st.match(c, exclude=[m]) is None


def test_prefix_match_prefers_the_longest_and_walks_delta_chains(tmp_path: Any) -> None:
    """Of several stored prompts the one sharing the most blocks wins; a delta child's rows and
    its parent's rows are both reachable, and an exact shorter snapshot loses to a longer prefix."""
    sys_p = _prompt(4 * G, 10)
    with _open(tmp_path / "s") as st:
        base = _blocks(4, 11)
        r0 = st.save(sys_p, base)
        conv = sys_p + _prompt(6 * G, 12)
        full = {n: np.concatenate([base[n], _blocks(6, 13)[n]]) for n in base}
        r1 = st.save(conv, full)
        assert r1.parent_id == r0.snapshot_id  # a delta over the shared prefix
        other = sys_p + _prompt(2 * G, 14)
        st.save(other, {n: np.concatenate([base[n], _blocks(2, 15)[n]]) for n in base})
        q = conv[:7 * G] + _prompt(50, 16)
        m = st.match(q)
        assert m is not None and m.snapshot_id == r1.snapshot_id and m.n_tokens == 7 * G
        dest = {n: np.zeros((7, 2, G, 8), np.float32) for n in base}
        st.restore(m, into=dest)
        for n in base:
            assert np.array_equal(dest[n], full[n][:7])


def test_prefix_match_survives_reopen_and_respects_namespace_and_eviction(tmp_path: Any) -> None:
    """The index is persistent (another process / a restart finds it), never crosses a namespace,
    and goes with an evicted snapshot."""
    a = _prompt(8 * G, 20)
    state = _blocks(8, 21)
    with _open(tmp_path / "s") as st:
        r = st.save(a, state, namespace="t1")
    q = a[:3 * G] + _prompt(40, 22)
    with _open(tmp_path / "s") as st:
        assert st.match(q) is None
        m = st.match(q, namespace="t1")
        assert m is not None and m.n_tokens == 3 * G
        st.delete(r)
        assert st.match(q, namespace="t1") is None


def test_prefix_match_skips_a_quarantined_chunk(tmp_path: Any) -> None:
    """A damaged chunk found by a restore stops the prefix from being offered (then recompute)."""
    a = _prompt(8 * G, 30)
    with _open(tmp_path / "s") as st:
        st.save(a, _blocks(8, 31))
        q = a[:4 * G] + [1] * 10
        m = st.match(q)
        assert m is not None
        blobs = [p for p in (tmp_path / "s" / "blobs").rglob("*") if p.is_file()]
        for p in blobs:
            raw = bytearray(p.read_bytes())
            raw[-1] ^= 0xFF
            p.write_bytes(bytes(raw))
        with pytest.raises(ss.RestoreError):
            st.restore(m, into={n: np.zeros((4, 2, G, 8), np.float32) for n in ("l0", "l1")})
        assert st.match(q) is None


def test_layouts_with_fixed_parts_keep_exact_boundaries(tmp_path: Any) -> None:
    """A fixed part is valid only where it was captured: no block-granular prefixes for it."""
    with pytest.raises(ss.LayoutError, match="row streams only"):
        ss.Layout(fixed={"s": ss.Fixed("float32", (2,))}, rows={"k": ss.Rows("float16", (4,))}, tokens_per_row=16)
    with ss.Store.open(str(tmp_path / "f"), identity=IDENT, layout=LAYOUT) as st:
        toks = _prompt(300, 40)
        st.save(toks, make_state(LAYOUT, 300))
        assert st.match(toks[:200] + [1, 2]) is None


def test_rows_default_to_one_per_block(tmp_path: Any) -> None:
    """With tokens_per_row=g a save of n tokens holds n // g rows by default, at most that many."""
    with _open(tmp_path / "s") as st:
        toks = _prompt(3 * G + 5, 50)
        res = st.save(toks, _blocks(3, 51))
        assert st.describe(res).rows == {"l0": 3, "l1": 3}
        with pytest.raises(ss.InvalidInputError, match="one row per 32 tokens"):
            st.save(toks, _blocks(4, 52), rows=4)
