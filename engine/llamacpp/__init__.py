"""llama.cpp integration: llama-server slot files as deduplicated, verified, budgeted snapshots.

``SlotStore`` imports/exports slot files; ``LlamaBridge`` gives a running llama-server prefix
persistence (restore the longest stored prefix into a slot, save at system-prompt and
conversation boundaries); ``snapstore llama-proxy`` serves the bridge as an HTTP proxy. No torch
anywhere here. See docs/engine.md ("llama.cpp").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from ._slotfile import KNOWN_VERSIONS, ModelShape, SlotFile, SlotFormatError, decode, encode

if TYPE_CHECKING:
    from ._bridge import LlamaBridge
    from ._slotstore import SlotStore

__all__ = ["KNOWN_VERSIONS", "LlamaBridge", "ModelShape", "SlotFile", "SlotFormatError", "SlotStore", "decode",
           "encode"]

# the bridge and the slot store load on first use: the snapstore CLI registers this integration's
# commands (its cli module, under this package) without importing them
__getattr__, __dir__ = lazy_names(__name__, {"LlamaBridge": "._bridge", "SlotStore": "._slotstore"}, __all__)
