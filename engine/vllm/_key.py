"""What a vLLM request's K/V depends on beyond its token ids, as snapstore keys (no vLLM import).

vLLM's own prefix cache keys a block by its tokens chained with the blocks before it plus extra
keys: the LoRA adapter, the multimodal items overlapping the block (their hash and offset) and,
on the first block, the request's ``cache_salt`` (``vllm/v1/core/kv_cache_utils.py``
``generate_block_hash_extra_keys``). The connector keys the same inputs: LoRA adapter and salt
scope a request to a **namespace** (they change every block, like vLLM's chained hashes), and each
multimodal placeholder token is replaced by a value derived from its item's hash and its place in
the item (so a prefix match stops where the images differ). A request with an input it cannot key
(prompt embeddings, a multimodal item without a hash, an adapter that is not a local directory)
is declined. :func:`config_digest` is the deployment's part: the model config after overrides and
the settings that change the numbers, for the identity.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import snapstore as ss

__all__ = ["MM_TOKEN_BASE", "RequestKey", "adapter_hash", "config_digest", "request_key"]

#: multimodal placeholder positions become tokens at or above this (real token ids are far below it)
MM_TOKEN_BASE = 1 << 62
_MASK = MM_TOKEN_BASE - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: distinct positions in an item give distinct values
#: hf config keys that name where a config came from, not what it computes
_HF_NOT_NUMERIC = ("_name_or_path", "transformers_version", "_commit_hash")
_ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")
_adapter_cache: dict[tuple[str, int, float], str] = {}


@dataclass(frozen=True)
class RequestKey:
    """A request's match key: ``tokens`` (placeholders replaced), ``namespace`` (adapter, salt),
    or ``declined`` (why the connector neither loads nor saves it)."""

    tokens: list[int]
    namespace: str | None = None
    declined: str | None = None


def adapter_hash(path: str) -> str:
    """``sha256:`` of a LoRA adapter directory's files (names and bytes): the adapter as it is
    now, so a retrained adapter at the same path never meets its old K/V. Cached per (path, size,
    mtime). ``ss.ConfigError`` for a path that is not a local directory of adapter files."""
    files = sorted(f for f in os.listdir(path) if f.endswith(_ADAPTER_SUFFIXES)) if os.path.isdir(path) else []
    if not files:
        raise ss.ConfigError(f"LoRA adapter {path!r} is not a local directory of adapter files: its K/V cannot "
                             "be keyed, so such requests are neither loaded nor saved")
    full = [os.path.join(path, f) for f in files]
    stamp = (os.path.abspath(path), sum(os.path.getsize(f) for f in full), max(os.path.getmtime(f) for f in full))
    if stamp not in _adapter_cache:
        h = hashlib.sha256()
        for name, f in zip(files, full):
            h.update(name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
        _adapter_cache[stamp] = "sha256:" + h.hexdigest()
    return _adapter_cache[stamp]


def _mm_tokens(item_hash: str, length: int) -> list[int]:
    """The stand-in tokens of one multimodal item: distinct per item hash and per position."""
    base = int.from_bytes(hashlib.blake2b(item_hash.encode(), digest_size=8).digest(), "big")
    return [MM_TOKEN_BASE | ((base + i * _GOLDEN) & _MASK) for i in range(length)]


def request_key(request: Any, adapter: Callable[[str], str] = adapter_hash) -> RequestKey:
    """The key of a vLLM ``Request`` (duck-typed: ``prompt_token_ids``, ``prompt_embeds``,
    ``mm_features``, ``lora_request``, ``cache_salt``), or a declined one naming the reason."""
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestKey([], declined="prompt embeddings")
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return RequestKey([], declined="no prompt token ids")
    tokens = list(ids)  # the store checks every token (a per-token int() cost ~0.2 ms a lookup at 3,000)
    for f in getattr(request, "mm_features", None) or ():
        ident, pos = getattr(f, "identifier", None), getattr(f, "mm_position", None)
        if not ident or pos is None:
            return RequestKey([], declined="a multimodal item without a hash")
        start, n = int(pos.offset), int(pos.length)
        if start < 0 or n < 0:
            return RequestKey([], declined=f"a multimodal item at [{start}, {start + n})")
        end = min(start + n, len(tokens))
        tokens[start:end] = _mm_tokens(str(ident), n)[:max(0, end - start)]
    scope: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
        try:
            scope["lora"] = [str(lora.lora_name), adapter(path)]
        except (ss.SnapstoreError, OSError) as e:
            return RequestKey([], declined=f"LoRA adapter {lora.lora_name!r}: {e}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        scope["salt"] = str(salt)
    if not scope:
        return RequestKey(tokens)
    digest = hashlib.sha256(json.dumps(scope, sort_keys=True).encode()).hexdigest()
    return RequestKey(tokens, namespace=f"vllm:{digest}")


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data (dataclasses and config objects by their fields; the rest by str)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        out = [_plain(v) for v in value]
        return sorted(out, key=repr) if isinstance(value, (set, frozenset)) else out
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _fields(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: _plain(getattr(obj, n, None)) for n in names} if obj is not None else {}


def config_digest(vllm_config: Any) -> str:
    """``sha256:`` of everything in a vLLM deployment that changes the K/V numbers beyond the
    weights and the cache geometry (which have their own identity fields): the HF model config as
    vLLM uses it — after ``hf_overrides``, so RoPE scaling, RoPE base, windows and every
    architecture field count — and the model, cache, LoRA, parallel and compile settings listed
    in docs/engine.md ("What changes the numbers")."""
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(vars(mc.hf_config))
    doc = {
        "hf_config": _plain({k: v for k, v in hf.items() if k not in _HF_NOT_NUMERIC}),
        "model": _fields(mc, ("dtype", "quantization", "max_model_len", "disable_sliding_window", "model_impl",
                              "runner_type", "convert", "override_attention_dtype", "revision")),
        "cache": _fields(vllm_config.cache_config, ("cache_dtype", "calculate_kv_scales", "sliding_window",
                                                   "kv_sharing_fast_prefill")),
        "lora": _fields(getattr(vllm_config, "lora_config", None), ("max_lora_rank", "lora_dtype",
                                                                   "fully_sharded_loras")),
        "parallel": _fields(vllm_config.parallel_config, ("pipeline_parallel_size", "enable_expert_parallel",
                                                          "decode_context_parallel_size")),
        "compile": {"enforce_eager": _plain(getattr(mc, "enforce_eager", None)),
                    "mode": _plain(getattr(getattr(vllm_config, "compilation_config", None), "mode", None))},
    }
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
