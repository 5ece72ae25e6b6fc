"""Integrity checks an engine can run on its own integration (needs the ``testing`` extra: hypothesis).

As ``zarr.testing`` ships its store tests, this module ships snapstore's: Hypothesis strategies for
layouts, token sequences and states, and :class:`StoreStateMachine`, a rule-based state machine
that drives an engine's save/restore callables against a reference model through chains,
branches, pending captures, restarts, gc and evictions, and checks after every step that

- every matchable snapshot restores byte-exact (fixed parts whole, the valid rows of every stream),
- ``match()`` returns the longest committed, matchable prefix the model knows of,
- a snapshot with a live child never disappears (pins), budgets are never exceeded,
- supersede leaves no matchable strict prefix in a session, and never takes away a snapshot
  restored from outside its session (it is detached instead), ``verify()`` finds no damage.

Wire an engine in a few lines (docs/engine.md)::

    class MyEngine(snapstore.testing.NumpyEngine):
        def save(self, store, tokens, state, **kw):      # state: part name -> raw bytes (np.uint8)
            load_into_my_engine(state); return my_integration.save(store, tokens, **kw)
        def restore(self, store, ref, session=None):      # -> (RestoreResult, part name -> bytes)
            res = my_integration.restore(store, ref, session=session); return res, read_back_from_my_engine()

    TestMyEngine = snapstore.testing.StoreStateMachine.for_engine(MyEngine(layout)).TestCase
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from snapstore._config import Budget
from snapstore._errors import LayoutError
from snapstore._identity import Identity
from snapstore._layout import Fixed, Layout, Rows
from snapstore._results import RestoreResult, SaveResult
from snapstore._store import Store

__all__ = ["DTYPES", "NumpyEngine", "StoreStateMachine", "Workload", "layouts", "states", "token_sequences"]

#: dtypes a layout may name (bfloat16 and float8 are stored as raw bytes by numpy-only engines)
DTYPES = ("uint8", "int16", "float16", "bfloat16", "float32", "int64", "float8_e4m3fn", "float64")
_names = st.text(alphabet="abcdefghij._", min_size=1, max_size=8)
_small_shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
_row_shape = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@st.composite
def layouts(draw: st.DrawFn, max_fixed: int = 2, max_rows: int = 3) -> Layout:
    """A layout with 0..max_fixed fixed parts and 1..max_rows row streams, maybe a draft component."""
    fixed_names = draw(st.lists(_names, max_size=max_fixed, unique=True))
    row_names = draw(st.lists(_names.filter(lambda n: n not in fixed_names), min_size=1, max_size=max_rows,
                              unique=True))
    fixed = {n: Fixed(draw(st.sampled_from(DTYPES)), draw(_small_shape)) for n in fixed_names}
    rows = {}
    for i, n in enumerate(row_names):
        comp = "draft" if i > 0 and draw(st.booleans()) else None
        rows[n] = Rows(draw(st.sampled_from(DTYPES)), draw(_row_shape), component=comp)
    return Layout(fixed=fixed, rows=rows)


def token_sequences(min_size: int = 1, max_size: int = 700) -> st.SearchStrategy[list[int]]:
    """Token sequences, including ids that need 64 bits (stored as int64 then)."""
    return st.lists(st.integers(0, 2**31 + 5), min_size=min_size, max_size=max_size)


@st.composite
def states(draw: st.DrawFn, layout: Layout, n: int) -> dict[str, np.ndarray]:
    """A state of ``layout`` after ``n`` tokens, as raw bytes: fixed parts whole, streams of n rows."""
    out: dict[str, np.ndarray] = {}
    for name, spec in layout.parts.items():
        size = spec.nbytes if isinstance(spec, Fixed) else n * spec.row_bytes
        out[name] = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8).copy()
    return out


class Workload:
    """Deterministic conversations over a layout; rows depend only on (conversation, row), so a delta
    over any saved prefix is valid, and conversations 0 and 1 share a prefix (branches)."""

    def __init__(self, layout: Layout, *, conversations: int = 4, max_tokens: int = 400, shared: int = 100,
                 seed: int = 1234):
        rng = np.random.default_rng(seed)
        self.layout, self.conversations, self.max_tokens = layout, conversations, max_tokens
        self.tokens = [rng.integers(0, 1000, max_tokens) + 10_000 * i for i in range(conversations)]
        self.rows = [{name: rng.integers(0, 256, max_tokens * spec.row_bytes, dtype=np.uint8)
                      for name, spec in layout.rows.items()} for _ in range(conversations)]
        if conversations > 1:
            self.tokens[1][:shared] = self.tokens[0][:shared]
            for name, spec in layout.rows.items():
                self.rows[1][name][:shared * spec.row_bytes] = self.rows[0][name][:shared * spec.row_bytes]

    def state(self, conv: int, fixed_seed: int) -> dict[str, np.ndarray]:
        """Every part of conversation ``conv`` as raw bytes (streams hold max_tokens rows)."""
        rng = np.random.default_rng(fixed_seed)
        out = {name: rng.integers(0, 256, spec.nbytes, dtype=np.uint8) for name, spec in self.layout.fixed.items()}
        out.update(self.rows[conv])
        return out

    def expected(self, conv: int, n: int, fixed_seed: int, components: set[str | None]) -> dict[str, bytes]:
        """What a restore of (conv, n) must produce: fixed parts whole, the first n rows of streams."""
        full = self.state(conv, fixed_seed)
        out: dict[str, bytes] = {}
        for name, spec in self.layout.parts.items():
            if spec.component not in components:
                continue
            out[name] = full[name].tobytes() if isinstance(spec, Fixed) else \
                full[name][:n * spec.row_bytes].tobytes()
        return out


class NumpyEngine:
    """The reference engine: raw numpy buffers straight through ``Store.save`` / ``Store.restore``.

    Subclass it and override ``save``/``restore`` (and ``open`` for store options) to drive an
    engine's own integration; the state machine only ever calls these three.
    """

    def __init__(self, layout: Layout, identity: Identity | None = None, *, chunk_bytes: int = 4096,
                 staging_bytes: int = 32768, max_rows: int = 4096):
        self.layout, self.max_rows = layout, max_rows
        self.identity = identity or Identity(build="snapstore-testing", pack="sha256:0")
        self.chunk_bytes, self.staging_bytes = chunk_bytes, staging_bytes

    def open(self, path: str, *, budget: Budget, codec: str) -> Store:
        """Open the store the machine drives (row checks on: the vouching is verified)."""
        return Store.open(path, identity=self.identity, layout=self.layout, budget=budget, codec=codec,
                          chunk_bytes=self.chunk_bytes, staging_bytes=self.staging_bytes, check_rows=True)

    def save(self, store: Store, tokens: np.ndarray, state: Mapping[str, np.ndarray], **kw: Any) -> SaveResult:
        """Save ``state`` (part name -> raw bytes; streams hold at least len(tokens) rows)."""
        res: SaveResult = store.save(tokens, dict(state), **kw)
        return res

    def restore(self, store: Store, ref: Any, session: str | None = None) -> tuple[RestoreResult, dict[str, bytes]]:
        """Restore ``ref`` as ``session``; return the result and each restored part's valid bytes."""
        dest = {name: np.zeros(spec.nbytes if isinstance(spec, Fixed) else spec.row_bytes * self.max_rows, np.uint8)
                for name, spec in self.layout.parts.items()}
        res = store.restore(ref, dest, session=session)
        out: dict[str, bytes] = {}
        for name, spec in self.layout.parts.items():
            if spec.component in res.missing_components:
                continue
            out[name] = dest[name].tobytes() if isinstance(spec, Fixed) else \
                dest[name][:res.rows[name] * spec.row_bytes].tobytes()
        return res, out


