"""The llama.cpp integration's old import path: it lives in :mod:`snapstore.engine.llamacpp` now.

``from snapstore.llamacpp import SlotFile, decode, ...`` keeps working (docs/engine.md "llama.cpp").
"""

from __future__ import annotations

from snapstore.engine.llamacpp import KNOWN_VERSIONS, ModelShape, SlotFile, SlotFormatError, decode, encode

__all__ = ["KNOWN_VERSIONS", "ModelShape", "SlotFile", "SlotFormatError", "decode", "encode"]
