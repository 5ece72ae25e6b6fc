"""The state machine's base: its state (the store, the reference model) and shared helpers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from snapstore._config import Budget
from snapstore._layout import Fixed
from snapstore._results import Match, RestoreResult, SaveResult
from snapstore.store.store import Store
from snapstore.testing.engine import NumpyEngine, Workload
from snapstore.testing.model import _MARGIN, _Clock, _File, _Name, _Saved


class _MachineBase(RuleBasedStateMachine):
    """The machine's state and the helpers its rules share (the rules: saves, reads, transfer, machine)."""

    engine: NumpyEngine
    workload: Workload
    codecs: tuple[str, ...] = ("raw", "zstd")
    # the engine's restore takes session=: the invariants' restores speak as the snapshot's own
    # session, so checking a snapshot is no outside use (an engine without it: every check is one)
    observe_as_session: bool = False
    # the engine's open() takes extra Store.open options (admit=): write admission is drawn too
    open_takes_options: bool = False

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


    def _new_file(self) -> str:
        os.makedirs(os.path.join(self.root, "files"), exist_ok=True)
        return os.path.join(self.root, "files", f"f{len(self.files)}.snapx")


    @staticmethod
    def _chain(live: Mapping[int, Any], sid: int) -> list[int]:
        """``sid``'s chain, root first, from the parents ``live`` (SnapshotInfo by id) names."""
        out: list[int] = []
        at: int | None = sid
        while at is not None:
            out.append(at)
            at = live[at].parent_id
        return out[::-1]
