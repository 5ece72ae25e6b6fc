"""Issue 51 item 4, the restore side: a restore whose ``into`` is a callable plans once — one
read transaction, one plan check, the callable handed that plan's description (``load()`` goes the
same way) — and a destination the callable gets wrong is still refused before a byte is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import LAYOUT, make_state, open_store, save_chain
from support.statements import statements

import snapstore as ss
from snapstore.catalog.chain_cache import ChainCache
from snapstore.restore import read


def _dest(n: int) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, 7) for k, v in make_state(LAYOUT, n, 0).items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Byte-equal part by part (random float16 bytes hold NaNs)."""
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` (the real function still runs)."""
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("memo", [False, True])
def test_a_restore_with_a_callable_into_plans_once(store_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                   memo: bool) -> None:
    toks = np.arange(100, 100 + 300, dtype=np.int64)
    with open_store(store_dir) as s:
        sid = save_chain(s, toks, [40, 130, 300])
        if not memo:
            s._repo.plans = ChainCache(enabled=False)  # every plan is checked from the catalog
        want = s.describe(sid)
        checks = _counting(monkeypatch, read, "check_plan")
        seen: list[ss.MatchDetails] = []
        dst = _dest(300)

        def allocate(d: ss.MatchDetails) -> dict[str, np.ndarray]:
            seen.append(d)
            return dst

        with statements(s) as sql:
            res = s.restore(sid, allocate)
        assert seen == [want] and res.n_tokens == 300
        assert len(checks) == (0 if memo else 1)  # checked once (before: twice); the memo had it checked already
        assert sql.count("BEGIN") == 1  # one read transaction: the plan (before: describe's, then the restore's)
        full = make_state(LAYOUT, 300, 3)
        assert _same(dst, full)

        dst2 = _dest(300)
        with statements(s) as sql:
            got = s.load(toks, allocate=lambda d: dst2)
        assert got is not None and got.n_tokens == 300 and _same(dst2, full)
        assert len(checks) == (0 if memo else 2)
        assert sql.count("BEGIN") == 2  # match's read, then the one plan (before: match, describe, restore)


def test_a_callable_into_is_still_checked_before_a_byte_is_written(store: ss.Store) -> None:
    toks = np.arange(5, 5 + 200, dtype=np.int64)
    sid = save_chain(store, toks, [64, 200])
    bad = {k: np.full(v.shape, 7, np.int8) for k, v in _dest(200).items()}  # wrong dtype everywhere
    with pytest.raises(ss.DestinationError) as e:
        store.restore(sid, lambda d: bad)
    assert not e.value.touched and all((v == 7).all() for v in bad.values())
    with pytest.raises(ss.InvalidInputError, match="must return a mapping"):
        store.restore(sid, lambda d: [1])
    with pytest.raises(ss.InvalidInputError, match="into must be a mapping"):
        store.restore(sid, 42)  # type: ignore[arg-type]
    boom = RuntimeError("the engine is out of blocks")

    def fail(d: ss.MatchDetails) -> dict[str, np.ndarray]:
        raise boom

    with pytest.raises(RuntimeError) as r:
        store.restore(sid, fail)
    assert r.value is boom


