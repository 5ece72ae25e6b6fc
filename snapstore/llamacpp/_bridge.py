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

from snapstore._config import Budget
from snapstore._errors import InvalidInputError, SnapstoreError, StateError
from snapstore.llamacpp._identity import ModelInfo
from snapstore.llamacpp._plan import BridgeEvents, Plan
from snapstore.llamacpp._prompt import CHAT_PATHS, prompt_of
from snapstore.llamacpp._prompt import lcp as _lcp
from snapstore.llamacpp._prompt import tokens_in as _tokens_in
from snapstore.llamacpp._served import lora_matches, request_unkeyable, requested_slot
from snapstore.llamacpp._slotmodel import SlotFile, SlotFormatError
from snapstore.llamacpp._slotstore import ImportResult, SlotStore, export_snapshot
from snapstore.llamacpp._slotwindow import capture
from snapstore.llamacpp._storer import Storer
from snapstore.llamacpp._upstream import JsonObject, LlamaServer, UpstreamError
from snapstore.llamacpp._watch import IdentityWatch

# ImportResult and export_snapshot lived here before the split: kept importable from here
__all__ = ["BridgeEvents", "ImportResult", "LlamaBridge", "Plan", "SlotStore", "UpstreamError", "export_snapshot"]

log = logging.getLogger("snapstore.llamacpp")
# paths whose POSTs never touch a slot's cache: every other POST the bridge did not plan and admit
# may fill a slot with state the identity does not key (``LlamaBridge.foreign``)
SLOT_FREE_PATHS = frozenset({"/tokenize", "/detokenize", "/apply-template"})


def holding_candidates(states: Mapping[int, JsonObject], n_tokens: int) -> list[int]:
    """Idle slots whose last task may have left a prompt of ``n_tokens`` (a slot counts the prompt
    and what it generated): the nearest in length first, then the latest task. Only candidates: the
    copy's own tokens and the slot's provenance decide (``LlamaBridge._copy_out``)."""
    cands = [s for s in states.values()
             if not s.get("is_processing") and int(s.get("n_prompt_tokens") or 0) >= n_tokens]
    cands.sort(key=lambda s: (int(s.get("n_prompt_tokens") or 0) - n_tokens, -int(s.get("id_task") or 0)))
    return [int(s["id"]) for s in cands]


