"""The bridge's per-request record (``Plan``) and its metric callbacks (``BridgeEvents``), for ``_bridge``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ._upstream import JsonObject

__all__ = ["BridgeEvents", "Plan"]


@dataclass
class BridgeEvents:
    """Callbacks for metrics: each gets the decision's facts (all optional)."""

    on_restore: Callable[[int, float, int], None] | None = None  # tokens, seconds, bytes
    on_miss: Callable[[], None] | None = None
    on_save: Callable[[int, float, int], None] | None = None  # tokens, seconds, stored bytes
    on_skip: Callable[[str], None] | None = None  # reason


@dataclass
class Plan:
    """One request's prompt tokens and boundaries, from ``LlamaBridge.before``.

    ``slot`` is the slot the bridge put the request in (it restored into it, or the client named
    it); None: the server picks, and ``after`` learns which from the response or ``/slots``.
    """

    body: JsonObject
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    system_end: int = 0
    session: str | None = None
    kind: str = "completion"  # what a save of the whole prompt is logged as: "completion prompt" / "conversation"
    restored: int = 0
    done: bool = False
    reserved: bool = False
    ticket: int = 0  # 0: not yet open (before() gives it one); -1: released
    generation: int | None = None  # the identity it was planned under (None: nothing restored or saved)
    served: str = ""  # the server's signature then (_served.Served.signature)
    landing: int = 0  # its ticket once answered, until its save has landed or was given up (0: none)
    cache_n: int | None = None  # prompt tokens the server reused for it (the response's timings.cache_n; None: unsaid)
