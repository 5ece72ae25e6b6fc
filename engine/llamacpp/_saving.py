"""The saving side of ``LlamaBridge``: after a request, find the slot that holds its prompt with its
provenance proven, copy it out, and store its boundaries (the system prompt's end, the whole prompt)
in the background; for hybrid models, capture each boundary exactly before the request runs.

A base of :class:`snapstore.engine.llamacpp._bridge.LlamaBridge`, which supplies the attributes and the
slot bookkeeping (reserve, capture, landed, release) declared here; kept apart so the bridge module
holds the restore side and the slot bookkeeping, this one what is saved and when.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

from snapstore import InvalidInputError, SnapstoreError, StateError

from ._prompt import lcp as _lcp
from ._prompt import tokens_in as _tokens_in
from ._request import BridgeEvents, Plan
from ._served import lora_matches
from ._slotmodel import SlotFile, SlotFormatError
from ._slotstore import SlotStore
from ._storer import Storer
from ._upstream import JsonObject, LlamaServer
from ._watch import IdentityWatch

__all__ = ["BridgeSaving", "holding_candidates"]

log = logging.getLogger("snapstore.engine.llamacpp")


def holding_candidates(states: Mapping[int, JsonObject], n_tokens: int) -> list[int]:
    """Idle slots whose last task may have left a prompt of ``n_tokens`` (a slot counts the prompt
    and what it generated): the nearest in length first, then the latest task. Only candidates: the
    copy's own tokens and the slot's provenance decide (``LlamaBridge._copy_out``)."""
    cands = [s for s in states.values()
             if not s.get("is_processing") and int(s.get("n_prompt_tokens") or 0) >= n_tokens]
    cands.sort(key=lambda s: (int(s.get("n_prompt_tokens") or 0) - n_tokens, -int(s.get("id_task") or 0)))
    return [int(s["id"]) for s in cands]


class BridgeSaving:
    """``after(plan, ok, served_slot)`` and the background store of what it copied out; hybrid captures."""

    server: LlamaServer
    watch: IdentityWatch
    slots: SlotStore
    storer: Storer
    events: BridgeEvents
    hybrid: bool
    n_slots: int
    _pick: threading.Lock
    _known: list[list[int]]
    _used: list[float]
    _clean: list[bool]
    _taints: int

    def _skip(self, reason: str) -> None:
        raise NotImplementedError  # LlamaBridge: count a skipped save

    def _reserve(self, tokens: Sequence[int], gain: int, wanted: int | None, *, need: bool = False) -> int | None:
        raise NotImplementedError  # LlamaBridge: take an idle slot for this request

    def _capture(self, slot: int, tokens: list[int]) -> SlotFile:
        raise NotImplementedError  # LlamaBridge: evaluate ``tokens`` in ``slot`` and copy it out

    def _landed(self, plan: Plan) -> None:
        raise NotImplementedError  # LlamaBridge: the plan's save is done (wait_landed)

    def release(self, plan: Plan) -> None:
        raise NotImplementedError  # LlamaBridge: free the plan's reservation

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
