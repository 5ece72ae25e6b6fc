"""``IdentityWatch``: keeps a ``SlotStore``'s identity equal to what llama-server serves now.

The bridge asks it before every restore and save (``current``): a cheap look (``_served.served_now``);
on any change the identity is taken again (``_served.identify``: weights, adapters, the K/V probe)
and the SlotStore switches to it, or persistence is refused while something cannot be seen.
``unchanged`` is the look after a slot was read or restored: a restart in between is caught.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from ._identify import BUILD_ENV, ModelInfo, build_warning
from ._served import Refusal, Served, identify, model_of, served_now
from ._slotfile import decode
from ._slotstore import SlotStore
from ._trace import ProbeTrace
from ._upstream import LlamaServer

__all__ = ["IdentityWatch"]

log = logging.getLogger("snapstore.engine.llamacpp")


class IdentityWatch:
    """The identity of the server at ``server`` as it is now; ``model``: --model (the served path by default)."""

    def __init__(self, server: LlamaServer, model: str | None, build: str | None) -> None:
        self.server = server
        served = served_now(server, model)
        self.model_hint = model
        self.hint_path = served.model_path if model else None  # the served path --model stands for
        self.build_given = build or os.environ.get(BUILD_ENV) or None
        self.build = self.build_given or served.build or "unspecified"
        self.build_warning = build_warning(served.build, self.build_given)
        self.model = model_of(served, model, self.hint_path)
        self.n_slots = served.n_slots  # the server's total_slots, as of the last identity take
        self.process = served.process  # and its per-process marker (another: a restarted server, its slots empty)
        self.refusal: Refusal | None = None  # why nothing may be persisted now (None: persisting)
        self._served: Served | None = None  # what the identity was last taken for
        self._first = True  # no identity taken yet: the probe slot's content is kept whatever it finds
        self._lock = threading.Lock()
        self.trace = ProbeTrace()  # what the probes left in the server's /metrics and /slots (_trace)

    def current(self, slots: SlotStore, hold: Callable[[], AbstractContextManager[int | None]],
                on_change: Callable[[ModelInfo], None]) -> tuple[int, Served] | None:
        """The identity generation that holds now and the server's state; on any change the identity
        is taken again, its probe in the idle slot ``hold()`` reserves while it runs, and ``on_change``
        runs (whatever the caller knew of the server's slots no longer holds). None: persistence is
        refused now."""
        served = served_now(self.server, self.model_hint)
        with self._lock:
            if self._served is None or served.signature != self._served.signature:
                with hold() as slot:
                    if slot is None:  # every slot busy: refuse this time, take it at the next look
                        self.refusal = Refusal("busy", "no idle slot for the identity probe now")
                        self._served = None
                        return None
                    self._retake(slots, served, slot, on_change)
            if self.refusal is not None:
                return None
            return slots.generation, served

    def _retake(self, slots: SlotStore, served: Served, slot: int, on_change: Callable[[ModelInfo], None]) -> None:
        first = self._first
        self._served, self.refusal = served, None
        self.n_slots, self.process = served.n_slots, served.process  # sized anew on every take (-np may differ)
        on_change(slots.model)
        build = self.build_given or served.build or "unspecified"
        try:  # the probe slot's content is kept at start and when the identity did not change
            model, sf, runtime = identify(self.server, served, slot, model_hint=self.model_hint,
                                          hint_path=self.hint_path,
                                          decode_with=lambda m: lambda b: decode(b, m.shape, what=f"slot {slot}"),
                                          keep_slot=lambda m, r: first or slots.is_current(m, build, r.to_extra()),
                                          trace=self.trace)
        except Refusal as e:
            self._first = False
            self.refusal = e
            log.warning("llama-server at %s: %s", self.server.upstream, e)
            return
        except BaseException:
            self._served = None  # not taken: the next request tries again
            raise
        self._first = False
        self.build = build
        changed = slots.switch(model, self.build, runtime.to_extra(), sf)
        slots.open_for(sf)
        on_change(model)
        if changed and not first:
            log.warning("llama-server at %s now serves %s (%s, build %s): switched to its identity; state of the "
                        "previous one is never restored into it", self.server.upstream, model.path, model.pack,
                        self.build)

    def loras(self) -> tuple[Mapping[str, Any], ...]:
        """The server's adapters and scales as of the last identity take (``/lora-adapters``)."""
        return self._served.loras if self._served is not None else ()

    def unchanged(self, generation: int | None, signature: str) -> bool:
        """True when the server still serves what a request planned under ``generation`` saw (``signature``)."""
        return generation is not None and served_now(self.server, self.model_hint).signature == signature
