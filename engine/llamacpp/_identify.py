"""What makes a llama-server slot reusable: the GGUF (SHA-256 and cache shape), the build, the runtime.

The store identity of a slot is ``build`` (the llama.cpp build), ``pack`` (``sha256:`` of the GGUF
file), ``kv`` (K/V types) and as extra keys the slot's constants (state version, streams,
transposed V / flash attention, unified K/V, every layer's types and row sizes) and the runtime
the server computes with (``_served``: LoRA adapters and scales, the K/V probe). A slot file of
another model, build or runtime setting has another identity, so it is never matched.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from snapstore import ConfigError, Identity, InvalidInputError

from ._modelshape import shape_of
from ._slotmodel import GGML_TYPES, ModelShape
from ._slotparts import SlotProto

__all__ = ["BUILD_ENV", "UNKNOWN_BUILDS", "ModelInfo", "build_warning", "file_sha256", "identity_for",
           "model_info", "model_shape"]

BUILD_ENV = "SNAPSTORE_LLAMA_BUILD"
# (path, size, mtime_ns) -> sha256: hashed once per process. No lock: a dict's get and set are each
# atomic, and two threads asking at once may both hash the file (the same digest), as before
_HASHES: dict[tuple[str, int, int], str] = {}


class ModelInfo:
    """A GGUF's SHA-256 and cache shape."""

    def __init__(self, path: str, sha256: str, shape: ModelShape) -> None:
        self.path, self.sha256, self.shape = path, sha256, shape

    @property
    def pack(self) -> str:
        """The identity's model pack: ``sha256:<hex>``."""
        return f"sha256:{self.sha256}"


def file_sha256(path: str) -> str:
    """SHA-256 hex of a file, hashed once per process for one (path, size, mtime)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    known = _HASHES.get(key)
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    _HASHES[key] = digest
    return digest


def model_info(path: str) -> ModelInfo:
    """Hash a GGUF and read the shape of its caches (``_modelshape``: which layers keep K/V, which
    recurrent state, the sliding window)."""
    shape = model_shape(path)
    return ModelInfo(path, file_sha256(path), shape)


def model_shape(path: str) -> ModelShape:
    """The shape of a GGUF's caches, from its metadata alone (no hash: a look at another model)."""
    if not os.path.isfile(path):
        raise InvalidInputError(f"no model file at {path}")
    try:
        import gguf
    except ImportError:  # pragma: no cover - the llamacpp extra installs it
        raise ConfigError("reading a GGUF needs the `gguf` package: pip install 'snapstore[llamacpp]'") from None
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the gguf reader raises plain ValueError/struct errors on a bad file
        raise InvalidInputError(f"{path} is not a readable GGUF file: {e}") from None
    return shape_of(reader, path)


UNKNOWN_BUILDS = ("", "b0-unknown", "unknown")  # what builds without version info report as build_info


def build_warning(reported: str, given: str | None) -> str | None:
    """The start-up warning when the build cannot be determined (no --build and no real build_info)."""
    if given or reported not in UNKNOWN_BUILDS:
        return None
    return (f"llama-server reports build_info {reported!r}, which does not tell its build; snapshots are keyed "
            f"under it (the K/V probe still tells builds whose numbers differ): pass --build B or set "
            f"${BUILD_ENV} to key them by the build")


def identity_for(model: ModelInfo, build: str, proto: SlotProto, runtime: Mapping[str, str]) -> Identity:
    """The store identity of slots of ``model`` written by ``build`` with constants ``proto`` and the
    runtime settings ``runtime`` (``_served.Runtime.to_extra``)."""
    if not build:
        raise ConfigError(f"the llama.cpp build is unknown: pass --build, set ${BUILD_ENV}, or give --upstream")
    kv = ",".join(sorted({GGML_TYPES[t[0]][0] for t in proto.kv})) + "/" + \
        ",".join(sorted({GGML_TYPES[t[2]][0] for t in proto.kv}))
    extra: dict[str, Any] = {"engine": "llama.cpp", "arch": model.shape.arch, **proto.to_extra(), **runtime}
    # mtp: the server runs a draft context whose state its slot files carry (the SDFT appendix)
    return Identity(build=build, pack=model.pack, kv=kv, mtp=proto.draft is not None, extra=extra)
