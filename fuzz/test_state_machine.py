"""A Hypothesis state machine that drives the real store against a simple reference model.

Rules: save (auto parent / explicit parent / none, committed or pending, sessions), commit,
abandon, match, restore, reopen, gc. After every step the invariants are checked: accounting
exact (catalog == chunk files on disk == counters), no snapshot with children ever disappears
(pins), budgets never exceeded, supersede leaves no matchable prefix in a session, match returns
the longest matchable prefix, and every matchable snapshot restores byte-exact.

CI runs a short budget; ``SNAPSTORE_FUZZ_EXAMPLES=500`` runs longer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import snapstore as ss

IDENT = ss.Identity(build="fuzz-1", pack="sha256:f")
LAYOUT = ss.Layout(fixed={"rec": ss.Fixed("uint8", (200,))}, rows={"kv": ss.Rows("uint8", (96,)),
                                                                  "d": ss.Rows("uint8", (8,), component="draft")})
MAXT = 400
CONVS = 4
_rng = np.random.default_rng(1234)
TOKENS = [_rng.integers(0, 1000, MAXT) + 10_000 * i for i in range(CONVS)]
TOKENS[1][:100] = TOKENS[0][:100]  # conversations 0 and 1 share a prefix: branches
KV = [_rng.integers(0, 256, (MAXT, 96), dtype=np.uint8) for _ in range(CONVS)]
KV[1][:100] = KV[0][:100]
DR = [_rng.integers(0, 256, (MAXT, 8), dtype=np.uint8) for _ in range(CONVS)]
DR[1][:100] = DR[0][:100]


@dataclass
class Snap:
    conv: int
    n: int
    fixed: bytes
    session: str | None
    pending: bool
    order: int = 0  # when it was committed: supersede looks at what was committed before


def _sha(b: bytes | np.ndarray) -> str:
    return hashlib.sha256(bytes(b) if isinstance(b, bytes) else np.ascontiguousarray(b).tobytes()).hexdigest()


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ss-fuzz-")
        self.model: dict[int, Snap] = {}
        self.draft_of: dict[int, bool] = {}
        self.clock = 0
        self.store: ss.Store | None = None

    @initialize(disk=st.integers(30_000, 200_000), entries=st.none() | st.integers(2, 8),
                codec=st.sampled_from(["raw", "zstd"]))
    def start(self, disk: int, entries: int | None, codec: str) -> None:
        self.budget = ss.Budget(disk_bytes=disk, max_entries=entries, reserve_bytes=0, ram_bytes=1 << 20)
        self.codec = codec
        self._open()

    def _open(self) -> None:
        self.store = ss.Store.open(self.dir, identity=IDENT, layout=LAYOUT, budget=self.budget,
                                   chunk_bytes=4096, staging_bytes=32768, codec=self.codec, check_rows=True)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules -------------------------------------------------------------------------------
    @rule(conv=st.integers(0, CONVS - 1), n=st.integers(1, MAXT), session=st.sampled_from([None, "s0", "s1"]),
          commit=st.booleans(), parent=st.sampled_from(["auto", None, "explicit"]), draft=st.booleans(),
          seed=st.integers(0, 2**16))
    def save(self, conv: int, n: int, session: str | None, commit: bool, parent: str | None, draft: bool,
             seed: int) -> None:
        assert self.store is not None
        fixed = np.random.default_rng(seed).integers(0, 256, 200, dtype=np.uint8)
        parts = {"rec": fixed, "kv": KV[conv]}
        if draft:
            parts["d"] = DR[conv]
        par: object = parent
        if parent == "explicit":
            m = self.store.match(TOKENS[conv][:n])
            par = m.snapshot_id if m is not None and m.n_tokens < n else None
        try:
            r = self.store.save(TOKENS[conv][:n], parts, session=session, commit=commit, parent=par)
        except ss.LayoutError:
            # explicit parent saved with the draft component, this save without it (or the reverse)
            assert parent == "explicit"
            return
        if r.snapshot_id is None:
            assert r.skipped in ("larger_than_budget", "disk_budget", "max_entries", "disk_full")
            return
        if r.snapshot_id in self.model:  # the same state again: deduplicated to the existing snapshot
            return
        self.clock += 1
        self.model[r.snapshot_id] = Snap(conv, n, fixed.tobytes(), session, not commit, self.clock)
        self.draft_of[r.snapshot_id] = draft

    @precondition(lambda self: any(s.pending for s in self.model.values()))
    @rule(data=st.data(), commit=st.booleans())
    def finish_pending(self, data: st.DataObject, commit: bool) -> None:
        assert self.store is not None
        live = {x.snapshot_id for x in self.store.snapshots()}
        pend = sorted(i for i, s in self.model.items() if s.pending and i in live)
        if not pend:
            return
        sid = data.draw(st.sampled_from(pend))
        if commit:
            r = self.store.commit(sid)
            if r.snapshot_id is not None:
                self.clock += 1
                for x in self.store.snapshots():
                    if x.snapshot_id in self.model and not x.pending and self.model[x.snapshot_id].pending:
                        self.model[x.snapshot_id].pending = False
                        self.model[x.snapshot_id].order = self.clock
        else:
            self.store.abandon(sid)

    @rule(conv=st.integers(0, CONVS - 1), n=st.integers(1, MAXT))
    def match(self, conv: int, n: int) -> None:
        assert self.store is not None
        q = TOKENS[conv][:n]
        m = self.store.match(q)
        live = [x for x in self.store.snapshots() if x.matchable and not x.pending]
        best = max((self.model[x.snapshot_id].n for x in live
                    if self.model[x.snapshot_id].n <= n and np.array_equal(
                        TOKENS[self.model[x.snapshot_id].conv][:self.model[x.snapshot_id].n],
                        q[:self.model[x.snapshot_id].n])), default=None)
        if best is None:
            assert m is None
        else:
            assert m is not None and m.n_tokens == best

    @rule()
    def reopen(self) -> None:
        assert self.store is not None
        self.store.close()
        self._open()
        live = {x.snapshot_id for x in self.store.snapshots()}
        for sid in [i for i, s in self.model.items() if s.pending]:
            assert sid not in live  # close() abandons this process's pending captures

    @rule()
    def gc(self) -> None:
        assert self.store is not None
        self.store.gc(grace=0)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.store is None:
            return
        s = self.store
        infos = s.snapshots()
        ids = {x.snapshot_id for x in infos}
        assert ids <= set(self.model), "a snapshot the model never saw"
        # pins: a snapshot that had a live child never disappears while the child lives
        for x in infos:
            if x.parent_id is not None:
                assert x.parent_id in ids, "parent evicted under a live child"
        # budget never exceeded
        stats = s.stats()
        assert stats.stored_bytes <= (self.budget.disk_bytes or 0)
        if self.budget.max_entries is not None:
            assert stats.entries <= self.budget.max_entries
        # accounting exact: counter == catalog == files referenced on disk
        repo = s._repo
        rows = repo.db.read(lambda c: [(bytes(r[0]), r[1], r[2]) for r in c.execute(
            "SELECT id, stored_len, refs FROM chunks")])
        assert sum(r[1] for r in rows) == stats.stored_bytes
        assert repo.db.read(lambda c: c.execute("SELECT value FROM counters WHERE name='stored_bytes'"
                                                ).fetchone() or (0,))[0] == stats.stored_bytes
        for cid, size, refs in rows:
            assert refs > 0
            assert os.path.getsize(repo.blob_path(cid)) == size
        assert stats.logical_bytes == sum(x.logical_bytes for x in infos if x.matchable)
        # supersede: no matchable snapshot is a strict prefix of one committed later in its session
        live = [x for x in infos if x.matchable and not x.pending]
        for a in live:
            for b in live:
                ma, mb = self.model[a.snapshot_id], self.model[b.snapshot_id]
                if a.session is not None and a.session == b.session and ma.n < mb.n and ma.order < mb.order:
                    assert not np.array_equal(TOKENS[ma.conv][:ma.n], TOKENS[mb.conv][:ma.n])
        # every matchable snapshot restores exactly
        for x in live:
            snap = self.model[x.snapshot_id]
            dest = {"rec": np.zeros(200, np.uint8), "kv": np.zeros((MAXT, 96), np.uint8),
                    "d": np.zeros((MAXT, 8), np.uint8)}
            r = s.restore(x.snapshot_id, dest)
            assert r.n_tokens == snap.n
            assert dest["rec"].tobytes() == snap.fixed
            assert _sha(dest["kv"][:snap.n]) == _sha(KV[snap.conv][:snap.n])
            if self.draft_of.get(x.snapshot_id):
                assert "draft" not in r.missing_components
                assert _sha(dest["d"][:snap.n]) == _sha(DR[snap.conv][:snap.n])
            else:
                assert r.missing_components == frozenset({"draft"})


StoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("SNAPSTORE_FUZZ_EXAMPLES", "25")),
    stateful_step_count=int(os.environ.get("SNAPSTORE_FUZZ_STEPS", "30")),
    deadline=None,
)
TestStoreMachine = StoreMachine.TestCase
