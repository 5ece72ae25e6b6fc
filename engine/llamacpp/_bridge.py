"""``LlamaBridge``: prefix persistence for a running llama-server, decided per request.

It drives llama-server through its own HTTP API (``/tokenize``, ``/apply-template``, ``/slots``;
``_upstream``) so that a request gets the longest stored prefix restored into a slot when no slot
of the server already holds as much, and its boundaries — the end of the system prompt (shared by
new chats) and the conversation's own prompt (under its session) — are saved through a
``SlotStore`` (``_slotstore``). It adds to the server's own caches and never replaces them: a
request it restores nothing for goes upstream unchanged (the server picks the slot, its host-RAM
prompt cache included); a request that says ``cache_prompt: false`` is not touched at all. Saving
copies the slot out (one server slot save) and stores it in the background (``_storer``), so the
slot is free for the conversation's next request at once. Before every restore and save it looks
at what the server serves now (``_watch.IdentityWatch``): state planned under another identity is
never restored or stored. ``snapstore llama-proxy`` (``_proxy.py``) wraps it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from snapstore import Budget, SnapstoreError

from ._identify import ModelInfo
from ._prompt import CHAT_PATHS, prompt_of
from ._prompt import lcp as _lcp
from ._request import BridgeEvents, Plan
from ._saving import BridgeSaving, holding_candidates
from ._served import request_unkeyable, requested_slot
from ._slotmodel import SlotFile
from ._slotstore import ImportResult, SlotStore, export_snapshot
from ._slotwindow import capture
from ._storer import Storer
from ._upstream import LlamaServer, UpstreamError
from ._watch import IdentityWatch

# ImportResult and export_snapshot (and holding_candidates, now in _saving) lived here before the splits:
# kept importable from here
__all__ = ["BridgeEvents", "ImportResult", "LlamaBridge", "Plan", "SlotStore", "UpstreamError", "export_snapshot",
           "holding_candidates"]

log = logging.getLogger("snapstore.engine.llamacpp")
# paths whose POSTs never touch a slot's cache: every other POST the bridge did not plan and admit
# may fill a slot with state the identity does not key (``LlamaBridge.foreign``)
SLOT_FREE_PATHS = frozenset({"/tokenize", "/detokenize", "/apply-template"})


class LlamaBridge(BridgeSaving):
    """Prefix persistence for a running llama-server, driven through its HTTP API.

    ``before(path, body)`` restores the longest stored prefix into an idle slot when no slot holds
    as much of the prompt (and, hybrid models, captures exact boundaries); the caller sends
    ``plan.body`` upstream and calls ``after(plan, ok, served_slot)``, which copies the slot out and
    hands the saving to the background (that side: ``_saving.BridgeSaving``). No call waits for
    another request: a slot the bridge cannot have at once is simply not used.
    """

    def __init__(self, upstream: str, slot_save_path: str, model: str | None = None, *, store_dir: str | None = None,
                 build: str | None = None, budget: Budget | None = None, events: BridgeEvents | None = None,
                 timeout: float = 600.0, keep_stale: bool = False, api_key: str | None = None) -> None:
        self.server = LlamaServer(upstream, slot_save_path, timeout, api_key)
        self.upstream = self.server.upstream
        self.api_key = api_key
        self.slot_dir = slot_save_path
        self.timeout = timeout
        self.events = events or BridgeEvents()
        self.watch = IdentityWatch(self.server, model, build)  # what the server serves now (_watch)
        self.slots = SlotStore(store_dir, self.watch.model, self.watch.build, budget=budget,
                               drop_stale=not keep_stale)
        self.hybrid = self.slots.model.shape.hybrid
        self.n_slots = self.watch.n_slots
        self._known: list[list[int]] = [[] for _ in range(self.n_slots)]  # what each slot holds, as last seen
        self._used = [0.0] * self.n_slots
        # per slot: True while the bridge can prove all it holds was computed under the current identity
        # (found empty, restored or erased by the bridge, or filled from scratch by a request it admitted,
        # and only such requests ran since); a slot not proven is never stored
        self._clean = [False] * self.n_slots
        self._taints = 0  # how often every slot lost its proof (a foreign request, an identity switch)
        self._foreign = 0  # requests in flight that may fill a slot with state the identity does not key
        self._generation = -1  # the identity generation the proofs hold for
        self._process = self.watch.process
        self.passthrough: str | None = None  # why the bridge does nothing at all (a server without /slots)
        self._reserved: set[int] = set()  # slots the bridge restored into, until their request is done
        self._answered: dict[int, list[int]] = {}  # prompts answered in a slot the server picked, not yet copied
        self._landing: set[int] = set()  # answered requests whose save has not landed yet (wait_landed)
        self._tickets = itertools.count(1)
        self._pick = threading.Lock()
        self._settled = threading.Condition(self._pick)
        self._open = 0  # plans given out and not yet released
        self.storer = Storer(self._store_job, on_drop=self._dropped)

    def start(self) -> None:
        """Take the identity and open the store (drops stale identities): the K/V probe runs in an idle
        slot and leaves its content as it was (``_served.identify``); the slot layout comes with it.
        A server without ``/slots`` (``--no-slots``) is fronted as it is: nothing is restored or saved."""
        if self.watch.build_warning:
            log.warning("%s", self.watch.build_warning)
        try:
            self.server.slot_states()
        except UpstreamError as e:
            if "HTTP 501" not in str(e) and "expected a list" not in str(e):
                raise
            self.passthrough = ("llama-server has no /slots (started with --no-slots): which slot served a request "
                                "and what it holds cannot be seen, so nothing is restored or saved; every request "
                                "passes through untouched")
            log.warning("llama-server at %s: %s", self.upstream, self.passthrough)
            return
        self.watch.current(self.slots, self._probe_slot, self._forget)
        with self._pick:
            self._generation = self.slots.generation
        self._prove_empty()
        self.storer.start()

    def _prove_empty(self) -> None:
        """Slots that never ran a task (as a client sees ``/slots``: the identity probe taken out) hold
        nothing, so nothing of another identity."""
        raw = json.dumps(list(self.server.slot_states().values())).encode()
        shown = json.loads(self.watch.trace.slots(raw))
        with self._pick:
            for s in shown:
                if isinstance(s, dict) and isinstance(s.get("id"), int) and 0 <= s["id"] < self.n_slots \
                        and "id_task" not in s and not s.get("is_processing"):
                    self._clean[s["id"]] = True

    def foreign(self, delta: int) -> None:
        """A request the bridge does not admit (+1 when it is sent, -1 when it is done) may fill any slot
        with state the identity does not key (its own LoRA, media, a client's slot restore): no slot
        keeps its proof, at its start and at its end."""
        with self._pick:
            self._foreign += delta
            self._taint_all()

    def _taint_all(self) -> None:
        self._taints += 1
        self._clean = [False] * self.n_slots

    # -- identity (_watch) ---------------------------------------------------------------------
    @property
    def refusal_reason(self) -> str | None:
        """Why nothing is persisted now (``_served.Refusal.reason``, or ``no_slots``), or None."""
        if self.passthrough is not None:
            return "no_slots"
        return None if self.watch.refusal is None else self.watch.refusal.reason

    @property
    def build(self) -> str:
        """The build the identity is keyed under now."""
        return self.watch.build

    def _skip(self, reason: str) -> None:
        if self.events.on_skip:
            self.events.on_skip(reason)

    def _forget(self, model: ModelInfo) -> None:
        """The server changed: nothing known of its slots holds, the model may be another, and the server
        may have another number of slots (its ``total_slots`` now: every per-slot list sized anew)."""
        with self._pick:
            n = self.watch.n_slots
            if n != self.n_slots:
                self._used = (self._used + [0.0] * n)[:n]
                self._reserved = {s for s in self._reserved if s < n}
            self.n_slots = n
            self._known = [[] for _ in range(n)]
            self._clean = (self._clean + [False] * n)[:n]
            self._answered.clear()
        self.hybrid = model.shape.hybrid

    def _after_take(self, generation: int) -> None:
        """After an identity take: a restarted server's slots are empty (proven as at start); on an
        identity switch no slot filled before it is ever stored — each idle one is erased (the server
        would otherwise reuse state of the old identity), the others lose their proof."""
        with self._pick:
            process_changed = self.watch.process != self._process
            switched = generation != self._generation
            self._process, self._generation = self.watch.process, generation
            if not (process_changed or switched):
                return
            self._taint_all()
        if process_changed:  # a new server process: its slots hold only what admitted requests put there
            with self._pick:
                self._clean = [self._foreign == 0] * self.n_slots
            return
        states = self.server.slot_states()
        for slot, st in states.items():
            with self._pick:
                if slot >= self.n_slots or slot in self._reserved or st.get("is_processing"):
                    continue
                self._reserved.add(slot)
            try:
                self.server.erase_slot(slot)
                with self._pick:
                    self._known[slot] = []
                    self._clean[slot] = True
            finally:
                with self._pick:
                    self._reserved.discard(slot)

    @contextlib.contextmanager
    def _probe_slot(self) -> Iterator[int | None]:
        """An idle slot reserved for the identity probe while it runs (None: every slot is busy now)."""
        slot = self._reserve([], 0, None, need=True)
        try:
            yield slot
        finally:
            if slot is not None:
                with self._pick:
                    self._reserved.discard(slot)

    def _admit(self, plan: Plan, body: Mapping[str, Any]) -> bool:
        """Whether ``plan`` may restore and save: the identity holds and the request adds nothing unkeyed."""
        now = self.watch.current(self.slots, self._probe_slot, self._forget)
        if now is None:
            self._skip(self.refusal_reason or "refused")
            return False
        self._after_take(now[0])
        reason = request_unkeyable(body, now[1])
        if reason is not None:
            log.info("request carries %s, inputs the identity cannot key; not restored or saved", reason)
            self._skip(reason)
            return False
        plan.generation, plan.served = now[0], now[1].signature
        return True

    def close(self) -> None:
        """Finish the queued saves and close the store."""
        self.settle()
        self.storer.stop()
        self.slots.close()

    def prompt_of(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
                  ) -> tuple[list[int], int, str | None]:
        """Prompt tokens, the end of the system prompt / tool list (0: none), and the session key."""
        return prompt_of(self.server, path, body, headers)

    # -- slots ---------------------------------------------------------------------------------
    def _slot_reuse(self, slot: int, tokens: Sequence[int]) -> int:
        return self._reuse(self._known[slot], tokens)

    def _reuse(self, known: Sequence[int], tokens: Sequence[int]) -> int:
        """Prompt tokens the server would not read again from a slot holding ``known``."""
        common = _lcp(known, tokens)
        if self.hybrid:  # recurrent state only continues from exactly the slot's end
            return common if common == len(known) and common < len(tokens) else 0
        return min(common, len(tokens) - 1)

    def _covered(self, tokens: Sequence[int]) -> int:
        """The most of ``tokens`` any slot holds, as last seen or as a request just answered left it."""
        have = max((self._slot_reuse(s, tokens) for s in range(self.n_slots)), default=0)
        return max([have, *(self._reuse(t, tokens) for t in self._answered.values())])

    def _reserve(self, tokens: Sequence[int], gain: int, wanted: int | None, *, need: bool = False) -> int | None:
        """An idle slot to restore ``gain`` tokens into, reserved; None when a slot already covers as
        much (the server picks that one; ``need``: a slot is wanted anyway) or no slot is free now
        (the server queues the request)."""
        with self._pick:
            if not need and gain <= self._covered(tokens):
                return None
        idle = self.server.idle_slots()
        with self._pick:
            if not need and gain <= self._covered(tokens):
                return None
            if wanted is not None:  # the slot the request names (requested_slot; -1: none the server finds)
                cands = [wanted] if 0 <= wanted < self.n_slots else []
            else:
                cands = list(range(self.n_slots))
            cands = [s for s in cands if s in idle and s not in self._reserved]
            if not cands:
                return None
            # the slot whose loss costs least: the one nearest the prompt (it is superseded anyway), else LRU
            slot = min(cands, key=lambda s: (-self._slot_reuse(s, tokens), self._used[s]))
            self._reserved.add(slot)
            self._used[slot] = time.monotonic()
            return slot

    def _unreserve(self, plan: Plan) -> None:
        with self._pick:
            if plan.reserved and plan.slot is not None:
                self._reserved.discard(plan.slot)
            plan.reserved = False
            self._answered.pop(plan.ticket, None)
            if plan.ticket > 0:
                self._open -= 1
                self._settled.notify_all()
            plan.ticket = -1

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until every plan given out was released and its save stored (tests, shutdown)."""
        with self._settled:
            self._settled.wait_for(lambda: self._open == 0, timeout)
        self.storer.drain(timeout)

    def _capture(self, slot: int, tokens: list[int]) -> SlotFile:
        """Evaluate exactly ``tokens`` into ``slot`` and read the slot back (``_slotwindow.capture``)."""
        def read(toks: list[int]) -> SlotFile:
            self.server.post("/completion", {"prompt": toks, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
                                             "stream": False})
            sf = self.slots.decode(self.server.save_slot(slot), what=f"slot {slot}")
            self._known[slot] = sf.tokens.tolist()
            return sf
        return capture(read, tokens, self.slots.model.shape.n_swa)

    # -- decisions -----------------------------------------------------------------------------
    def before(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Plan | None:
        """Restore the longest stored prefix into an idle slot when no slot holds as much (and capture
        hybrid boundaries); None when the request asks the server not to cache its prompt."""
        if body.get("cache_prompt") is False or self.passthrough is not None:
            return None  # the client's word (or no /slots): no restore, no save, the request exactly as it came
        tokens, system_end, session = self.prompt_of(path, body, headers)
        plan = Plan(body=dict(body), tokens=tokens, system_end=system_end, session=session,
                    kind="conversation" if path in CHAT_PATHS else "completion prompt")
        wanted = requested_slot(body, self.n_slots)  # None: any idle slot (-1 or no field)
        if wanted is not None and wanted >= 0:
            plan.slot = wanted
        try:
            if len(tokens) >= 2 and self._admit(plan, body):
                self._maybe_restore(plan, wanted)
                if self.hybrid:
                    self._hybrid_captures(plan, wanted)
        except SnapstoreError as e:  # the request still goes through; it just reads more tokens
            log.warning("slot %s: restore skipped: %s", plan.slot, e)
            if plan.slot is not None:
                self._known[plan.slot] = []
            self._skip("restore_error")
        except BaseException:
            self.release(plan)
            raise
        with self._pick:
            plan.ticket = next(self._tickets)
            self._open += 1
        return plan

    def answered(self, plan: Plan) -> None:
        """The response is about to end: until ``after`` has copied the slot out, count the prompt as
        held by a slot (the conversation's next request, sent at once, then goes to that slot)."""
        with self._pick:
            if plan.ticket > 0:
                self._answered[plan.ticket] = plan.tokens
                plan.landing = plan.ticket
                self._landing.add(plan.ticket)

    def _landed(self, plan: Plan) -> None:
        """``plan``'s save is stored, skipped or given up: a ``wait_landed`` need not wait for it."""
        with self._pick:
            if plan.landing:
                self._landing.discard(plan.landing)
                plan.landing = 0
                self._settled.notify_all()

    def wait_landed(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the saves of the requests answered so far have landed, so
        that the proxy's series in a /metrics read after a response count that response's save."""
        with self._settled:
            target = set(self._landing)
            self._settled.wait_for(lambda: not (target & self._landing), timeout)

    def _maybe_restore(self, plan: Plan, wanted: int | None) -> None:
        m = self.slots.match(plan.tokens, plan.generation, weigh=True)  # an exact repeat too: it reads its last token
        if self.hybrid and m is not None and m.n_tokens >= len(plan.tokens):
            m = self.slots.match(plan.tokens[:-1], plan.generation, weigh=True)  # a recurrent state cannot give it back
        if m is None:
            if self.events.on_miss:
                self.events.on_miss()
            log.info("no restore (store miss, %d prompt tokens)", len(plan.tokens))
            return
        gain = min(m.n_tokens, len(plan.tokens) - 1)
        slot = self._reserve(plan.tokens, gain, wanted)
        if slot is None:
            log.info("no restore (store has %d of %d prompt tokens; a slot holds as much, or none is idle)",
                     m.n_tokens, len(plan.tokens))
            return
        plan.slot, plan.reserved = slot, True
        t0 = time.perf_counter()
        data = self.slots.export_bytes(m, session=plan.session, generation=plan.generation)
        if slot not in self.server.idle_slots():  # taken meanwhile: a restore now would wait for its task
            with self._pick:
                self._reserved.discard(slot)
            plan.slot, plan.reserved = (wanted if wanted is not None and wanted >= 0 else None), False
            log.info("slot %d: no restore: llama-server gave the slot to another request meanwhile", slot)
            self._skip("restore_slot_taken")
            return
        plan.body["id_slot"] = slot  # the request must find what was restored for it
        with self._pick:
            self._known[slot] = []
            self._clean[slot] = False
        self.server.restore_slot(slot, data, m.n_tokens)
        if not self.watch.unchanged(plan.generation, plan.served):  # changed while restoring: undo it
            self.server.erase_slot(slot)
            plan.generation = None
            log.warning("slot %d: llama-server changed while restoring; the slot was erased", slot)
            self._skip("identity_changed")
            return
        with self._pick:
            self._known[slot] = list(plan.tokens[: m.n_tokens])
            self._clean[slot] = True  # all it holds now is the snapshot, stored under this identity
        dt = time.perf_counter() - t0
        plan.restored = gain
        log.info("slot %d: restored %d of %d prompt tokens from snapshot %d (%d bytes, %.1f ms)", slot,
                 m.n_tokens, len(plan.tokens), m.snapshot_id, len(data), dt * 1e3)
        if self.events.on_restore:
            self.events.on_restore(m.n_tokens, dt, len(data))

    def release(self, plan: Plan) -> None:
        """Free the plan's reservation (always call it; twice is harmless)."""
        self._unreserve(plan)

