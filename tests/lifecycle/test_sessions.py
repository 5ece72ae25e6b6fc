"""Sessions that fit chats (issue 14 item 4): a snapshot another session uses is detached from its
own session when that session supersedes it, never taken away; one only its session used is
superseded as before. Real SQLite, real files, a real second process for the restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import apsw
import numpy as np
import pytest
from conftest import IDENT, sha
from support.catalogs import UNDO_FIND_KEYS

import snapstore as ss
from snapstore.catalog.db import migrations_dir

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root
HERE_DIR = os.path.dirname(os.path.abspath(__file__))  # this module's folder: a child process imports it by name

LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (16,))}, rows={"kv": ss.Rows("uint8", (32,))})
ROOT = REPO_DIR


def open_store(path: str, **kw: Any) -> ss.Store:
    return ss.Store.open(path, identity=IDENT, layout=LAY, budget=kw.pop("budget", ss.Budget(reserve_bytes=0)),
                         chunk_bytes=4096, staging_bytes=64 * 1024, check_rows=True, **kw)


class Chat:
    """Token and K/V rows shared by every conversation up to ``shared`` tokens, then their own."""

    def __init__(self, seed: int, shared: int = 200, n: int = 2400):
        base = np.random.default_rng(0)
        own = np.random.default_rng(seed + 1)
        self.tokens = np.concatenate([base.integers(0, 1000, shared), own.integers(1000, 50_000, n - shared)])
        self.kv = np.concatenate([base.integers(0, 256, (shared, 32), dtype=np.uint8),
                                  own.integers(0, 256, (n - shared, 32), dtype=np.uint8)])

    def state(self, n: int) -> dict[str, np.ndarray]:
        """The state after ``n`` tokens: the recurrent part depends on exactly those tokens."""
        rec = np.random.default_rng(int(self.tokens[:n].sum()) + n).standard_normal(16).astype(np.float32)
        return {"rec": rec, "kv": self.kv[:n]}

    def save(self, s: ss.Store, n: int, session: str | None, **kw: Any) -> ss.SaveResult:
        r = s.save(self.tokens[:n], self.state(n), session=session, **kw)
        assert r.ok, r
        return r

    def restore(self, s: ss.Store, ref: Any, session: str | None = None) -> ss.RestoreResult:
        """Restore ``ref`` and check every byte against this chat's state at its length."""
        dest = {"rec": np.zeros(16, np.float32), "kv": np.zeros((len(self.kv), 32), np.uint8)}
        res = s.restore(ref, dest, session=session)
        want = self.state(res.n_tokens)
        assert sha(dest["rec"]) == sha(want["rec"])
        assert sha(dest["kv"][:res.n_tokens]) == sha(want["kv"])
        return res


def _matchable(s: ss.Store) -> dict[int, ss.SnapshotInfo]:
    return {x.snapshot_id: x for x in s.snapshots() if x.matchable and not x.pending}


# -- another session restores from it ------------------------------------------------------------
@pytest.mark.parametrize("y_session", ["Y", None], ids=["other-session", "session-less"])
def test_shared_prefix_restored_by_another_session_survives_the_next_turn(store_dir: str,
                                                                          y_session: str | None) -> None:
    """X saves the shared prefix P under its session; Y restores from P; X's next turn would
    supersede P — it is detached instead, and a third conversation Z still restores it whole."""
    x, y, z = Chat(1), Chat(2), Chat(3)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
        m = s.match(y.tokens[:500])
        assert m is not None and m.snapshot_id == p.snapshot_id
        y.restore(s, m, session=y_session)
        x.save(s, 600, "X")  # X's next turn: a strict extension of P in P's session
        m = s.match(z.tokens[:700])
        assert m is not None and m.snapshot_id == p.snapshot_id and m.n_tokens == 200
        z.restore(s, m)  # fixed parts kept: exact
        info = _matchable(s)[p.snapshot_id]
        assert info.session is None  # detached: an ordinary snapshot now
        st = s.stats()
        assert (st.supersedes, st.detached) == (0, 1)
        assert s.verify(deep=True).ok


def test_parent_of_another_sessions_snapshot_is_detached_not_superseded(store_dir: str) -> None:
    """Y never restored P, but its snapshot is a delta over P (parent='auto'): P stays for Z."""
    x, y, z = Chat(1), Chat(2), Chat(3)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
        q = y.save(s, 450, "Y")
        assert q.parent_id == p.snapshot_id
        x.save(s, 600, "X")
        m = s.match(z.tokens[:300])
        assert m is not None and m.snapshot_id == p.snapshot_id
        z.restore(s, m)
        y.restore(s, s.match(y.tokens[:500]), session="Y")  # Y's own snapshot restores as before
        assert s.stats().detached == 1


def test_same_state_saved_under_another_session_is_not_taken_from_it(store_dir: str) -> None:
    """Y saves exactly X's P (deduplicated onto X's snapshot): X's next turn must not drop what Y
    was told it saved."""
    x, y = Chat(1), Chat(2)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
        again = y.save(s, 200, "Y")
        assert again.snapshot_id == p.snapshot_id  # the same state: one snapshot
        x.save(s, 600, "X")
        y.restore(s, again, session="Y")
        assert s.stats().detached == 1


# -- only its own session used it ----------------------------------------------------------------
def test_snapshot_only_its_own_session_used_is_still_superseded(store_dir: str) -> None:
    x, z = Chat(1), Chat(3)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
        x.restore(s, s.match(x.tokens[:300]), session="X")  # its own session: not an outside use
        t2 = x.save(s, 600, "X")
        assert t2.parent_id == p.snapshot_id  # a child in its own session, on the new one's chain
        assert s.match(z.tokens[:300]) is None
        assert p.snapshot_id not in _matchable(s)
        st = s.stats()
        assert (st.supersedes, st.detached) == (1, 0)
        with pytest.raises(ss.SnapshotUnavailableError, match="superseded"):
            x.restore(s, p)


