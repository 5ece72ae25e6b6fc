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

from .._errors import ConfigError, InvalidInputError
from .._forks import ProcessLock
from .._identity import Identity
from ._slotfile import GGML_TYPES, ModelShape
from ._slotparts import SlotProto

__all__ = ["BUILD_ENV", "UNKNOWN_BUILDS", "ModelInfo", "build_warning", "file_sha256", "identity_for",
           "model_info"]

BUILD_ENV = "SNAPSTORE_LLAMA_BUILD"
_HASHES: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: hashed once per process
_LOCK = ProcessLock()  # fresh in a forked child (.._forks)
# architectures whose cache is one attention K/V cache per layer, or LFM2 (short-conv + attention)
_HYBRID_RULES = {"lfm2": "head_count_kv == 0 marks a short-conv (recurrent) layer"}
_UNSUPPORTED = ("mamba", "mamba2", "rwkv6", "rwkv7", "jamba", "falcon-h1", "granitehybrid", "nemotron_h",
                "nemotron_h_moe", "qwen3next", "plamo2", "lfm2moe")


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
    with _LOCK:
        if key in _HASHES:
            return _HASHES[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    with _LOCK:
        _HASHES[key] = digest
    return digest


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def model_info(path: str) -> ModelInfo:
    """Hash a GGUF and read the shape of its caches (which layers keep K/V, which recurrent state)."""
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
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise InvalidInputError(f"{path}: GGUF without general.architecture")
    n_layer = _field(reader, f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer <= 0:
        raise InvalidInputError(f"{path}: GGUF without {arch}.block_count")
    if arch in _UNSUPPORTED or _field(reader, f"{arch}.ssm.conv_kernel") is not None:
        raise InvalidInputError(f"{path}: architecture {arch!r} keeps a cache layout the slot codec does not know "
                                f"(supported: attention-only models and {', '.join(_HYBRID_RULES)})")
    if _field(reader, f"{arch}.attention.sliding_window") is not None:
        raise InvalidInputError(f"{path}: architecture {arch!r} uses sliding-window attention (two K/V caches "
                                "per slot), a slot layout the codec does not know")
    kvh = _field(reader, f"{arch}.attention.head_count_kv")
    if kvh is None:
        kvh = _field(reader, f"{arch}.attention.head_count")
    per_layer = list(kvh) if isinstance(kvh, list) else [kvh] * n_layer
    if len(per_layer) != n_layer:
        raise InvalidInputError(f"{path}: head_count_kv has {len(per_layer)} entries for {n_layer} layers")
    n_embd = _field(reader, f"{arch}.embedding_length")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head = n_head[0] if isinstance(n_head, list) else n_head
    hd_k = _field(reader, f"{arch}.attention.key_length") or (n_embd // n_head if n_embd and n_head else 0)
    hd_v = _field(reader, f"{arch}.attention.value_length") or hd_k
    rec_w = (0, 0)
    if arch == "lfm2":
        attn = tuple(i for i, h in enumerate(per_layer) if h)
        rec = tuple(i for i, h in enumerate(per_layer) if not h)
        l_cache = _field(reader, "lfm2.shortconv.l_cache")
        rec_w = ((int(l_cache) - 1) * int(n_embd) if l_cache and n_embd else 0, 0)
    else:
        attn, rec = tuple(range(n_layer)), ()
    widths = tuple((int(per_layer[i]) * int(hd_k), int(per_layer[i]) * int(hd_v)) for i in attn)
    return ModelInfo(path, file_sha256(path), ModelShape(arch, n_layer, attn, rec, widths, rec_w))


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
    return Identity(build=build, pack=model.pack, kv=kv, mtp=False, extra=extra)
