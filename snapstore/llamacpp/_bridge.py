"""``LlamaBridge``: prefix persistence for a running llama-server, decided per request.

It drives llama-server through its own HTTP API (``/tokenize``, ``/apply-template``,
``/completion``, ``/slots``; ``_upstream``) so that a request first gets the longest stored prefix
restored into its slot, and its boundaries — the end of the system prompt (shared by new chats)
and the conversation's own prompt (under its session) — are saved through a ``SlotStore``
(``_slotstore``). ``snapstore llama-proxy`` (``_proxy.py``) wraps it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._config import Budget
from .._errors import InvalidInputError, SnapstoreError
from ._identity import ModelInfo
from ._served import request_unkeyable
from ._slotfile import SlotFile, SlotFormatError
from ._slotstore import ImportResult, SlotStore, export_snapshot
from ._upstream import JsonObject, LlamaServer, UpstreamError
from ._watch import IdentityWatch

# ImportResult and export_snapshot lived here before the split: kept importable from here
__all__ = ["BridgeEvents", "ImportResult", "LlamaBridge", "Plan", "SlotStore", "UpstreamError", "export_snapshot"]

log = logging.getLogger("snapstore.llamacpp")


@dataclass
class BridgeEvents:
    """Callbacks for metrics: each gets the decision's facts (all optional)."""

    on_restore: Callable[[int, float, int], None] | None = None  # tokens, seconds, bytes
    on_miss: Callable[[], None] | None = None
    on_save: Callable[[int, float, int], None] | None = None  # tokens, seconds, stored bytes
    on_skip: Callable[[str], None] | None = None  # reason


@dataclass
class Plan:
    """One request's slot, prompt tokens and boundaries, from ``LlamaBridge.before``."""

    slot: int
    body: JsonObject
    tokens: list[int] = field(default_factory=list)
    system_end: int = 0
    session: str | None = None
    restored: int = 0
    done: bool = False
    generation: int | None = None  # the identity it was planned under (None: nothing restored or saved)
    served: str = ""  # the server's signature then (_served.Served.signature)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else n


CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETION_PATHS = ("/completion", "/completions", "/v1/completions")
SESSION_HEADER = "X-Snapstore-Session"