# -- regenerations: the 800-token scenario from the issue ---------------------------------------
def _chat_turns(s: ss.Store, c: Chat, prompt_key: Any) -> dict[str, ss.SaveResult]:
    """A shared root (no session), then two turns: each turn's prompt end saved under
    ``prompt_key(t)``, its reply end under the conversation's key; the engine restores with its
    session before each turn. Turn 2's user message is 800 tokens (1000 → 1800), its reply 200."""
    out = {"root": c.save(s, 200, None), "p1": c.save(s, 400, prompt_key(1)), "r1": c.save(s, 1000, "conv")}
    c.restore(s, s.match(c.tokens[:1800]), session="conv")
    out["p2"] = c.save(s, 1800, prompt_key(2))
    out["r2"] = c.save(s, 2000, "conv")
    return out


def test_regeneration_resumes_at_the_end_of_its_prompt(store_dir: str) -> None:
    """The engine.md recipe: prompt ends under a per-turn key, reply ends under the conversation's.
    Regenerating reply 2 resumes at 1800 (the end of its prompt), not 800 tokens earlier; and the
    conversation still keeps one matchable reply end (the per-turn key's child on the way to the
    new reply end is the conversation's own line, not another session's use)."""
    c = Chat(5)
    regen = np.concatenate([c.tokens[:1800], [60_001, 60_002]])  # prompt 2, then a different reply
    with open_store(store_dir) as s:
        saved = _chat_turns(s, c, lambda t: f"conv/t{t}")
        m = s.match(regen)
        assert m is not None and m.snapshot_id == saved["p2"].snapshot_id and m.n_tokens == 1800
        c.restore(s, m, session="conv")
        live = _matchable(s)
        assert saved["r1"].snapshot_id not in live and saved["r2"].snapshot_id in live
        st = s.stats()
        assert (st.supersedes, st.detached) == (1, 0)
    with open_store(os.path.join(store_dir, "naive")) as s:  # everything under the conversation's key
        _chat_turns(s, c, lambda t: "conv")
        m = s.match(regen)
        assert m is not None and m.n_tokens == 200  # only the shared root: 1600 tokens to read again


# -- pending captures, turns, and a restart in another process -----------------------------------
_CHILD = """
import sys, json
sys.path[:0] = {tests!r}
from test_sessions import Chat, open_store
x, y = Chat(1), Chat(2)
with open_store({d!r}) as s:
    p = x.save(s, 200, "X")
    y.restore(s, s.match(y.tokens[:500]), session="Y")
    print(json.dumps({{"p": p.snapshot_id}}))
"""


def test_rule_holds_after_a_restart_and_for_a_turn_commit(store_dir: str) -> None:
    """Another process records Y's restore of P and exits; here, a new Store commits X's next turn
    (a capture chain, committed root first) and P is still there for Z."""
    code = _CHILD.format(tests=[os.path.join(ROOT, "tests"), HERE_DIR], d=store_dir)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    p = json.loads(out.stdout.strip().splitlines()[-1])["p"]
    x, z = Chat(1), Chat(3)
    with open_store(store_dir) as s:
        with s.turn(session="X") as t:
            for n in (400, 600):
                t.capture(x.tokens[:n], x.state(n))
        assert t.result is not None and t.result.ok
        m = s.match(z.tokens[:300])
        assert m is not None and m.snapshot_id == p
        z.restore(s, m)
        assert s.stats().detached == 1


def test_commit_of_a_pending_capture_applies_the_rule(store_dir: str) -> None:
    x, y, z = Chat(1), Chat(2), Chat(3)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
        y.restore(s, p)  # a caller without a session
        c = x.save(s, 600, "X", commit=False)
        assert s.match(z.tokens[:300]).snapshot_id == p.snapshot_id  # pending: nothing superseded yet
        s.commit(c)
        assert s.match(z.tokens[:300]).snapshot_id == p.snapshot_id
        assert s.stats().detached == 1


def test_restore_session_is_validated(store_dir: str) -> None:
    x = Chat(1)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
        with pytest.raises(ss.InvalidInputError, match="session"):
            x.restore(s, p, session="")


# -- a catalog of schema v3 (before snapshots.shared) ---------------------------------------------
def test_v3_catalog_reads_read_only_and_migrates_on_open(store_dir: str) -> None:
    x, y, z = Chat(1), Chat(2), Chat(3)
    with open_store(store_dir) as s:
        p = x.save(s, 200, "X")
    db = os.path.join(store_dir, "snapstore.db")
    c = apsw.Connection(db)
    c.execute(UNDO_FIND_KEYS + "DROP TABLE row_prefixes; ALTER TABLE snapshots DROP COLUMN shared; "
              "ALTER TABLE parts DROP COLUMN tokens_per_row; PRAGMA user_version = 3")
    c.close()
    env = dict(os.environ, PYTHONPATH=ROOT)
    for cmd in (["inspect", "--json"], ["stats", "--json"], ["verify", "--json"]):
        out = subprocess.run([sys.executable, "-m", "snapstore", "--dir", store_dir, *cmd], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])
    c = apsw.Connection(db)
    assert c.pragma("user_version") == 3  # read-only: nothing migrated
    c.close()
    with open_store(store_dir) as s:
        y.restore(s, s.match(y.tokens[:500]), session="Y")
        x.save(s, 600, "X")
        assert s.match(z.tokens[:300]).snapshot_id == p.snapshot_id
    c = apsw.Connection(db)
    assert c.pragma("user_version") == migrations_dir()[-1][0]  # every migration since (0004 shared, ...)
    c.close()
