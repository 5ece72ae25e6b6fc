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
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from snapstore._config import Budget
from snapstore._errors import IdentityError, LayoutError, SnapstoreError, StateError
from snapstore._identity import Identity
from snapstore._layout import Fixed, Layout, Rows
from snapstore._results import Match, MatchDetails, RestoreResult, SaveResult
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

    def open(self, path: str, *, budget: Budget, codec: str, **options: Any) -> Store:
        """Open the store the machine drives (row checks on: the vouching is verified); ``options``:
        more ``Store.open`` options the machine draws (``admit=``)."""
        return Store.open(path, identity=self.identity, layout=self.layout, budget=budget, codec=codec,
                          chunk_bytes=self.chunk_bytes, staging_bytes=self.staging_bytes, check_rows=True, **options)

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
    namespace: str | None = None
    foreign: bool = False  # state another identity computed (imported under an override, or saved over one)


@dataclass
class _Name:
    sid: int
    expires: float | None  # on the machine's clock; None: never


@dataclass
class _File:
    """An export file the machine wrote: what its chain must restore to, and where it came from."""

    path: str
    chain: tuple[_Saved, ...]  # root first: the leaf is the exported snapshot
    foreign_identity: bool  # exported by the foreign store (another identity): importing it needs the override
    name: str | None

    @property
    def saved(self) -> _Saved:
        return self.chain[-1]