class LlamaBridge:
    """Prefix persistence for a running llama-server, driven through its HTTP API.

    ``before(path, body)`` restores the longest stored prefix into an idle slot when no slot holds
    as much of the prompt (and, hybrid models, captures exact boundaries); the caller sends
    ``plan.body`` upstream and calls ``after(plan, ok, served_slot)``, which copies the slot out and
    hands the saving to the background. No call waits for another request: a slot the bridge
    cannot have at once is simply not used.
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

    def _boundaries(self, plan: Plan, upto: int) -> list[tuple[int, str | None, str]]:
        """(tokens, session, what) to save when the slot holds ``upto`` of the prompt."""
        out: list[tuple[int, str | None, str]] = []
        if 0 < plan.system_end < upto:
            out.append((plan.system_end, None, "system prompt"))
        if upto >= len(plan.tokens) - (1 if self.hybrid else 0):  # the whole prompt; never a part of it
            label = plan.kind if plan.session is None else f"{plan.kind}, session {plan.session}"
            out.append((upto, plan.session, label))
        return out

    def _store(self, sf: SlotFile, n: int, session: str | None, what: str, plan: Plan) -> None:
        t0 = time.perf_counter()
        try:  # a save planned under an older identity is refused (SlotStore's generation check)
            res = self.slots.save(sf, n, session=session, generation=plan.generation)
        except StateError as e:
            log.info("slot save skipped at %d tokens (%s): %s", n, what, e)
            self._skip("identity_changed")
            return
        dt = time.perf_counter() - t0
        if res.skipped:
            log.info("slot save skipped at %d tokens (%s): %s", n, what, res.skipped)
            self._skip(res.skipped)
            return
        log.info("saved %d tokens (%s) as snapshot %d over %s: %d bytes stored, %.1f ms", n, what,
                 res.snapshot_id, res.parent_id, res.stored_bytes, dt * 1e3)
        if self.events.on_save:
            self.events.on_save(n, dt, res.stored_bytes)

    def _hybrid_captures(self, plan: Plan, wanted: int | None) -> None:
        # a recurrent state is only valid where it was taken: evaluate each boundary exactly, in a
        # slot of the proxy's choosing (an idle one; none idle: no capture this time)
        todo = []
        for n, session, what in self._boundaries(plan, len(plan.tokens) - 1):
            if self.slots.holds(plan.tokens[:n]):
                log.info("%s boundary at %d already stored", what, n)
                self._skip("already_stored")
            else:
                todo.append((n, session, what))
        if todo and plan.slot is None:
            slot = self._reserve(plan.tokens, 0, wanted, need=True)
            if slot is None:
                return
            plan.slot, plan.reserved = slot, True
            plan.body["id_slot"] = slot
        if todo and plan.slot is not None and not self._clean[plan.slot]:
            log.info("slot %d: no capture: the slot may hold state the identity does not key", plan.slot)
            self._skip("slot_unproven")
            return
        for n, session, what in todo:
            assert plan.slot is not None
            sf = self._capture(plan.slot, list(plan.tokens[:n]))
            if sf.tokens.tolist() != list(plan.tokens[:n]):
                log.warning("slot %d: capture holds other tokens than the prompt; not saved", plan.slot)
                continue
            self._store(sf, n, session, what, plan)

    def _copy_out(self, plan: Plan, hint: int | None) -> tuple[int, bytes] | str:
        """The slot holding the most of ``plan``'s prompt and its file, or why none is stored.

        A copy is stored only with its provenance proven: the slot is the request's own (the bridge put
        it there, the response named it, or the server has one slot) and the request read its whole
        prompt (``timings.cache_n`` 0) or reused only what the slot provably held; or, for a reply that
        names no slot, a slot still proven (only admitted requests ran there since it was). Its last
        task's ``lora`` must be the server's adapters, the copy's own tokens must hold the prompt, and
        the slot must run no other task between the look and the copy.
        """
        with self._pick:
            taints = self._taints
        states = self.server.slot_states()
        known = plan.slot if plan.slot is not None else hint if hint is not None else 0 if self.n_slots == 1 else None
        if known is not None:
            cands = [known]
        else:
            with self._pick:
                cands = [s for s in holding_candidates(states, len(plan.tokens))
                         if s < self.n_slots and self._clean[s]][:2]
            if not cands:
                return "slot_unknown"
        why = "slot_busy"
        best: tuple[int, int, bytes] | None = None
        for slot in cands:
            st = states.get(slot)
            if slot >= self.n_slots:  # a slot of a server that changed since (its next take sizes the lists)
                why = "slot_unknown"
                continue
            if st is None or st.get("is_processing"):
                why = "slot_busy"  # busy again: the conversation's next request runs there, its save covers this
                continue
            params = st.get("params")
            if not isinstance(params, dict) or not lora_matches(params.get("lora"), self.watch.loras()):
                why = "slot_lora"  # its last task computed with other adapters (or the server does not say)
                continue
            fresh = known is not None and plan.cache_n == 0  # the request read all of its prompt itself
            with self._pick:
                proven = self._clean[slot] and (known is None or (
                    plan.cache_n is not None and _lcp(self._known[slot], plan.tokens) >= plan.cache_n))
            if not (fresh or proven):
                why = "slot_unproven"
                continue
            data = self.server.save_slot(slot)  # the copy: from here on the slot is the next request's
            again = self.server.slot_states().get(slot)
            if again is None or again.get("is_processing") or again.get("id_task") != st.get("id_task"):
                why = "slot_changed"  # another task ran there between the look and the copy
                continue
            held = _tokens_in(data)
            n = _lcp(held, plan.tokens)
            with self._pick:
                if self._taints != taints or not (fresh or self._clean[slot]):
                    why = "slot_unproven"  # a foreign request or an identity take came in between
                    continue
                self._known[slot] = held
                self._used[slot] = time.monotonic()
                if fresh and n >= len(plan.tokens):
                    self._clean[slot] = True
            if best is None or n > best[0]:
                best = (n, slot, data)
            if n >= len(plan.tokens):
                break
        return why if best is None else (best[1], best[2])

    def after(self, plan: Plan, ok: bool = True, served_slot: int | None = None, cancelled: bool = False) -> None:
        """After the upstream response: copy the slot out and queue its boundaries for storing.

        ``served_slot``: the slot the response named (``id_slot``); ``cancelled``: the client left
        before the end — then nothing is saved unless the server had read the whole prompt.
        """
        if plan.done:
            return
        plan.done = True
        queued = False
        try:
            queued = self._copy_and_queue(plan, ok, served_slot, cancelled)
        finally:
            if not queued:
                self._landed(plan)

    def _copy_and_queue(self, plan: Plan, ok: bool, served_slot: int | None, cancelled: bool) -> bool:
        """``after``'s work: True when a copy of the slot was handed to the storer."""
        try:
            if plan.generation is None:  # declined or refused: what its slot holds now is not known here
                if plan.slot is not None:
                    self._known[plan.slot] = []
                return False
            if not (ok or cancelled) or len(plan.tokens) < 2:
                return False
            if self.hybrid:
                if plan.slot is not None:
                    self._known[plan.slot] = []  # generation moved it on; what exactly, only the server knows
                return False
            copied = self._copy_out(plan, served_slot)
            if isinstance(copied, str):
                log.info("no save: no slot holding the request's prompt is proven its own (%s)", copied)
                self._skip(copied)
                return False
            slot, data = copied
            if not self.watch.unchanged(plan.generation, plan.served):  # read from another server or setting
                log.info("slot %d: save skipped: llama-server changed since the request", slot)
                self._skip("identity_changed")
                return False
        except (SnapstoreError, SlotFormatError, InvalidInputError) as e:
            log.warning("slot %s: save skipped: %s", plan.slot, e)
            self._skip("save_error")
            return False
        finally:
            self.release(plan)
        self.storer.put((plan, slot, data, cancelled))
        return True

    def _store_job(self, job: tuple[Plan, int, bytes, bool]) -> None:
        """Decode a copied slot and store the boundaries it holds (the storer's thread)."""
        plan, slot, data, cancelled = job
        try:
            sf = self.slots.decode(data, what=f"slot {slot}")
            upto = _lcp(sf.tokens.tolist(), plan.tokens)
            if cancelled and upto < len(plan.tokens):
                log.info("slot %d: request cancelled before its prompt was read (%d of %d): not saved", slot,
                         upto, len(plan.tokens))
                return
            for n, session, what in self._boundaries(plan, upto):
                if self.slots.holds(plan.tokens[:n]):  # an exact repeat (or a shared system prompt): nothing new
                    self._skip("already_stored")
                    continue
                self._store(sf, n, session, what, plan)
        except (SnapstoreError, SlotFormatError, InvalidInputError) as e:
            log.warning("slot %d: save skipped: %s", slot, e)
            self._skip("save_error")
        finally:
            self._landed(plan)

    def _dropped(self, job: tuple[Plan, int, bytes, bool]) -> None:
        log.warning("slot %d: save skipped: the background store is %d saves behind", job[1], Storer.DEPTH)
        self._skip("busy")
        self._landed(job[0])

    def release(self, plan: Plan) -> None:
        """Free the plan's reservation (always call it; twice is harmless)."""
        self._unreserve(plan)

