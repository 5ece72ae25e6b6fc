"""Write admission (issue 32, part 2): the write rate of ``Budget(write_bytes_per_hour=N)`` (a token
bucket in the catalog, shared by the store's processes) and ``Store.open(admit="second_hit")``
(a prefix written the second time a save of it is seen). Real stores and catalogs throughout."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import Conversation, Workload, store_factory

import snapstore as ss
from snapstore._tokens import TokenIndex
from snapstore.lifecycle.admission import Admission, WriteRate, sighting_key

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE_DIR = os.path.dirname(os.path.abspath(__file__))  # this module's folder: a child process imports it by name

ROW = ss.Rows("uint8", (128,))
LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (64,))}, rows={"kv": ROW})  # 256 B fixed, 128 B a row
open_store = store_factory(layout=LAY, staging_bytes=64 * 1024, check_rows=None)
WORKLOAD = Workload(LAY, conversations=64, max_tokens=600, levels=256)
COST_300 = 39360  # what a whole save of 300 tokens stores (38,656 bytes of state in 4 KiB chunks, raw)


def conv(k: int) -> Conversation:
    return WORKLOAD.conversation(k)


def budget(rate: int | None) -> ss.Budget:
    return ss.Budget(reserve_bytes=0, ram_bytes=0, write_bytes_per_hour=rate)


def bucket(s: ss.Store) -> tuple[float, float] | None:
    return s._repo.db.read(lambda t: t.write_bucket())


# -- the write rate ----------------------------------------------------------------------------
def test_saves_beyond_the_rate_are_skipped_counted_and_not_stored(store_dir: str) -> None:
    with open_store(store_dir, budget=budget(10_000)) as s:
        a, b = conv(0), conv(1)
        first = s.save(a.tokens[:300], a.state())  # a full bucket admits one save, which takes it into debt
        assert first.snapshot_id is not None and first.stored_bytes == COST_300
        level = bucket(s)
        assert level is not None and level[0] < 0
        second = s.save(b.tokens[:300], b.state())
        assert second.skipped == "write_budget" and second.snapshot_id is None
        assert s.match(b.tokens[:300]) is None
        st_ = s.stats()
        assert st_.skipped.get("write_budget") == 1
        assert st_.stored_bytes == COST_300


def test_the_bucket_refills_over_the_hour(store_dir: str) -> None:
    with open_store(store_dir, budget=budget(100_000)) as s:
        a, b = conv(2), conv(3)
        assert s.save(a.tokens[:300], a.state()).snapshot_id is not None
        for k in range(4, 7):  # 100,000 bytes of credit: two more saves, then none
            s.save(conv(k).tokens[:300], conv(k).state())
        assert s.save(b.tokens[:300], b.state()).skipped == "write_budget"
        state = bucket(s)
        assert state is not None
        level, at = state
        # an hour later (the bucket row's clock moved back an hour): full again, so admitted
        s._repo.db.write(lambda t: t.set_write_bucket(level, at - 3600))
        assert s.save(b.tokens[:300], b.state()).snapshot_id is not None


def test_dedup_hits_cost_nothing(store_dir: str) -> None:
    rate = 10_000_000
    with open_store(store_dir, budget=budget(rate)) as s:
        a = conv(8)
        t0 = time.time()
        state = a.state(300)
        s.save(a.tokens[:300], state)
        again = s.save(a.tokens[:300], state)  # the same snapshot: nothing new stored
        assert again.stored_bytes == 0
        held = bucket(s)
        assert held is not None
        drift = (time.time() - t0) * rate / 3600  # what the bucket refilled meanwhile
        assert rate - COST_300 - 1 <= held[0] <= rate - COST_300 + drift + 1


def test_the_bucket_is_shared_by_every_opener_of_the_store(store_dir: str) -> None:
    """Two opens are two owners of the catalog (as two processes are): one spends, both are refused."""
    with open_store(store_dir, budget=budget(10_000)) as one, open_store(store_dir, budget=budget(10_000)) as two:
        a, b = conv(9), conv(10)
        assert one.save(a.tokens[:300], a.state()).snapshot_id is not None
        assert two.save(b.tokens[:300], b.state()).skipped == "write_budget"


def test_the_rate_from_the_environment_and_checked(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTORE_WRITE_BYTES_PER_HOUR", "5000")
    assert ss.Budget().resolved().write_bytes_per_hour == 5000
    assert ss.Budget(write_bytes_per_hour=7).resolved().write_bytes_per_hour == 7  # the keyword wins
    monkeypatch.setenv("SNAPSTORE_WRITE_BYTES_PER_HOUR", "0")
    assert ss.Budget().resolved().write_bytes_per_hour is None  # 0: unlimited
    with pytest.raises(ss.ConfigError):
        ss.Budget(write_bytes_per_hour=-1)
    monkeypatch.setenv("SNAPSTORE_WRITE_BYTES_PER_HOUR", "lots")
    with pytest.raises(ss.ConfigError):
        ss.Budget().resolved()


# The rule against a model of it. The implementation keeps one level and refills it step by step
# (capped at the capacity); the model recomputes the level at each save from the whole history in
# closed form: the least, over every moment s up to now (the start, a save, or now), of the capacity plus
# the refill since s minus what was debited since s. Rates are whole bytes a second and times whole
# seconds, so both are exact in floating point.
def _model(cap: int, per_s: int, events: list[tuple[int, int]]) -> tuple[list[bool], list[int]]:
    times: list[int] = [0]
    admitted: list[bool] = []
    debits: list[int] = []
    levels: list[int] = []
    t = 0
    for dt, size in events:
        t += dt
        level = min(cap + per_s * (t - s) - sum(d for (u, d) in zip(times[1:], debits, strict=True) if u >= s)
                    for s in [*times, t])  # s = now: the capacity itself
        ok = level > 0
        admitted.append(ok)
        levels.append(level)
        times.append(t)
        debits.append(size if ok else 0)
    return admitted, levels


@pytest.fixture(scope="module")
def rate_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ss.Store]:
    s = open_store(str(tmp_path_factory.mktemp("rate")))
    yield s
    s.close()


@settings(max_examples=80, deadline=None)
@given(per_s=st.integers(1, 50), events=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 60_000)),
                                                 max_size=30))
def test_the_rate_rule_matches_its_model(rate_store: ss.Store, per_s: int, events: list[tuple[int, int]]) -> None:
    cap = per_s * 3600
    now = [1_000_000.0]
    rules = Admission(rate=WriteRate(cap), clock=lambda: now[0])
    db = rate_store._repo.db
    db.write(lambda t: t.set_write_bucket(cap, now[0]))  # a full bucket at the start
    got, levels = [], []
    for dt, size in events:
        now[0] += dt
        levels.append(rules.rate.level(db.read(lambda t: t.write_bucket()), now[0]))  # type: ignore[union-attr]
        over = db.write(rules.over_rate)
        got.append(not over)
        if not over:
            db.write(lambda t, n=size: rules.debit(t, n))  # type: ignore[misc]
    want, want_levels = _model(cap, per_s, events)
    assert levels == want_levels
    assert got == want
    # and the bound it promises: what was admitted over the whole run is at most the capacity, the
    # refill, and one save (the one that took the bucket into debt)
    total = sum(size for (_dt, size), ok in zip(events, got, strict=True) if ok)
    span = sum(dt for dt, _ in events)
    assert total <= cap + per_s * span + max((size for _, size in events), default=0)


# -- second hit --------------------------------------------------------------------------------
def test_second_hit_writes_a_prefix_the_second_time_it_is_seen(store_dir: str) -> None:
    with open_store(store_dir, admit="second_hit") as s:
        a = conv(11)
        first = s.save(a.tokens[:300], a.state())
        assert first.skipped == "first_sighting" and first.snapshot_id is None
        assert s.match(a.tokens[:300]) is None
        second = s.save(a.tokens[:300], a.state())
        assert second.snapshot_id is not None and second.stored_bytes == COST_300
        m = s.match(a.tokens[:400])
        assert m is not None and m.n_tokens == 300
        assert s.stats().skipped == {"first_sighting": 1}
        assert s._repo.db.read(lambda t: t.sighting_count()) == 0  # admitted: its sighting is forgotten


def test_second_hit_admits_a_sessions_own_chain(store_dir: str) -> None:
    with open_store(store_dir, admit="second_hit") as s:
        a = conv(12)
        r1 = s.save(a.tokens[:200], a.state(), session="chat-1")
        r2 = s.save(a.tokens[:400], a.state(), session="chat-1")
        assert r1.snapshot_id is not None and r2.snapshot_id is not None and r2.parent_id == r1.snapshot_id
        assert s.stats().skipped == {}


def test_second_hit_is_per_namespace_and_shared_by_openers(store_dir: str) -> None:
    with open_store(store_dir, admit="second_hit") as one, open_store(store_dir, admit="second_hit") as two:
        a = conv(13)
        assert one.save(a.tokens[:300], a.state(), namespace="x").skipped == "first_sighting"
        assert two.save(a.tokens[:300], a.state(), namespace="y").skipped == "first_sighting"  # another namespace
        assert two.save(a.tokens[:300], a.state(), namespace="x").snapshot_id is not None  # seen by `one`


def test_a_sighting_older_than_the_window_does_not_count(store_dir: str) -> None:
    with open_store(store_dir, admit="second_hit") as s:
        a = conv(14)
        assert s.save(a.tokens[:300], a.state()).skipped == "first_sighting"
        key = sighting_key(s.identity.key, "", TokenIndex(np.asarray(a.tokens[:300], dtype=np.int64)).prefix_key(300))
        s._repo.db.write(lambda t: t.record_sighting(key, time.time() - 3601))  # seen 61 minutes ago
        assert s.save(a.tokens[:300], a.state()).skipped == "first_sighting"
        assert s.save(a.tokens[:300], a.state()).snapshot_id is not None


def test_sightings_are_bounded_oldest_first(store_dir: str) -> None:
    with open_store(store_dir) as s:
        now = [1000.0]
        rules = Admission(mode="second_hit", window_s=100.0, max_sightings=10, clock=lambda: now[0])
        db = s._repo.db
        for k in range(30):
            now[0] += 1
            assert db.write(lambda t, k=k: rules.first_sighting(t, k))  # type: ignore[misc]
        assert db.read(lambda t: t.sighting_count()) == 10
        assert db.write(lambda t: rules.first_sighting(t, 29)) is False  # among the newest: kept, now admitted
        assert db.write(lambda t: rules.first_sighting(t, 5)) is True  # among the oldest: pruned
        now[0] += 1000  # past the window: every older sighting goes at the next insert
        assert db.write(lambda t: rules.first_sighting(t, 999)) is True
        assert db.read(lambda t: t.sighting_count()) == 1


def test_admit_mode_from_keyword_or_environment(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ss.ConfigError):
        open_store(store_dir, admit="sometimes")
    monkeypatch.setenv("SNAPSTORE_ADMIT", "second_hit")
    with open_store(store_dir) as s:
        a = conv(15)
        assert s.save(a.tokens[:300], a.state()).skipped == "first_sighting"
    with open_store(store_dir, admit="always") as s:  # the keyword wins
        b = conv(16)
        assert s.save(b.tokens[:300], b.state()).snapshot_id is not None
    monkeypatch.setenv("SNAPSTORE_ADMIT_WINDOW_S", "-3")
    with pytest.raises(ss.ConfigError):
        open_store(store_dir)


def test_the_rate_is_checked_before_a_sighting_is_recorded(store_dir: str) -> None:
    """A save the rate refuses is no sighting: it does not count toward the second hit."""
    with open_store(store_dir, admit="second_hit", budget=budget(10_000)) as s:
        a, b = conv(17), conv(18)
        s.save(a.tokens[:300], a.state(), session="s")  # spends the bucket
        assert s.save(b.tokens[:300], b.state()).skipped == "write_budget"
        assert s._repo.db.read(lambda t: t.sighting_count()) == 0
        state = bucket(s)
        assert state is not None
        s._repo.db.write(lambda t: t.set_write_bucket(state[0], state[1] - 4 * 3600))  # four hours on: full
        assert s.save(b.tokens[:300], b.state()).skipped == "first_sighting"



_CHILD = """
import os, sys
sys.path[:0] = sys.argv[2].split(os.pathsep)
import test_admission as m
with m.open_store(sys.argv[1], budget=m.budget(10_000), admit="second_hit") as s:
    c = m.conv(40)
    r = s.save(c.tokens[:300], c.state(), session="child")  # spends the bucket
    assert r.snapshot_id is not None, r
    assert s.save(m.conv(41).tokens[:300], m.conv(41).state()).skipped == "write_budget"
"""


def test_the_bucket_is_shared_with_another_process(store_dir: str) -> None:
    """A process that spent the bucket leaves it spent for the next one (the catalog row)."""
    import subprocess
    import sys

    here = TESTS_DIR
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    paths = os.pathsep.join([here, HERE_DIR])
    subprocess.run([sys.executable, "-c", _CHILD, store_dir, paths], check=True, env=env, timeout=120)
    with open_store(store_dir, budget=budget(10_000)) as s:
        c = conv(42)
        assert s.save(c.tokens[:300], c.state()).skipped == "write_budget"
        assert s.stats().skipped == {"write_budget": 2}