def _digest(parts: Mapping[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in parts.items()}


class _Clock:
    """The process's ``time.time`` moved forward in steps (the store reads no other wall clock):
    TTLs, name ``ttl_s`` and the write-rate refill age as if that much time had passed."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._real: Any = None

    def install(self) -> None:
        if self._real is None:
            self._real = time.time
            real = self._real
            time.time = lambda: real() + self.offset

    def uninstall(self) -> None:
        if self._real is not None:
            time.time = self._real
            self._real = None

    def now(self) -> float:
        return time.time()


NAMESPACES = (None, "tenant-b")
NAMES = ("plan", "doc", "tool")
#: fixed-part seeds: few, so the same state is saved again (dedup), and by both identities (the pairs
#: of 46A item 5: a native save beside an override import of the same state)
SEEDS = st.integers(0, 3) | st.integers(0, 2**16)
_MARGIN = 120.0  # seconds of real time a run may take between a step and the check of a deadline


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
    # the engine's open() takes extra Store.open options (admit=): write admission is drawn too
    open_takes_options: bool = False

    @classmethod
    def for_engine(cls, engine: NumpyEngine, *, workload: Workload | None = None,
                   codecs: tuple[str, ...] | None = None) -> type[StoreStateMachine]:
        """A machine class bound to ``engine`` (and a workload over its layout)."""
        work = workload or Workload(engine.layout)
        if work.max_tokens > engine.max_rows:
            raise ValueError(f"the workload needs {work.max_tokens} rows, the engine restores {engine.max_rows}")
        params = inspect.signature(engine.restore).parameters
        observe = "session" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        oparams = inspect.signature(engine.open).parameters
        options = "admit" in oparams or any(p.kind == p.VAR_KEYWORD for p in oparams.values())
        attrs: dict[str, Any] = {"engine": engine, "workload": work, "codecs": codecs or cls.codecs,
                                 "observe_as_session": observe, "open_takes_options": options}
        return type(f"{cls.__name__}For{type(engine).__name__}", (cls,), attrs)

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="snapstore-testing-")
        self.dir = os.path.join(self.root, "store")
        self.model: dict[int, _Saved] = {}
        self.names: dict[tuple[str | None, str], _Name] = {}
        self.files: list[_File] = []
        self.clock = 0  # commit order (supersede)
        self.time = _Clock()
        self.time.install()
        self.store: Store | None = None
        self.foreign: Store | None = None  # another identity's store, same layout: the source of override imports
        self.foreign_model: dict[int, _Saved] = {}
        self.budget = Budget(reserve_bytes=0)
        self.codec = "raw"
        self.admit = "always"
        self.draft = {n for n, s in self.engine.layout.parts.items() if s.component is not None}
        self._shared_live: set[int] = set()  # restored from outside their session, live at the last check
        self._evictions = 0
        self._aged = False  # the clock passed a store TTL: match() may pass over what the model cannot date

    @initialize(disk=st.integers(30_000, 400_000), entries=st.none() | st.integers(2, 12),
                ttl=st.sampled_from([None, 3600.0]), write=st.sampled_from([None, None, None, 150_000]),
                admit=st.sampled_from(["always", "always", "always", "second_hit"]), data=st.data())
    def start(self, disk: int, entries: int | None, ttl: float | None, write: int | None, admit: str,
              data: st.DataObject) -> None:
        self.budget = Budget(disk_bytes=disk, max_entries=entries, reserve_bytes=0, ram_bytes=1 << 20, ttl=ttl,
                             write_bytes_per_hour=write)
        self.codec = data.draw(st.sampled_from(self.codecs), label="codec")
        self.admit = admit if self.open_takes_options else "always"
        self.store = self._open()
        for _ in range(data.draw(st.integers(0, 3), label="first saves")):
            self.save(data)  # a store with something in it: the other rules have work from the first step

    def _open(self) -> Store:
        if self.open_takes_options:
            return self.engine.open(self.dir, budget=self.budget, codec=self.codec,
                                    admit=self.admit)
        return self.engine.open(self.dir, budget=self.budget, codec=self.codec)

    def teardown(self) -> None:
        try:
            for s in (self.store, self.foreign):
                if s is not None:
                    s.close()
        finally:
            self.time.uninstall()
            shutil.rmtree(self.root, ignore_errors=True)

    def _live(self) -> dict[int, Any]:
        assert self.store is not None
        return {x.snapshot_id: x for x in self.store.snapshots()}

    @staticmethod
    def _whole(x: Any) -> bool:
        """Committed and restorable whole: matchable, or imported under an override (never matchable by
        match(), restored by id or name; the machine never saves such a snapshot in a session, so none
        is superseded into a chain link)."""
        return not x.pending and (x.matchable or (x.imported_from is not None and not x.quarantined))

    def _ref(self, sid: int) -> Match:
        """A reference that carries the snapshot's namespace (an id alone would need namespace=)."""
        saved = self.model[sid]
        return Match(sid, saved.n, saved.namespace)

    def _tokens(self, saved: _Saved) -> np.ndarray:
        return self.workload.tokens[saved.conv][:saved.n]

    def _state(self, conv: int, seed: int, with_draft: bool) -> dict[str, np.ndarray]:
        state = self.workload.state(conv, seed)
        if not with_draft:
            for name in self.draft:
                state.pop(name)
        return state

    def _draw_n(self, data: st.DataObject, low: int = 1) -> int:
        """A prefix length: often one of four boundaries (so saves meet again: dedup, the same state
        under both identities, a prompt that is exactly a snapshot), else any."""
        top = self.workload.max_tokens
        bounds = sorted({b for b in (top // 4, top // 2, 3 * top // 4, top) if b >= low})
        n: int = data.draw((st.sampled_from(bounds) | st.integers(low, top)) if bounds else st.integers(low, top),
                           label="n")
        return n

    def _valid_names(self, now: float) -> dict[tuple[str | None, str], _Name]:
        """Names whose ttl is clearly not over (a deadline within the margin is left unchecked)."""
        return {k: v for k, v in self.names.items() if v.expires is None or v.expires > now + _MARGIN}

    def _ttl_exempt(self, live: Mapping[int, Any], now: float) -> set[int]:
        """What the store's TTL never passes over: named snapshots and their chains (docs/api.md,
        "Named snapshots": a named snapshot's leading rows are served through the links below it)."""
        out: set[int] = set()
        for v in self._valid_names(now).values():
            at: int | None = v.sid
            while at is not None and at in live and at not in out:
                out.add(at)
                at = live[at].parent_id
        return out

    def _unsure_names(self, now: float) -> bool:
        return any(v.expires is not None and abs(v.expires - now) <= _MARGIN for v in self.names.values())

    def _candidates(self, live: Mapping[int, Any], q: np.ndarray, ns: str | None,
                    exclude: set[int] | frozenset[int] = frozenset(), only: set[int] | None = None) -> list[int]:
        """The model's snapshots match(q) may serve: live, committed, matchable, native, same namespace,
        a prefix of ``q``."""
        out = []
        for sid, x in live.items():
            saved = self.model[sid]
            if (x.matchable and not x.pending and sid not in exclude and saved.namespace == ns and not saved.foreign
                    and saved.n <= len(q) and np.array_equal(self._tokens(saved), q[:saved.n])
                    and (only is None or sid in only)):
                out.append(sid)
        return out

    def _check_match(self, q: np.ndarray, ns: str | None, got: Match | None, live: Mapping[int, Any],
                     exclude: set[int] | frozenset[int] = frozenset(), what: str = "match()") -> None:
        """``got`` is the longest prefix the model knows of (with a TTL the clock passed: at least the
        longest named one), never another identity's state, never an excluded one."""
        if got is not None:
            assert got.snapshot_id in self.model, f"{what} served snapshot {got.snapshot_id} the model never saved"
            saved = self.model[got.snapshot_id]
            assert not saved.foreign, (f"{what} served snapshot {got.snapshot_id}, state imported under an identity "
                                       "override, as an exact hit")
            assert saved.namespace == ns, f"{what} crossed a namespace"
            assert got.snapshot_id not in exclude, f"{what} served an excluded snapshot"
            assert got.n_tokens == saved.n and np.array_equal(self._tokens(saved), q[:saved.n]), \
                f"{what} served a snapshot that is not a prefix of the prompt"
        n_got = got.n_tokens if got is not None else 0
        every = max((self.model[i].n for i in self._candidates(live, q, ns, exclude)), default=0)
        if not self._aged:
            assert n_got == every, f"{what} is not the longest saved prefix ({n_got} tokens, the model: {every})"
            return
        assert n_got <= every, f"{what} served {n_got} tokens, more than any live prefix ({every})"
        now = self.time.now()
        if not self._unsure_names(now):
            named = self._ttl_exempt(live, now)
            least = max((self.model[i].n for i in self._candidates(live, q, ns, exclude, named)), default=0)
            # 46C item 8: a named snapshot stops matching once unused for the store's TTL
            assert n_got >= least, (f"{what} passed over a named snapshot ({least} tokens) after the store's "
                                    f"TTL; it served {n_got}")

    # -- saves -------------------------------------------------------------------------------
    @rule(data=st.data())
    def save(self, data: st.DataObject) -> None:
        """save() through the engine: any session, namespace, parent rule, with or without the draft."""
        assert self.store is not None
        session = data.draw(st.sampled_from([None, "s0", "s1"]), label="session")
        commit = data.draw(st.booleans(), label="commit")
        parent = data.draw(st.sampled_from(["auto", None, "explicit", "named"]), label="parent")
        with_draft = data.draw(st.booleans(), label="with_draft")
        seed = data.draw(SEEDS, label="seed")
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = self._draw_n(data)
        live = self._live()
        roots = sorted(i for i, x in live.items() if self._whole(x) and x.parent_id is None)
        again: bool = data.draw(st.booleans(), label="a live root's state again")
        if roots and again:
            # the same state as a stored root (maybe an override import of it: the pair of 46A item 5)
            same = self.model[data.draw(st.sampled_from(roots), label="root")]
            conv, n, seed, namespace = same.conv, same.n, same.fixed_seed, same.namespace
            with_draft, parent, session = any(c is not None for c in same.components), None, None
        state = self._state(conv, seed, with_draft)
        par: Any = parent
        q = w.tokens[conv][:n]
        if parent == "explicit":
            m = self.store.match(q, namespace=namespace)
            par = m if m is not None and m.n_tokens < n else None
        elif parent == "named":  # a named snapshot below it, maybe one imported under an override
            live = self._live()
            below = sorted(v.sid for (ns, _), v in self._valid_names(self.time.now()).items()
                           if ns == namespace and v.sid in live and self.model[v.sid].n < n
                           and np.array_equal(self._tokens(self.model[v.sid]), q[:self.model[v.sid].n]))
            par = self._ref(data.draw(st.sampled_from(below), label="named parent")) if below else None
            if par is not None and self.model[par.snapshot_id].foreign:
                session = None  # it inherits the override mark: kept out of sessions (see _whole)
        before = set(self._live())
        try:
            r = self.engine.save(self.store, q, state, session=session, commit=commit, parent=par,
                                 namespace=namespace)
        except LayoutError:
            assert parent in ("explicit", "named"), "only an explicit parent with other components may be refused"
            return
        if r.skipped in ("write_budget", "first_sighting"):
            assert set(self._live()) == before, f"a save skipped by write admission ({r.skipped}) changed the store"
        parent_foreign = r.parent_id is not None and r.parent_id in self.model and self.model[r.parent_id].foreign
        if r.parent_id is not None and parent in ("auto", "explicit"):
            assert not parent_foreign, "parent='auto' chose a snapshot imported under an identity override"
        self._record(r, conv, n, seed, session, commit, state, namespace, foreign=parent_foreign)
        if r.snapshot_id is not None and commit and not parent_foreign:
            # 46A item 5: a native save deduplicated onto an override import is never matched
            m = self.store.match(q, namespace=namespace)
            assert m is not None and m.n_tokens == n, \
                f"a committed native save of {n} tokens does not match its own tokens ({m})"

    def _record(self, r: SaveResult, conv: int, n: int, seed: int, session: str | None, commit: bool,
                state: Mapping[str, Any], namespace: str | None = None, *, foreign: bool = False) -> None:
        if r.snapshot_id is None:
            assert r.skipped, "a save with no id must say why it was skipped"
            return
        if r.snapshot_id in self.model:  # the same state again: deduplicated onto the stored one
            old = self.model[r.snapshot_id]
            # 46A item 5: a native save deduplicated onto an override import (same_content ignores the mark)
            assert foreign or not old.foreign, (f"a native save was deduplicated onto snapshot {r.snapshot_id}, "
                                                "imported under an identity override")
            return
        self.clock += 1
        comps = frozenset({s.component for k, s in self.engine.layout.parts.items() if k in state})
        self.model[r.snapshot_id] = _Saved(conv, n, seed, session, not commit, comps, self.clock,
                                           namespace=namespace, foreign=foreign)

    def _sync_pending(self) -> None:
        """Captures the store now shows committed: committed in the model, in this order."""
        self.clock += 1
        for x in self.store.snapshots() if self.store is not None else ():
            saved = self.model.get(x.snapshot_id)
            if saved is not None and saved.pending and not x.pending:
                saved.pending, saved.order = False, self.clock

    @rule(data=st.data(), seed=SEEDS)
    def next_turn(self, data: st.DataObject, seed: int) -> None:
        """A session's conversation goes on: a longer prefix of it, committed in the same session
        (so supersede runs, often over a snapshot ``restore_elsewhere`` used from outside)."""
        assert self.store is not None
        w = self.workload
        live = self._live()
        going = sorted(i for i, x in live.items() if x.matchable and not x.pending and not self.model[i].foreign
                       and x.session is not None and self.model[i].n < w.max_tokens)
        if not going:
            return
        sid = data.draw(st.sampled_from(going), label="turn of")
        saved, session = self.model[sid], live[sid].session
        n = data.draw(st.integers(saved.n + 1, w.max_tokens), label="n")
        state = w.state(saved.conv, seed)
        r = self.engine.save(self.store, w.tokens[saved.conv][:n], state, session=session, commit=True,
                             parent="auto", namespace=saved.namespace)
        self._record(r, saved.conv, n, seed, session, True, state, saved.namespace)

    @rule(data=st.data(), seed=SEEDS, session=st.sampled_from([None, "s0", "s1"]),
          namespace=st.sampled_from(NAMESPACES), how=st.sampled_from(["commit", "abandon", "async", "error"]))
    def turn(self, data: st.DataObject, seed: int, session: str | None, namespace: str | None, how: str) -> None:
        """``Store.turn``: two captures a delta apart, then committed (the chain, root first), abandoned,
        captured without waiting, or left by an exception (abandoned)."""
        assert self.store is not None
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        a = data.draw(st.integers(1, w.max_tokens - 1), label="first")
        b = data.draw(st.integers(a + 1, w.max_tokens), label="second")
        state = w.state(conv, seed)
        caps: list[tuple[SaveResult, int]] = []
        try:
            with self.store.turn(session=session, namespace=namespace) as t:
                for n in (a, b):
                    if how == "async":
                        h = t.capture(w.tokens[conv][:n], state, wait=False)
                        caps.append((h.result(), n))
                    else:
                        caps.append((t.capture(w.tokens[conv][:n], state), n))
                if how == "abandon":
                    t.abandon()
                if how == "error":
                    raise _Abandon
        except _Abandon:
            pass
        live = self._live()
        for r, n in caps:
            if r.snapshot_id is not None and r.snapshot_id not in self.model and r.snapshot_id in live:
                self._record(r, conv, n, seed, session, False, state, namespace)
        if how in ("abandon", "error"):
            assert not [r for r, _ in caps if r.snapshot_id in live and live[r.snapshot_id].pending], \
                "an abandoned turn left pending captures"
        self._sync_pending()

    @rule(data=st.data(), seed=SEEDS, namespace=st.sampled_from(NAMESPACES),
          session=st.sampled_from([None, "s0"]))
    def save_without_waiting(self, data: st.DataObject, seed: int, namespace: str | None, session: str | None) -> None:
        """``save(wait=False)`` then ``flush()``: the handle's result is what a waiting save returns."""
        assert self.store is not None
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = self._draw_n(data)
        state = w.state(conv, seed)
        h = self.store.save(w.tokens[conv][:n], state, session=session, namespace=namespace, wait=False)
        assert self.store.flush(timeout=60)
        self._record(h.result(), conv, n, seed, session, True, state, namespace)

    @precondition(lambda self: any(s.pending for s in self.model.values()))
    @rule(data=st.data(), commit=st.booleans())
    def finish_pending(self, data: st.DataObject, commit: bool) -> None:
        assert self.store is not None
        live = self._live()
        pend = sorted(i for i, s in self.model.items() if s.pending and i in live)
        if not pend:
            return
        sid = data.draw(st.sampled_from(pend), label="pending")
        ns = self.model[sid].namespace
        if not commit:
            self.store.abandon(sid, namespace=ns)
            return
        if self.store.commit(sid, namespace=ns).snapshot_id is not None:
            self._sync_pending()

    # -- reads -------------------------------------------------------------------------------
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
            return self.engine.restore(self.store, self._ref(sid), session=session)
        return self.engine.restore(self.store, self._ref(sid))

    def _expected(self, sid: int, components: set[str | None] | None = None) -> dict[str, bytes]:
        saved = self.model[sid]
        comps = set(saved.components) if components is None else set(saved.components) & components
        return self.workload.expected(saved.conv, saved.n, saved.fixed_seed, comps)

    def _dest(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(spec.nbytes if isinstance(spec, Fixed) else spec.row_bytes * self.engine.max_rows,
                               np.uint8) for name, spec in self.engine.layout.parts.items()}

    def _got(self, dest: Mapping[str, Any], rows: Mapping[str, int], missing: frozenset[str],
             components: set[str | None] | None = None) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for name, spec in self.engine.layout.parts.items():
            if spec.component in missing or (components is not None and spec.component not in components):
                continue
            buf = np.asarray(dest[name]).view(np.uint8).reshape(-1)
            out[name] = buf.tobytes() if isinstance(spec, Fixed) else buf[:rows[name] * spec.row_bytes].tobytes()
        return out

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        """match(), lookup() and match_many() against the model, plain and weighed against prefill.

        Hypothesis draws the rules with the fewest arguments most often: this cheap, checking one is
        first; the destructive ones (delete, restarts, maintenance) take more."""
        assert self.store is not None
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        exclude = data.draw(st.booleans(), label="exclude")
        # numpy scalars too: every numeric argument takes what numbers.Real takes (46B item 13)
        rate = data.draw(st.sampled_from([None, None, 1.0, 1e12, 2000.0, np.int64(1), np.float32(2000.0)]),
                         label="prefill_tokens_per_s")
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        q = w.tokens[conv][:self._draw_n(data)]
        live = self._live()
        skip: set[int] = set()
        if exclude and live:
            skip = {data.draw(st.sampled_from(sorted(live)), label="exclude")}
        if rate is None:
            m = self.store.match(q, namespace=namespace, exclude=skip)
            self._check_match(q, namespace, m, live, skip)
            d = self.store.lookup(q, namespace=namespace, exclude=skip)
            assert (d.n_tokens if d is not None else None) == (m.n_tokens if m is not None else None), \
                "lookup() and match() disagree"
            if not skip:
                [many] = self.store.match_many([q], namespace=namespace)
                assert (many.n_tokens if many else None) == (m.n_tokens if m else None), "match_many() != match()"
            return
        plain = self.store.match(q, namespace=namespace, exclude=skip)
        weighed = self.store.match(q, namespace=namespace, exclude=skip, prefill_tokens_per_s=rate)
        if weighed is not None:
            self._check_match_safe(q, namespace, weighed, skip, "a weighed match()")
            assert weighed.why is not None and weighed.why.chosen == weighed.snapshot_id
        if rate == 1.0 and plain is not None and plain.n_tokens >= 20:
            # a token a second: any restore saves time (20 s against estimates of milliseconds), the longest wins
            assert (weighed.n_tokens if weighed else None) == (plain.n_tokens if plain else None), \
                "a weighed match at 1 token/s did not take the longest prefix"
        if rate == 1e12:  # reading is faster than any restore
            assert weighed is None, "a weighed match at 1e12 tokens/s chose a restore"
        d = self.store.lookup(q, namespace=namespace, exclude=skip, prefill_tokens_per_s=rate)
        if d is not None:
            self._check_match_safe(q, namespace, Match(d.snapshot_id, d.n_tokens, namespace), skip,
                                   "a weighed lookup()")

    def _check_match_safe(self, q: np.ndarray, ns: str | None, got: Match, skip: set[int], what: str) -> None:
        saved = self.model.get(got.snapshot_id)
        assert saved is not None and not saved.foreign, f"{what} served state imported under an identity override"
        assert saved.namespace == ns and got.snapshot_id not in skip
        assert np.array_equal(self._tokens(saved), q[:saved.n]), f"{what} served a snapshot that is not a prefix"

    @rule(data=st.data(), how=st.sampled_from(["match", "describe", "callable", "base", "rows_from", "many", "load",
                                               "details"]))
    def restore_ways(self, data: st.DataObject, how: str) -> None:
        """The other ways to restore: a Match, describe() then restore, a callable ``into``, the base
        state alone, ``rows_from``, restore_many(), load() — each byte-exact, as the model says."""
        assert self.store is not None
        live = self._live()
        ok = sorted(i for i, x in live.items() if self._whole(x))
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        saved, ref = self.model[sid], self._ref(sid)
        store = self.store
        want = self._expected(sid)
        if how == "load":
            if saved.foreign:
                return
            q = self._tokens(saved)
            dests: list[dict[str, np.ndarray]] = []

            def allocate(details: MatchDetails) -> dict[str, np.ndarray]:
                dests.append(self._dest())
                return dests[-1]

            lr = store.load(q, allocate=allocate, namespace=saved.namespace)
            assert lr is not None and lr.n_tokens <= saved.n
            got_sid = lr.match.snapshot_id
            self._check_match(q, saved.namespace, lr.match, live)
            got = self._got(dests[-1], lr.rows, lr.missing_components)
            assert _digest(got) == _digest(self._expected(got_sid)), "load() was not byte-exact"
            return
        if how == "many":
            other = data.draw(st.sampled_from(ok), label="second")
            reqs = [(ref, self._dest()), (self._ref(other), self._dest())]
            if self.model[other].namespace != saved.namespace:
                return
            many = store.restore_many(reqs, namespace=saved.namespace)
            for (r, dest), rr in zip(reqs, many):
                got = self._got(dest, rr.rows, rr.missing_components)
                assert _digest(got) == _digest(self._expected(r.snapshot_id)), "restore_many() was not byte-exact"
            return
        details = store.describe(ref)
        assert details.n_tokens == saved.n and details.snapshot_id == sid
        if how == "details" and not saved.foreign:  # lookup()'s MatchDetails as the ref (46B item 2)
            d = store.lookup(self._tokens(saved), namespace=saved.namespace)
            assert d is not None and d.n_tokens == saved.n
            dest = self._dest()
            res = store.restore(d, dest)
            assert res.n_tokens == d.n_tokens
            got = self._got(dest, res.rows, res.missing_components)
            assert _digest(got) == _digest(self._expected(d.snapshot_id)), "restore(MatchDetails) was not byte-exact"
            return
        est = store.estimate_restore(ref)
        assert est.bytes >= 0 and est.seconds > 0
        dest = self._dest()
        comps: set[str | None] | None = None
        if how == "callable":
            seen: list[MatchDetails] = []

            def plan_then_write(d: MatchDetails) -> dict[str, np.ndarray]:
                seen.append(d)
                return dest

            res = store.restore(ref, plan_then_write)
            assert seen and seen[0].n_tokens == saved.n
        elif how == "base":
            comps = {None}
            res = store.restore(ref, dest, components=())
        elif how == "rows_from":
            k = data.draw(st.integers(0, saved.n), label="rows_from")
            res = store.restore(ref, dest, rows_from=k)
            got = self._got(dest, res.rows, res.missing_components)
            for name, spec in self.engine.layout.rows.items():
                if name in got:  # rows below k were not written; the rest are the snapshot's
                    rb = spec.row_bytes
                    assert got[name][:k * rb] == bytes(min(k, res.rows[name]) * rb)
                    assert got[name][k * rb:] == want[name][k * rb:], "restore(rows_from=k) was not byte-exact"
            return
        elif how == "match":
            res = store.restore(ref, dest)
        else:
            res = store.restore(sid, dest, namespace=saved.namespace)
        assert res.n_tokens == saved.n
        got = self._got(dest, res.rows, res.missing_components, comps)
        assert _digest(got) == _digest(self._expected(sid, comps)), f"restore ({how}) was not byte-exact"

    def read_only_view(self) -> None:
        """A read-only Store of the same directory sees what the writer sees, and restores it exactly."""
        assert self.store is not None
        ro = Store.open(self.dir, identity=self.engine.identity, layout=self.engine.layout, read_only=True)
        try:
            live = self._live()
            for sid in sorted(i for i, x in live.items() if self._whole(x))[:2]:
                saved = self.model[sid]
                dest = self._dest()
                res = ro.restore(self._ref(sid), dest)
                assert _digest(self._got(dest, res.rows, res.missing_components)) == _digest(self._expected(sid)), \
                    "a read-only store did not restore byte-exact"
                m = ro.match(self._tokens(saved), namespace=saved.namespace)
                self._check_match(self._tokens(saved), saved.namespace, m, live)
        finally:
            ro.close()

    # -- names -------------------------------------------------------------------------------
    @rule(data=st.data())
    def name(self, data: st.DataObject) -> None:
        """name() a snapshot (maybe with ``ttl_s``), or unname() a name."""
        assert self.store is not None
        name = data.draw(st.sampled_from(NAMES), label="name")
        ttl = data.draw(st.sampled_from([None, None, 1800.0, 9000.0]), label="ttl_s")
        unname = data.draw(st.sampled_from([False, False, True]), label="unname")
        if unname:
            self._unname(name, data.draw(st.sampled_from(NAMESPACES), label="namespace"))
            return
        ok = sorted(i for i, x in self._live().items() if self._whole(x))
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        ns = self.model[sid].namespace
        now = self.time.now()
        self.store.name(self._ref(sid), name, ttl_s=ttl)
        self.names[(ns, name)] = _Name(sid, now + ttl if ttl is not None else None)

    def _unname(self, name: str, namespace: str | None) -> None:
        assert self.store is not None
        had = self.store.unname(name, namespace=namespace)
        entry = self.names.pop((namespace, name), None)
        now = self.time.now()
        if entry is not None and (entry.expires is None or entry.expires > now + _MARGIN):
            assert had, "unname() of a live name said it did not exist"

    @rule(data=st.data(), leaf=st.booleans(), gc=st.booleans())
    def delete(self, data: st.DataObject, leaf: bool, gc: bool) -> None:
        """delete() a snapshot and its subtree (``leaf``: one without children)."""
        assert self.store is not None
        live = self._live()
        parents = {x.parent_id for x in live.values()}
        ok = sorted(i for i, x in live.items() if not x.pending and (not leaf or i not in parents))
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        try:
            res = self.store.delete(self._ref(sid))
        except StateError:
            return  # a pending capture of this process in the subtree
        if gc:
            self.store.gc(grace=0)
        assert sid in res.snapshot_ids
        self._shared_live -= set(res.snapshot_ids)
        after = self._live()
        assert not set(res.snapshot_ids) & set(after), "delete() reported a snapshot that is still there"
        for k, v in list(self.names.items()):
            if v.sid in res.snapshot_ids:
                del self.names[k]

    # -- export and import -------------------------------------------------------------------
    def _new_file(self) -> str:
        os.makedirs(os.path.join(self.root, "files"), exist_ok=True)
        return os.path.join(self.root, "files", f"f{len(self.files)}.snapx")

    @rule(data=st.data())
    def export(self, data: st.DataObject) -> None:
        """Export a snapshot (by reference or by name); ``again``: import the file back at once, with
        the override key of the identity that computed the state or without one ("skip": not now)."""
        by_name = data.draw(st.booleans(), label="by name")
        again = data.draw(st.sampled_from([None, "right", None, "right", "skip"]), label="again")
        assert self.store is not None
        live = self._live()
        now = self.time.now()
        names = sorted((k for k, v in self._valid_names(now).items() if v.sid in live), key=str)
        if by_name and names:
            ns, nm = data.draw(st.sampled_from(names), label="name")
            ref: Any = nm
            sid = self.names[(ns, nm)].sid
        else:
            ok = sorted(i for i, x in live.items() if self._whole(x))
            marked = [i for i in ok if self.model[i].foreign]
            prefer: bool = data.draw(st.booleans(), label="one imported under an override")
            if marked and prefer:
                ok = marked  # the pair of 46A item 1: an export of another identity's state
            if not ok:
                return
            sid, ns, nm = data.draw(st.sampled_from(ok), label="snapshot"), None, None
            ref = self._ref(sid)
            ns = self.model[sid].namespace
        path = self._new_file()
        try:
            out = self.store.export(ref, path, namespace=ns)
        except SnapstoreError:
            # 46A item 1 allows refusing the export of state imported under an override
            assert self.model[sid].foreign, "export() of a native snapshot was refused"
            assert not os.path.exists(path)
            return
        assert out.snapshot_id == sid and out.n_tokens == self.model[sid].n
        chain = self._chain(live, sid)
        assert len(chain) == out.links, f"the export holds {out.links} links, the chain has {len(chain)}"
        self.files.append(_File(path, tuple(self.model[i] for i in chain), False, nm))
        if again != "skip":
            self._import(self.files[-1], None, again)

    @staticmethod
    def _chain(live: Mapping[int, Any], sid: int) -> list[int]:
        """``sid``'s chain, root first, from the parents ``live`` (SnapshotInfo by id) names."""
        out: list[int] = []
        at: int | None = sid
        while at is not None:
            out.append(at)
            at = live[at].parent_id
        return out[::-1]

    @rule(data=st.data())
    def foreign_export(self, data: st.DataObject) -> None:
        """Another identity (another quant of the same model) saves the same workload and exports it;
        ``again``: import the file here at once (with the right override key, none, or a wrong one)."""
        seed = data.draw(SEEDS, label="seed")
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        name = data.draw(st.booleans(), label="name it")
        again = data.draw(st.sampled_from(["right", "right", None, "wrong", "skip"]), label="again")
        w = self.workload
        if self.foreign is None:
            ident = self.engine.identity
            other = Identity(build=ident.build, pack=ident.pack + "-q4", kv=ident.kv, mtp=ident.mtp,
                             extra=dict(ident.extra))
            self.foreign = Store.open(os.path.join(self.root, "foreign"), identity=other, layout=self.engine.layout,
                                      budget=Budget(disk_bytes=1 << 30, reserve_bytes=0, ram_bytes=0),
                                      chunk_bytes=self.engine.chunk_bytes, staging_bytes=self.engine.staging_bytes)
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = self._draw_n(data)
        with_draft = data.draw(st.booleans(), label="with draft")
        state = self._state(conv, seed, with_draft)
        r = self.foreign.save(w.tokens[conv][:n], state, namespace=namespace)
        assert r.snapshot_id is not None
        comps = frozenset({s.component for k, s in self.engine.layout.parts.items() if k in state})
        saved = _Saved(conv, n, seed, None, False, comps, namespace=namespace, foreign=True)
        self.foreign_model.setdefault(r.snapshot_id, saved)
        nm = None
        if name:
            nm = data.draw(st.sampled_from(NAMES), label="name")
            self.foreign.name(r, nm)
        path = self._new_file()
        out = self.foreign.export(r, path)
        chain = self._chain({x.snapshot_id: x for x in self.foreign.snapshots()}, r.snapshot_id)
        assert len(chain) == out.links
        self.files.append(_File(path, tuple(self.foreign_model[i] for i in chain), True, nm))
        if again != "skip":
            self._import(self.files[-1], None, again)

    @precondition(lambda self: bool(self.files))
    @rule(data=st.data(), name=st.sampled_from([None, None, *NAMES]), accept=st.sampled_from(["right", None, "wrong"]))
    def import_file(self, data: st.DataObject, name: str | None, accept: str | None) -> None:
        """Import a file the machine exported earlier (maybe of a snapshot deleted or evicted since)."""
        self._import(data.draw(st.sampled_from(self.files), label="file"), name, accept)

    def _import(self, f: _File, name: str | None, accept: str | None) -> None:
        """Import ``f``: the store's own identity needs no override; another's needs accept_identity
        naming it, and is then restored by id or name only; a wrong key is refused, nothing changes."""
        assert self.store is not None
        foreign_key = self.foreign.identity.key if self.foreign is not None else None
        key = {"right": foreign_key if f.foreign_identity or f.saved.foreign else None,
               "wrong": "id-" + "0" * 32, None: None}[accept]
        before = set(self._live())
        try:
            res = self.store.import_file(f.path, name, accept_identity=key)
        except IdentityError:
            assert set(self._live()) == before, "a refused import changed the store"
            assert f.foreign_identity or f.saved.foreign or key is not None, "the store's own export was refused"
            return
        except StateError:  # the chain does not fit the budget
            assert set(self._live()) == before, "a refused import changed the store"
            return
        assert accept != "wrong", "an import under a key that names no identity was accepted"
        if f.foreign_identity:
            assert key is not None, "another identity's file was imported without accept_identity"
        saved = f.saved
        sid = res.snapshot_id
        assert res.n_tokens == saved.n and res.namespace == saved.namespace
        assert res.links == len(f.chain), f"the import reports {res.links} links, the file holds {len(f.chain)}"
        live = self._live()
        chain = self._chain(live, sid)
        assert len(chain) == len(f.chain), f"the imported chain has {len(chain)} links, the file {len(f.chain)}"
        marked_file = f.foreign_identity or any(link.foreign for link in f.chain)
        for link_id, link in zip(chain, f.chain):
            # 46A item 1: a snapshot imported under an override, exported and imported again without one
            # keeps its mark (or the export is refused): another identity's state never turns native
            foreign = f.foreign_identity or link.foreign
            if link_id not in self.model and marked_file and live[link_id].imported_from is not None:
                foreign = True  # a native link of a marked file may come back marked: over-cautious, not wrong
            if link_id in self.model:
                old = self.model[link_id]
                assert (old.conv, old.n, old.namespace) == (link.conv, link.n, link.namespace), \
                    "an import reused a snapshot of other tokens"
                # 46A item 5 (the import's side): native state is never deduplicated onto an override import
                assert foreign or not old.foreign, "a native import was deduplicated onto an override import"
            else:
                self.clock += 1
                self.model[link_id] = _Saved(link.conv, link.n, link.fixed_seed, None, False, link.components,
                                             self.clock, namespace=link.namespace, foreign=foreign)
        if res.name is not None:
            assert res.name == (name if name is not None else f.name)
            self.names[(saved.namespace, res.name)] = _Name(sid, None)

    @rule(data=st.data(), gc=st.booleans(), twice=st.booleans())
    def lose_a_chunk_file(self, data: st.DataObject, gc: bool, twice: bool) -> None:
        """A chunk file is lost (a disk, an operator); the restores that need it fail (and quarantine
        it); importing the backups exported before heals it as a save would (46A item 6)."""
        assert self.store is not None
        live = self._live()
        whole = sorted(i for i, x in live.items() if self._whole(x))
        if not whole or any(x.pending for x in live.values()):
            return  # a pending capture's own chunks have no backup to heal them from
        backups: dict[int, _File] = {}
        for sid in whole:
            path = self._new_file()
            self.store.export(self._ref(sid), path)
            backups[sid] = _File(path, tuple(self.model[i] for i in self._chain(live, sid)), False, None)
            self.files.append(backups[sid])
        blobs = os.path.join(self.dir, "blobs")
        chunk_files = sorted(os.path.join(d, f) for d, _, fs in os.walk(blobs) for f in fs)
        if not chunk_files:
            return
        os.unlink(data.draw(st.sampled_from(chunk_files), label="lost chunk file"))
        broken = []
        for sid in whole:
            dest = self._dest()
            try:
                res = self.store.restore(self._ref(sid), dest)
            except SnapstoreError:
                broken.append(sid)
                continue
            assert _digest(self._got(dest, res.rows, res.missing_components)) == _digest(self._expected(sid))
        if gc:
            self.store.gc(grace=0)
        for sid in broken * (2 if twice else 1):
            self._import(backups[sid], None, "right")
        if not self.store.verify(deep=False).ok:  # a chunk the RAM tier still held: no restore failed
            for sid in whole:
                self._import(backups[sid], None, "right")
        report = self.store.verify(deep=False)  # 46A item 6: an import that does not heal a lost chunk file
        assert report.ok, f"importing the backups did not heal a lost chunk file: {report.problems}"
        for sid in broken:
            dest = self._dest()
            res = self.store.restore(self._ref(sid), dest)  # 46A item 6: the import did not heal the chunk
            assert _digest(self._got(dest, res.rows, res.missing_components)) == _digest(self._expected(sid)), \
                f"snapshot {sid} did not restore byte-exact after its backup was imported"

    # -- time, restarts, maintenance --------------------------------------------------------
    @rule(seconds=st.sampled_from([600.0, 4000.0]), gc=st.booleans(), reopen=st.booleans())
    def advance_clock(self, seconds: float, gc: bool, reopen: bool) -> None:
        """Time passes: names with ``ttl_s`` end, the store's TTL passes over unused snapshots (never
        named ones), the write rate refills."""
        assert self.store is not None
        self.time.offset += seconds
        now = self.time.now()
        for k, v in list(self.names.items()):
            if v.expires is not None and v.expires < now - _MARGIN:
                assert self.store.named(k[1], namespace=k[0]) is None, f"name {k} outlived its ttl_s"
                del self.names[k]
        if self.budget.ttl:
            self._aged = True
            if seconds > self.budget.ttl + _MARGIN and not self._unsure_names(now):
                # nothing was used since the jump: only named snapshots may match (46C item 8 if they do not)
                live = self._live()
                named = self._ttl_exempt(live, now)
                for sid in sorted(i for i in live if not self.model[i].foreign)[:6]:
                    saved = self.model[sid]
                    q = self._tokens(saved)
                    m = self.store.match(q, namespace=saved.namespace)
                    best = max((self.model[i].n for i in self._candidates(live, q, saved.namespace, only=named)),
                               default=0)
                    assert (m.n_tokens if m else 0) == best, (
                        f"after the store's TTL, match() served {m} where only named snapshots may match "
                        f"(the longest named: {best} tokens)")
                if gc or reopen:  # the TTL's drops: every unnamed leaf goes (a pending capture keeps its parents)
                    if gc:
                        self.store.gc(grace=0)
                    else:
                        self.reopen()
                    live = self._live()
                    parents = {x.parent_id for x in live.values()}
                    left = sorted(i for i, x in live.items() if i not in named and i not in parents and not x.pending)
                    assert not left, f"unnamed snapshots {left} outlived the store's TTL through gc/open"

    @rule(kind=st.sampled_from(["reopen", "reopen", "rebuilt", "read_only"]), gc_first=st.booleans())
    def restart(self, kind: str, gc_first: bool) -> None:
        """The engine restarts (close, open), the same model opens under another build, or a
        read-only Store of the directory looks on."""
        assert self.store is not None
        if gc_first:
            self.store.gc(grace=0)
        {"reopen": self.reopen, "rebuilt": self.rebuilt_engine, "read_only": self.read_only_view}[kind]()
        if gc_first and self.store is not None:
            assert self.store.verify(deep=True).ok

    def reopen(self) -> None:
        assert self.store is not None
        self.store.close()
        self.store = self._open()
        live = self._live()
        assert not [i for i, s in self.model.items() if s.pending and i in live], \
            "close() must abandon this process's pending captures"

    def rebuilt_engine(self) -> None:
        """The same model opens under another build (drop_stale): this identity's snapshots go as stale,
        except named ones and their chains (46C item 11: today they are dropped too)."""
        assert self.store is not None
        self.store.close()
        self.store = None
        ident = self.engine.identity
        rebuilt = Identity(build=ident.build + "+rebuilt", pack=ident.pack, kv=ident.kv, mtp=ident.mtp,
                           extra=dict(ident.extra))
        Store.open(self.dir, identity=rebuilt, layout=self.engine.layout, budget=self.budget,
                   drop_stale=True).close()
        self.store = self._open()
        live = self._live()
        keep: set[int] = set()
        now = self.time.now()
        for v in self.names.values():
            if v.expires is not None and v.expires <= now - _MARGIN:
                continue  # clearly expired: it protects nothing
            sid: int | None = v.sid
            while sid is not None and sid in live and sid not in keep:
                keep.add(sid)
                sid = live[sid].parent_id
        assert set(live) <= keep, f"a stale drop kept unnamed snapshots {sorted(set(live) - keep)}"
        self._shared_live &= set(live)

    @rule(gc=st.booleans(), deep=st.booleans(), warm=st.booleans())
    def maintenance(self, gc: bool, deep: bool, warm: bool) -> None:
        """gc (else a dry run, which changes nothing), then verify (quick or deep), stats and warm_up:
        reads that change nothing a match sees."""
        assert self.store is not None
        if gc:
            self.store.gc(grace=0)
        else:
            before = self._live()
            self.store.gc(grace=0, dry_run=True)
            assert set(self._live()) == set(before), "gc(dry_run=True) changed the store"
        report = self.store.verify(deep=deep)
        assert report.ok, f"verify found damage: {report.problems}"
        if warm:
            self.store.warm_up()
        stats = self.store.stats()
        assert stats.entries <= len(self._live())

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
    def override_marks(self) -> None:
        """A snapshot is marked imported under an override exactly when the model says its state is
        another identity's (46A items 1 and 5 break this)."""
        if self.store is None:
            return
        for sid, x in self._live().items():
            foreign = self.model[sid].foreign
            assert (x.imported_from is not None) == foreign, (
                f"snapshot {sid}: imported_from={x.imported_from!r}, but the model says its state is "
                f"{'another identity' if foreign else 'this identity'}'s")

    @invariant()
    def names_hold(self) -> None:
        """Every live name finds its snapshot, which restores and (when native) matches its own tokens."""
        if self.store is None:
            return
        now = self.time.now()
        live = self._live()
        for (ns, nm), v in self._valid_names(now).items():
            m = self.store.named(nm, namespace=ns)
            # 46C item 11: a stale drop took a named snapshot
            assert m is not None and m.snapshot_id == v.sid, f"named({nm!r}, namespace={ns!r}) is {m}, not #{v.sid}"
            assert v.sid in live, f"named snapshot #{v.sid} is gone"
            saved = self.model[v.sid]
            assert m.n_tokens == saved.n
            if not saved.foreign:
                got = self.store.match(self._tokens(saved), namespace=ns)
                # 46C item 8: a named snapshot stops matching once unused for the store's TTL
                assert got is not None and got.n_tokens == saved.n, \
                    f"named snapshot #{v.sid} ({saved.n} tokens) does not match its own tokens: {got}"

    @invariant()
    def supersede_in_sessions(self) -> None:
        if self.store is None:
            return
        w = self.workload
        live = [x for x in self._live().values() if x.matchable and not x.pending]
        for a in live:
            for b in live:
                ma, mb = self.model[a.snapshot_id], self.model[b.snapshot_id]
                if a.session is not None and a.session == b.session and ma.namespace == mb.namespace \
                        and ma.n < mb.n and ma.order < mb.order:
                    assert not np.array_equal(w.tokens[ma.conv][:ma.n], w.tokens[mb.conv][:ma.n]), \
                        "a superseded prefix is still matchable in its session"
        live_now = self._live()
        stats = self.store.stats()
        evictions = stats.evictions + stats.expired  # the budget's drops and the TTL's
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
            if not self._whole(x):
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


class _Abandon(Exception):
    """Raised inside a turn to leave it by an exception (the turn abandons its captures)."""
