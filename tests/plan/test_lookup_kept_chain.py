"""Issue 48 item 2: a lookup checks a candidate whose chain the plan memo keeps against the kept rows
(every token, root to leaf) instead of two catalog statements — and decides exactly as the catalog's
own check does.

- a lookup of a kept snapshot runs five statements: BEGIN, the candidates, the generation, the
  quarantined chunks' users, COMMIT — no chain walk, no re-read of the hit's row (seven before);
- a find-key collision (every key forced equal) puts a sibling first whose own tokens match the
  prompt but whose links below do not: the kept check passes over it, as the SQL check does, and
  the lookup answers the snapshot that spells the prompt;
- a chain whose links are stored in two token widths (a token >= 2**31 in the leaf's own segment)
  is compared link by link; a prompt that differs from it only there, in the high bits an int32
  compare would wrap, is not its prefix;
- a deleted snapshot moves the generation: the next lookup reads no kept row of it and finds the
  next-longest prefix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.statements import statements

import snapstore as ss
from snapstore.catalog import find_keys

LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16))})
IDENT = ss.Identity(build="t", pack="p", kv="u8")
SEG = 300  # tokens per link: past one find-key block (256), so the leaf's own segment is compared alone


def _open(path: Any) -> ss.Store:
    return ss.Store.open(str(path), identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0, ram_bytes=0))


def _save_chain(s: ss.Store, tokens: list[int], seed: int) -> int:
    kv = np.random.default_rng(seed).integers(0, 256, (len(tokens), 2, 16), dtype=np.uint8)
    assert s.save(tokens[:SEG], {"kv": kv}, rows=SEG, parent=None).ok
    res = s.save(tokens, {"kv": kv}, rows=len(tokens), parent="auto")
    assert res.ok and res.snapshot_id is not None
    return res.snapshot_id


def test_a_lookup_of_a_kept_chain_reads_no_link_of_it(tmp_path: Any) -> None:
    tokens = [*range(10, 10 + SEG), *range(5000, 5000 + SEG)]
    with _open(tmp_path / "s") as s:
        leaf = _save_chain(s, tokens, 1)
        for weighed in (None, 1000.0):
            s.lookup(tokens, prefill_tokens_per_s=weighed)  # planned, kept
            with statements(s) as seen:
                d = s.lookup(tokens, prefill_tokens_per_s=weighed)
            assert d is not None and d.snapshot_id == leaf
            assert len(seen) == 5, seen
            assert seen[2] == "SELECT nonce, gen FROM catalog_gen WHERE id = 1", seen
            assert not any(q.startswith(("WITH RECURSIVE", "SELECT id, identity_id")) for q in seen), seen


def test_a_kept_sibling_that_differs_below_its_own_segment_is_passed_over(tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # every find key equal: each snapshot of a length is a candidate for every prompt of that length
    monkeypatch.setattr(find_keys, "_chained", lambda key, tokens: [find_keys.FIND_SEED] * (len(tokens) // 256 + 1))
    own = list(range(5000, 5000 + SEG))
    right = [*range(10, 10 + SEG), *own]
    wrong = [*range(20, 20 + SEG), *own]  # the same own segment over another root
    with _open(tmp_path / "s") as s:
        good = _save_chain(s, right, 1)
        bad = _save_chain(s, wrong, 2)  # the newer: the first candidate of its length
        for sid in (good, bad):
            s.describe(sid)  # planned: both chains kept in the memo
        assert s._repo.plans.enabled
        s.lookup(right)
        with statements(s) as seen:
            d = s.lookup(right)
        assert d is not None and d.snapshot_id == good and d.n_tokens == len(right)
        assert not any(q.startswith("WITH RECURSIVE") for q in seen), seen  # decided from the kept rows
        m = s.match(right)  # the catalog's own check agrees
        assert m is not None and m.snapshot_id == good


def test_a_kept_chain_of_two_token_widths_is_compared_link_by_link(tmp_path: Any) -> None:
    wide = 2**31 + 7
    tokens = [*range(10, 10 + SEG), *range(5000, 5000 + SEG - 1), wide]  # root int32, leaf int64
    with _open(tmp_path / "s") as s:
        leaf = _save_chain(s, tokens, 1)
        s.describe(leaf)  # kept
        with statements(s) as seen:
            d = s.lookup(tokens)
        assert d is not None and d.snapshot_id == leaf and d.n_tokens == len(tokens)
        assert not any(q.startswith("WITH RECURSIVE") for q in seen), seen
        d = s.lookup([*tokens[:-1], wide - 2**31])  # the same low 32 bits
        assert d is not None and d.snapshot_id != leaf and d.n_tokens == SEG


def test_a_deleted_kept_snapshot_is_never_the_answer(tmp_path: Any) -> None:
    tokens = [*range(10, 10 + SEG), *range(5000, 5000 + SEG)]
    with _open(tmp_path / "s") as s:
        leaf = _save_chain(s, tokens, 1)
        d = s.lookup(tokens)
        assert d is not None and d.snapshot_id == leaf  # planned and kept
        s.delete(leaf)
        d = s.lookup(tokens)
        assert d is not None and d.snapshot_id != leaf and d.n_tokens == SEG