@dataclass
class _Saved:
    conv: int
    n: int
    fixed_seed: int
    session: str | None
    pending: bool
    components: frozenset[str | None]
    order: int = 0  # when it was committed: supersede looks at what was committed before
    shared: bool = False  # restored from outside its session: supersede must never take it away


def _digest(parts: Mapping[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in parts.items()}


class StoreStateMachine(RuleBasedStateMachine):
    """Drives ``engine`` (a :class:`NumpyEngine` or subclass) against a reference model.

    Use :meth:`for_engine` to bind an engine; ``.TestCase`` is then a unittest/pytest test.
    """

    engine: NumpyEngine
    workload: Workload
    codecs: tuple[str, ...] = ("raw", "zstd")
    # the engine's restore takes session=: the invariants' restores speak as the snapshot's own
    # session, so checking a snapshot is no outside use (an engine without it: every check is one)
    observe_as_session: bool = False

    @classmethod
    def for_engine(cls, engine: NumpyEngine, *, workload: Workload | None = None,
                   codecs: tuple[str, ...] | None = None) -> type[StoreStateMachine]:
        """A machine class bound to ``engine`` (and a workload over its layout)."""
        work = workload or Workload(engine.layout)
        if work.max_tokens > engine.max_rows:
            raise ValueError(f"the workload needs {work.max_tokens} rows, the engine restores {engine.max_rows}")
        params = inspect.signature(engine.restore).parameters
        observe = "session" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        attrs: dict[str, Any] = {"engine": engine, "workload": work, "codecs": codecs or cls.codecs,
                                 "observe_as_session": observe}
        return type(f"{cls.__name__}For{type(engine).__name__}", (cls,), attrs)

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="snapstore-testing-")
        self.model: dict[int, _Saved] = {}
        self.clock = 0
        self.store: Store | None = None
        self.budget = Budget(reserve_bytes=0)
        self.codec = "raw"
        self.draft = {n for n, s in self.engine.layout.parts.items() if s.component is not None}
        self._shared_live: set[int] = set()  # restored from outside their session, live at the last check
        self._evictions = 0

    @initialize(disk=st.integers(30_000, 200_000), entries=st.none() | st.integers(2, 8), data=st.data())
    def start(self, disk: int, entries: int | None, data: st.DataObject) -> None:
        self.budget = Budget(disk_bytes=disk, max_entries=entries, reserve_bytes=0, ram_bytes=1 << 20)
        self.codec = data.draw(st.sampled_from(self.codecs), label="codec")
        self.store = self.engine.open(self.dir, budget=self.budget, codec=self.codec)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _live(self) -> dict[int, Any]:
        assert self.store is not None
        return {x.snapshot_id: x for x in self.store.snapshots()}

    # -- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), session=st.sampled_from([None, "s0", "s1"]), commit=st.booleans(),
          parent=st.sampled_from(["auto", None, "explicit"]), with_draft=st.booleans(), seed=st.integers(0, 2**16))
    def save(self, data: st.DataObject, session: str | None, commit: bool, parent: str | None,
             with_draft: bool, seed: int) -> None:
        assert self.store is not None
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = data.draw(st.integers(1, w.max_tokens), label="n")
        state = w.state(conv, seed)
        if not with_draft:
            for name in self.draft:
                state.pop(name)
        par: Any = parent
        if parent == "explicit":
            m = self.store.match(w.tokens[conv][:n])
            par = m.snapshot_id if m is not None and m.n_tokens < n else None
        try:
            r = self.engine.save(self.store, w.tokens[conv][:n], state, session=session, commit=commit, parent=par)
        except LayoutError:
            assert parent == "explicit", "only an explicit parent with other components may be refused"
            return
        self._record(r, conv, n, seed, session, commit, state)

    def _record(self, r: SaveResult, conv: int, n: int, seed: int, session: str | None, commit: bool,
                state: Mapping[str, Any]) -> None:
        if r.snapshot_id is None:
            assert r.skipped, "a save with no id must say why it was skipped"
            return
        if r.snapshot_id in self.model:  # the same state again: deduplicated onto the stored one
            return
        self.clock += 1
        comps = frozenset({s.component for k, s in self.engine.layout.parts.items() if k in state})
        self.model[r.snapshot_id] = _Saved(conv, n, seed, session, not commit, comps, self.clock)

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def next_turn(self, data: st.DataObject, seed: int) -> None:
        """A session's conversation goes on: a longer prefix of it, committed in the same session
        (so supersede runs, often over a snapshot ``restore_elsewhere`` used from outside)."""
        assert self.store is not None
        w = self.workload
        going = sorted(i for i, x in self._live().items() if x.matchable and not x.pending
                       and x.session is not None and self.model[i].n < w.max_tokens)
        if not going:
            return
        sid = data.draw(st.sampled_from(going), label="turn of")
        saved, session = self.model[sid], self._live()[sid].session
        n = data.draw(st.integers(saved.n + 1, w.max_tokens), label="n")
        state = w.state(saved.conv, seed)
        r = self.engine.save(self.store, w.tokens[saved.conv][:n], state, session=session, commit=True,
                             parent="auto")
        self._record(r, saved.conv, n, seed, session, True, state)

    @precondition(lambda self: any(s.pending for s in self.model.values()))
    @rule(data=st.data(), commit=st.booleans())
    def finish_pending(self, data: st.DataObject, commit: bool) -> None:
        assert self.store is not None
        live = self._live()
        pend = sorted(i for i, s in self.model.items() if s.pending and i in live)
        if not pend:
            return
        sid = data.draw(st.sampled_from(pend), label="pending")
        if not commit:
            self.store.abandon(sid)
            return
        if self.store.commit(sid).snapshot_id is not None:
            self.clock += 1
            for x in self.store.snapshots():
                saved = self.model.get(x.snapshot_id)
                if saved is not None and saved.pending and not x.pending:
                    saved.pending, saved.order = False, self.clock

    @rule(data=st.data(), session=st.sampled_from([None, "s0", "s1"]))
    def restore_elsewhere(self, data: st.DataObject, session: str | None) -> None:
        """Another conversation (or a caller without a session) restores a session's snapshot."""
        assert self.store is not None
        outside = sorted(i for i, x in self._live().items()
                         if x.matchable and not x.pending and x.session is not None and x.session != session)
        if not outside:
            return
        sid = data.draw(st.sampled_from(outside), label="snapshot")
        self._restore(sid, session)
        self.model[sid].shared = True

    def _restore(self, sid: int, session: str | None) -> tuple[RestoreResult, dict[str, bytes]]:
        assert self.store is not None
        if self.observe_as_session:
            return self.engine.restore(self.store, sid, session=session)
        return self.engine.restore(self.store, sid)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        assert self.store is not None
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        q = w.tokens[conv][:data.draw(st.integers(1, w.max_tokens), label="n")]
        m = self.store.match(q)
        best = max((self.model[i].n for i, x in self._live().items() if x.matchable and not x.pending
                    and self.model[i].n <= len(q)
                    and np.array_equal(w.tokens[self.model[i].conv][:self.model[i].n], q[:self.model[i].n])),
                   default=None)
        assert (m.n_tokens if m is not None else None) == best, "match() is not the longest saved prefix"

    @rule()
    def reopen(self) -> None:
        assert self.store is not None
        self.store.close()
        self.store = self.engine.open(self.dir, budget=self.budget, codec=self.codec)
        live = self._live()
        assert not [i for i, s in self.model.items() if s.pending and i in live], \
            "close() must abandon this process's pending captures"

    @rule()
    def gc(self) -> None:
        assert self.store is not None
        self.store.gc(grace=0)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def pins_and_budgets(self) -> None:
        if self.store is None:
            return
        live = self._live()
        assert set(live) <= set(self.model), "a snapshot the model never saved"
        for x in live.values():
            assert x.parent_id is None or x.parent_id in live, "a parent was dropped under a live child"
        stats = self.store.stats()
        assert stats.stored_bytes <= (self.budget.disk_bytes or 0), "disk budget exceeded"
        if self.budget.max_entries is not None:
            assert stats.entries <= self.budget.max_entries, "max_entries exceeded"

    @invariant()
    def supersede_in_sessions(self) -> None:
        if self.store is None:
            return
        w = self.workload
        live = [x for x in self._live().values() if x.matchable and not x.pending]
        for a in live:
            for b in live:
                ma, mb = self.model[a.snapshot_id], self.model[b.snapshot_id]
                if a.session is not None and a.session == b.session and ma.n < mb.n and ma.order < mb.order:
                    assert not np.array_equal(w.tokens[ma.conv][:ma.n], w.tokens[mb.conv][:ma.n]), \
                        "a superseded prefix is still matchable in its session"
        live_now = self._live()
        evictions = self.store.stats().evictions
        for sid, x in live_now.items():
            if self.model[sid].shared:
                assert x.matchable, f"snapshot {sid} was restored from outside its session, then superseded away"
        gone = {i for i in self._shared_live if i not in live_now}
        assert not gone or evictions > self._evictions, \
            f"snapshots {sorted(gone)} were restored from outside their session, then dropped (not evicted)"
        self._shared_live = {i for i in live_now if self.model[i].shared}
        self._evictions = evictions

    @invariant()
    def restores_are_exact(self) -> None:
        if self.store is None:
            return
        for sid, x in self._live().items():
            if not x.matchable or x.pending:
                continue
            saved = self.model[sid]
            res, got = self._restore(sid, x.session)
            assert res.n_tokens == saved.n
            want = self.workload.expected(saved.conv, saved.n, saved.fixed_seed, set(saved.components))
            assert _digest(got) == _digest(want), f"snapshot {sid} did not restore byte-exact"
            assert res.missing_components == frozenset(c for c in {s.component for s in
                                                                   self.engine.layout.parts.values()}
                                                       if c is not None and c not in saved.components)

    @invariant()
    def verify_clean(self) -> None:
        if self.store is not None:
            report = self.store.verify(deep=False)
            assert report.ok, f"verify found damage: {report.problems}"