class LlamaBridge:
    """Prefix persistence for a running llama-server, driven through its HTTP API.

    ``before(path, body)`` picks a slot, restores the longest stored prefix into it when that
    beats what the slot holds, and (hybrid models) captures exact boundaries; the caller then
    sends ``plan.body`` upstream and calls ``after(plan)``, which saves the boundaries of an
    attention model from the slot. ``release(plan)`` frees the slot (always call it).
    """

    def __init__(self, upstream: str, slot_save_path: str, model: str | None = None, *, store_dir: str | None = None,
                 build: str | None = None, budget: Budget | None = None, events: BridgeEvents | None = None,
                 timeout: float = 600.0, keep_stale: bool = False) -> None:
        self.server = LlamaServer(upstream, slot_save_path, timeout)
        self.upstream = self.server.upstream
        self.slot_dir = slot_save_path
        self.timeout = timeout
        self.events = events or BridgeEvents()
        self.watch = IdentityWatch(self.server, model, build)  # what the server serves now (_watch)
        self.slots = SlotStore(store_dir, self.watch.model, self.watch.build, budget=budget,
                               drop_stale=not keep_stale)
        self.hybrid = self.slots.model.shape.hybrid
        self.n_slots = self.watch.n_slots
        self._known: list[list[int]] = [[] for _ in range(self.n_slots)]
        self._locks = [threading.Lock() for _ in range(self.n_slots)]
        self._pick = threading.Lock()

    def start(self) -> None:
        """Take the identity (the K/V probe runs in slot 0 and puts its content back) and open the store."""
        if self.watch.build_warning:
            log.warning("%s", self.watch.build_warning)
        with self._locks[0]:
            self.watch.current(self.slots, 0, self._forget)

    # -- identity (_watch) ---------------------------------------------------------------------
    @property
    def refusal_reason(self) -> str | None:
        """Why nothing is persisted now (``_served.Refusal.reason``), or None."""
        return None if self.watch.refusal is None else self.watch.refusal.reason

    @property
    def build(self) -> str:
        """The build the identity is keyed under now."""
        return self.watch.build

    def _skip(self, reason: str) -> None:
        if self.events.on_skip:
            self.events.on_skip(reason)

    def _forget(self, model: ModelInfo) -> None:
        """The server changed: nothing known of its slots holds, and the model may be another."""
        self._known = [[] for _ in range(self.n_slots)]
        self.hybrid = model.shape.hybrid

    def _unchanged(self, plan: Plan) -> bool:
        return self.watch.unchanged(plan.generation, plan.served)

    def _admit(self, plan: Plan, body: Mapping[str, Any]) -> bool:
        """Whether ``plan`` may restore and save: the identity holds and the request adds nothing unkeyed."""
        now = self.watch.current(self.slots, plan.slot, self._forget)
        if now is None:
            self._skip(self.refusal_reason or "refused")
            return False
        reason = request_unkeyable(body, now[1])
        if reason is not None:
            log.info("slot %d: %s carries inputs the identity cannot key; not restored or saved", plan.slot, reason)
            self._skip(reason)
            return False
        plan.generation, plan.served = now[0], now[1].signature
        return True

    def close(self) -> None:
        """Close the store."""
        self.slots.close()

    # -- prompts -------------------------------------------------------------------------------
    def prompt_of(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
                  ) -> tuple[list[int], int, str | None]:
        """Prompt tokens, the end of the system prompt / tool list (0: none), and the session key."""
        session = (headers or {}).get(SESSION_HEADER) or None
        if path in CHAT_PATHS:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return [], 0, session
            full = self.server.tokenize(self.server.render(msgs, body))
            head = [m for m in msgs if isinstance(m, dict) and m.get("role") in ("system", "developer")]
            k = len(head)
            if head and msgs[:k] == head or body.get("tools"):
                sys_tokens = self.server.tokenize(self.server.render(msgs[:k], body))
                system_end = _lcp(sys_tokens, full)
            else:
                system_end = 0
            if session is None:
                first_user = next((m for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
                key = json.dumps([msgs[:k], first_user, body.get("tools")], sort_keys=True, default=str)
                session = "chat:" + hashlib.sha256(key.encode()).hexdigest()[:24]
            return full, system_end, session
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt], 0, session
        if isinstance(prompt, str):
            return self.server.tokenize(prompt), 0, session
        return [], 0, session

    # -- slots ---------------------------------------------------------------------------------
    def _choose_slot(self, tokens: Sequence[int], wanted: Any) -> int:
        if isinstance(wanted, int) and 0 <= wanted < self.n_slots:
            self._locks[wanted].acquire()
            return wanted
        while True:
            with self._pick:
                order = sorted(range(self.n_slots), key=lambda s: -_lcp(self._known[s], tokens))
                for s in order:
                    if self._locks[s].acquire(blocking=False):
                        return s
            time.sleep(0.005)

    def _capture(self, slot: int, tokens: list[int]) -> SlotFile:
        """Evaluate exactly ``tokens`` into ``slot`` (no generation) and read the slot back."""
        self.server.post("/completion", {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
                                   "stream": False})
        sf = self.slots.decode(self.server.save_slot(slot), what=f"slot {slot}")
        self._known[slot] = sf.tokens.tolist()
        return sf

    # -- decisions -----------------------------------------------------------------------------
    def before(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Plan:
        """Choose the slot, restore the longest stored prefix that beats it, capture hybrid boundaries."""
        tokens, system_end, session = self.prompt_of(path, body, headers)
        slot = self._choose_slot(tokens, body.get("id_slot"))
        plan = Plan(slot=slot, body={**body, "id_slot": slot, "cache_prompt": True}, tokens=tokens,
                    system_end=system_end, session=session)
        try:
            if len(tokens) >= 2 and self._admit(plan, body):
                self._maybe_restore(plan)
                if self.hybrid:
                    self._hybrid_captures(plan)
        except SnapstoreError as e:  # the request still goes through; it just reads more tokens
            log.warning("slot %d: restore skipped: %s", slot, e)
            self._known[slot] = []
            if self.events.on_skip:
                self.events.on_skip("restore_error")
        except BaseException:
            self.release(plan)
            raise
        return plan

    def _slot_reuse(self, slot: int, tokens: Sequence[int]) -> int:
        known = self._known[slot]
        common = _lcp(known, tokens)
        if self.hybrid:  # recurrent state only continues from exactly the slot's end
            return common if common == len(known) and common < len(tokens) else 0
        return min(common, len(tokens) - 1)

    def _maybe_restore(self, plan: Plan) -> None:
        have = self._slot_reuse(plan.slot, plan.tokens)
        m = self.slots.match(plan.tokens[:-1], plan.generation)  # leave the server at least one token to read
        if m is None or m.n_tokens <= have:
            if m is None and self.events.on_miss:
                self.events.on_miss()
            log.info("slot %d: no restore (store %s, slot reuses %d of %d)", plan.slot,
                     "miss" if m is None else f"has {m.n_tokens}", have, len(plan.tokens))
            return
        t0 = time.perf_counter()
        data = self.slots.export_bytes(m, session=plan.session, generation=plan.generation)
        self.server.restore_slot(plan.slot, data, m.n_tokens)
        if not self._unchanged(plan):  # restarted or changed between the look and the restore: undo it
            self.server.post(f"/slots/{plan.slot}?action=erase", {})
            self._known[plan.slot], plan.generation = [], None
            log.warning("slot %d: llama-server changed while restoring; the slot was erased", plan.slot)
            self._skip("identity_changed")
            return
        self._known[plan.slot] = list(plan.tokens[: m.n_tokens])
        dt = time.perf_counter() - t0
        plan.restored = m.n_tokens
        log.info("slot %d: restored %d of %d prompt tokens from snapshot %d (%d bytes, %.1f ms)", plan.slot,
                 m.n_tokens, len(plan.tokens), m.snapshot_id, len(data), dt * 1e3)
        if self.events.on_restore:
            self.events.on_restore(m.n_tokens, dt, len(data))

    def _stored(self, tokens: Sequence[int]) -> bool:
        m = self.slots.match(tokens)
        return m is not None and m.n_tokens == len(tokens)

    def _boundaries(self, plan: Plan, upto: int) -> list[tuple[int, str | None]]:
        out: list[tuple[int, str | None]] = []
        if 0 < plan.system_end < upto:
            out.append((plan.system_end, None))
        out.append((upto, plan.session))
        return out

    def _store(self, sf: SlotFile, n: int, session: str | None, what: str, plan: Plan) -> None:
        if not self._unchanged(plan):  # the slot was read from another server process or setting
            log.info("slot save skipped at %d tokens (%s): llama-server changed since the request", n, what)
            self._skip("identity_changed")
            return
        t0 = time.perf_counter()
        res = self.slots.save(sf, n, session=session, generation=plan.generation)
        dt = time.perf_counter() - t0
        if res.skipped:
            log.info("slot save skipped at %d tokens (%s): %s", n, what, res.skipped)
            if self.events.on_skip:
                self.events.on_skip(res.skipped)
            return
        log.info("saved %d tokens (%s) as snapshot %d over %s: %d bytes stored, %.1f ms", n, what,
                 res.snapshot_id, res.parent_id, res.stored_bytes, dt * 1e3)
        if self.events.on_save:
            self.events.on_save(n, dt, res.stored_bytes)

    def _hybrid_captures(self, plan: Plan) -> None:
        # a recurrent state is only valid where it was taken: evaluate each boundary exactly
        for n, session in self._boundaries(plan, len(plan.tokens) - 1):
            what = "system prompt" if session is None and n == plan.system_end else "conversation"
            if self._stored(plan.tokens[:n]):
                log.info("slot %d: %s boundary at %d already stored", plan.slot, what, n)
                if self.events.on_skip:
                    self.events.on_skip("already_stored")
                continue
            sf = self._capture(plan.slot, list(plan.tokens[:n]))
            if sf.tokens.tolist() != list(plan.tokens[:n]):
                log.warning("slot %d: capture holds other tokens than the prompt; not saved", plan.slot)
                continue
            self._store(sf, n, session, what, plan)

    def after(self, plan: Plan, ok: bool = True) -> None:
        """After the upstream response: save the attention model's boundaries from the slot."""
        if plan.done:
            return
        plan.done = True
        if plan.generation is None:  # declined or refused: what the slot holds now is not known here
            self._known[plan.slot] = []
            return
        if not ok or len(plan.tokens) < 2:
            return
        try:
            if self.hybrid:
                self._known[plan.slot] = []  # generation moved it on; what exactly, only the server knows
                return
            sf = self.slots.decode(self.server.save_slot(plan.slot), what=f"slot {plan.slot}")
            self._known[plan.slot] = sf.tokens.tolist()
            upto = _lcp(sf.tokens.tolist(), plan.tokens)
            for n, session in self._boundaries(plan, upto):
                what = "system prompt" if session is None else "conversation"
                if n < 1:
                    continue
                if session is None and self._stored(plan.tokens[:n]):
                    if self.events.on_skip:
                        self.events.on_skip("already_stored")
                    continue
                self._store(sf, n, session, what, plan)
        except (SnapstoreError, SlotFormatError, InvalidInputError) as e:
            log.warning("slot %d: save skipped: %s", plan.slot, e)
            if self.events.on_skip:
                self.events.on_skip("save_error")

    def release(self, plan: Plan) -> None:
        """Free the plan's slot for the next request."""
        lock = self._locks[plan.slot]
        if lock.locked():
            lock.release()
