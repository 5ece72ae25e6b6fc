"""The llama.cpp integration's old import path: it lives in :mod:`snapstore.engine.llamacpp` now.

``from snapstore.llamacpp import SlotFile, decode, LlamaBridge, SlotStore, ...`` keeps working, and so
does ``from snapstore.llamacpp._bridge import LlamaBridge, SlotStore``, the path earlier docs showed
(docs/engine.md "llama.cpp"): that name is the integration's bridge module, registered here under its
old name. New code imports from ``snapstore.engine.llamacpp``.
"""

from __future__ import annotations

import sys

from snapstore.engine.llamacpp import (
    KNOWN_VERSIONS,
    LlamaBridge,
    ModelShape,
    SlotFile,
    SlotFormatError,
    SlotStore,
    decode,
    encode,
)

__all__ = ["KNOWN_VERSIONS", "LlamaBridge", "ModelShape", "SlotFile", "SlotFormatError", "SlotStore", "decode",
           "encode"]

sys.modules.setdefault(f"{__name__}._bridge", sys.modules[LlamaBridge.__module__])  # the bridge's own module
