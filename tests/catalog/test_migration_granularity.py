"""Migration 0007 (``parts.tokens_per_row``) beside stores written before it: a catalog of the schema
before 0007 reads read-only (the CLI, through the compat view) without being migrated, then a
read-write open migrates it and its snapshots match and restore exactly as before — their segments
recorded no granularity (NULL) and are read as the layout says — while new saves record theirs."""

from __future__ import annotations

import json
import os
from typing import Any

import apsw
import numpy as np
import pytest
from support import IDENT, LAYOUT, make_state
from support.catalogs import UNDO_FIND_KEYS

import snapstore as ss
from snapstore.catalog.db import migrations_dir
from snapstore.cli.main import main

G = 32
BLOCKS = ss.Layout(rows={"l0": ss.Rows("float32", (2, G, 8)), "l1": ss.Rows("float16", (G, 4))}, tokens_per_row=G)


def _open(path: str, layout: ss.Layout) -> ss.Store:
    return ss.Store.open(path, identity=IDENT, layout=layout, budget=ss.Budget(reserve_bytes=0), check_rows=True,
                         chunk_bytes=8192, staging_bytes=65536)


def _state(layout: ss.Layout, n_tokens: int, seed: int) -> dict[str, np.ndarray]:
    if layout.tokens_per_row is None:
        return make_state(layout, n_tokens, seed)
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((n_tokens // G, *spec.row_shape)).astype(spec.dtype)
            for name, spec in layout.rows.items()}


def _pre_v7(db: str) -> int:
    """Take a catalog back to the schema before migration 0007 (parts without tokens_per_row, and so
    without 0008's find keys); its version."""
    before = max(num for num, _name, _sql in migrations_dir() if num < 7)
    c = apsw.Connection(db)
    c.execute(UNDO_FIND_KEYS + f"ALTER TABLE parts DROP COLUMN tokens_per_row; PRAGMA user_version = {before}")
    c.close()
    return before


def _restored(st: ss.Store, ref: Any, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {k: np.zeros_like(v) for k, v in like.items()}
    st.restore(ref, into=out)
    return out


@pytest.mark.parametrize("layout", [LAYOUT, BLOCKS], ids=["exact", "blocks"])
def test_a_store_from_before_0007_reads_read_only_then_migrates_and_restores_the_same(
        tmp_path: Any, layout: ss.Layout, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "s")
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 50000, 12 * G)]
    full = _state(layout, 12 * G, 2)
    head = {k: v if k in layout.fixed else v[:len(v) // 2] for k, v in full.items()}  # 6 blocks / 192 rows
    probes = [prompt + [1], prompt[:6 * G] + [1], prompt[:8 * G] + [1]]  # whole, the parent, (blocks) a prefix
    with _open(path, layout) as st:
        parent = st.save(prompt[:6 * G], head)
        child = st.save(prompt, full)
        assert child.parent_id == parent.snapshot_id
        before = [st.match(p) for p in probes]
    db = os.path.join(path, "snapstore.db")
    old_version = _pre_v7(db)

    for cmd in (["inspect", "--json"], ["stats", "--json"], ["verify", "--deep", "--json"]):
        assert main(["--dir", path, *cmd]) == 0, cmd
        json.loads(capsys.readouterr().out)
    c = apsw.Connection(db)
    assert c.pragma("user_version") == old_version  # read-only: nothing migrated
    c.close()

    with _open(path, layout) as st:
        assert [st.match(p) for p in probes] == before
        assert all(m is not None for m in before)
        if layout.tokens_per_row is not None:
            assert before[2] is not None and before[2].n_tokens == 8 * G  # a block-granular prefix still served
        for m in before:
            assert m is not None
            got = _restored(st, m, full)
            rows = (m.n_tokens // (layout.tokens_per_row or 1))
            for k, v in full.items():
                want = v if k in layout.fixed else v[:rows]
                assert (got[k] if k in layout.fixed else got[k][:rows]).tobytes() == want.tobytes(), (m, k)
        # a new save over the old chain is a delta over it and records its granularity
        longer = prompt + [int(t) for t in np.random.default_rng(3).integers(0, 50000, 2 * G)]
        more = _state(layout, 14 * G, 4)
        state = {k: more[k] if k in layout.fixed else np.concatenate([full[k], more[k][len(full[k]):]])
                 for k in full}
        r = st.save(longer, state)
        assert r.parent_id == child.snapshot_id
        got = _restored(st, r, state)
        assert all(got[k].tobytes() == state[k].tobytes() for k in state)  # bytes: random fp16 holds NaNs
    c = apsw.Connection(db)
    assert c.pragma("user_version") == migrations_dir()[-1][0]
    pers = dict(c.execute("SELECT snapshot_id, group_concat(DISTINCT ifnull(tokens_per_row, 'null')) FROM parts "
                          "WHERE kind = 1 GROUP BY snapshot_id").fetchall())
    c.close()
    assert pers == {parent.snapshot_id: "null", child.snapshot_id: "null",
                    r.snapshot_id: str(layout.tokens_per_row or 1)}
