"""The shared test support keeps the promises other tests build on: the workload is a pure function
of (conversation, tokens, turn) with prefix-stable rows, and the store factory's settings layer
as documented (defaults < factory settings < per-call options)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import DEFAULTS, IDENT, LAYOUT, Workload, open_store, store_factory

import snapstore as ss


def test_workload_is_deterministic_and_rows_are_prefix_stable() -> None:
    a, b = Workload(LAYOUT), Workload(LAYOUT)  # two instances: nothing depends on call history
    for k in range(a.conversations):
        assert a.tokens(k)[0] == k and np.array_equal(a.tokens(k), b.tokens(k))
        long_, short = a.state(k, 300), b.state(k, 40)
        for name in LAYOUT.rows:  # a delta over any prefix is a valid delta
            assert long_[name].shape[0] == 300 and short[name].shape[0] == 40
            assert long_[name][:40].tobytes() == short[name].tobytes()
        assert {n: v.tobytes() for n, v in a.state(k, 40).items()} == {n: v.tobytes() for n, v in short.items()}


def test_a_later_turn_changes_fixed_parts_only() -> None:
    w = Workload(LAYOUT)
    t0, t1 = w.state(2, 64), w.state(2, 64, turn=1)
    for name in LAYOUT.fixed:
        assert t0[name].tobytes() != t1[name].tobytes()
    for name in LAYOUT.rows:
        assert t0[name].tobytes() == t1[name].tobytes()
    conv = w.conversation(2)
    first, second = conv.state(64), conv.state(64)
    assert conv.turn == 2 and all(first[n].tobytes() != second[n].tobytes() for n in LAYOUT.fixed)


def test_states_are_fresh_and_rows_read_only() -> None:
    w = Workload(LAYOUT)
    s = w.state(0, 10)
    for v in s.values():
        v[...] = 0  # a caller may scribble on its state (wait=False saves do) ...
    assert any(v.any() for v in w.state(0, 10).values())  # ... without changing the model
    with pytest.raises(ValueError):
        w.rows(0)["attn.kv"][0] = 0


def test_identify_inverts_tokens() -> None:
    w = Workload(LAYOUT, conversations=3, max_tokens=50)
    assert w.identify(w.tokens(1)[:17]) == (1, 17)
    assert w.identify(w.tokens(1)[:0]) is None
    bad = w.tokens(1)[:17].copy()
    bad[-1] += 1
    assert w.identify(bad) is None
    assert w.identify(Workload(LAYOUT, max_tokens=50).tokens(4)[:5]) is None  # not one of its 3 conversations


def _settings(s: ss.Store) -> dict[str, Any]:
    return {"chunk_bytes": s.chunk_bytes, "check_rows": s.check_rows, "layout": s.layout, "identity": s.identity}


def test_store_factory_layers_defaults_settings_and_options(tmp_path: Any) -> None:
    with open_store(tmp_path / "a") as s:
        assert _settings(s) == {k: DEFAULTS[k] for k in ("chunk_bytes", "check_rows", "layout", "identity")}
    other = ss.Identity(build="support-test", pack="sha256:1")
    opener = store_factory(identity=other, chunk_bytes=8192)
    with opener(tmp_path / "b") as s:
        assert (s.identity, s.chunk_bytes, s.check_rows) == (other, 8192, True)
    with opener(tmp_path / "c", chunk_bytes=16384, disk=1 << 20) as s:  # per-call options win
        assert (s.identity, s.chunk_bytes) == (other, 16384)
        assert s.stats().disk_budget == 1 << 20
    assert IDENT != other
