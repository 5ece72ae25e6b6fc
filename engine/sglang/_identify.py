"""What a page's bytes mean, from what SGLang tells the backend: its config and the host pools.

``HiCacheStorageConfig`` gives the model name and the TP/PP/CP/DCP shard; the registered host pool
gives the pool class, dtype, layout, page size, page bytes, geometry and ``storage_format_tag``;
the extra config adds what SGLang cannot know (the weights' digest or revision, the operator's
own keys). A page written under one identity is never served under another.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import snapstore

from ._pages import page_nbytes

# pool attributes that change the meaning of a page's bytes, where the pool class has them
_POOL_FIELDS = ("layout", "page_size", "head_num", "head_dim", "layer_num", "kv_lora_rank", "qk_rope_head_dim",
                "storage_format_tag", "stores_page_envelope", "start_layer", "end_layer")
# the extra-config keys that configure the backend itself (not part of the identity)
BACKEND_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "path", "disk_mib",
                          "max_entries", "ttl_s", "ram_mib", "model_digest", "model_revision", "key_extra",
                          "drop_stale", "chunk_mib"})
# SGLang's own keys in the same extra config (its cache controller reads them; some versions pass them on)
SGLANG_KEYS = frozenset({"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys", "file_storage_path", "enable_metadata_cache",
                         "metadata_ttl"})


# files whose bytes are a model's weights or config, in a local model directory
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_pack(extra_config: Mapping[str, Any], model: str) -> str:
    """The identity's ``pack``: what the served weights are (DESIGN invariant 12, the key is complete).

    ``model_digest``, else ``model_revision`` from the extra config; else, where ``model`` is a
    local model directory, a digest of its ``config.json`` and of each weight file's name, size and
    modification time (weights replaced in place are other weights). Anything else (a hub id with no
    revision) cannot be told apart from new weights under the same name, so the backend refuses to
    start (ConfigError) rather than serve pages another model's weights computed.
    """
    given = extra_config.get("model_digest") or extra_config.get("model_revision")
    if given:
        return str(given)
    if model and os.path.isdir(model):
        h = hashlib.sha256()
        try:
            with open(os.path.join(model, "config.json"), "rb") as f:
                h.update(f.read())
        except FileNotFoundError:
            pass
        for entry in sorted(os.scandir(model), key=lambda e: e.name):
            if entry.name.endswith(_WEIGHT_SUFFIXES) and entry.is_file():
                st = entry.stat()
                h.update(f"\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return f"sglang-files:{h.hexdigest()}"
    raise snapstore.ConfigError(
        f"SnapstoreHiCache cannot tell which weights SGLang serves as {model!r} (not a local model directory, "
        "and no \"model_revision\" or \"model_digest\" in --hicache-storage-backend-extra-config): pages "
        "new weights under the same name computed would be served as these; add \"model_revision\" (the "
        "weights' commit) or \"model_digest\" (docs/engine.md, 'SGLang')")


def _scalar(value: Any) -> str | int | float | bool | None:
    """An identity value: plain scalars as they are, anything else (a torch dtype) as its str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def pool_identity(config: Any, pool: Any, pool_name: str, build: str) -> snapstore.Identity:
    """The identity of ``pool_name``'s pages under ``config`` (a ``HiCacheStorageConfig``)."""
    extra_config: Mapping[str, Any] = config.extra_config or {}
    model = config.model_name or ""
    pack = weights_pack(extra_config, model)
    extra: dict[str, str | int | float | bool | None] = {
        "engine": "sglang", "model": model, "pool": pool_name, "pool_class": type(pool).__name__,
        "page_bytes": page_nbytes(pool),
        "pp": f"{config.pp_rank}/{config.pp_size}", "cp": f"{config.attn_cp_rank}/{config.attn_cp_size}",
        "dcp": f"{config.dcp_rank}/{config.dcp_size}", "mla": bool(config.is_mla_model),
        "page_first": bool(config.is_page_first_layout), "split_heads": bool(config.should_split_heads),
        "logical_page_size": _scalar(config.logical_page_size), "tp_lcm": _scalar(config.tp_lcm_size),
    }
    # MLA's K/V is replicated across TP ranks (one copy serves every rank, as in SGLang's file
    # backend); every other pool, and K/V without MLA, is a TP shard of its own.
    shared = bool(config.is_mla_model) and pool_name == "kv"
    extra["tp"] = f"*/{config.tp_size}" if shared else f"{config.tp_rank}/{config.tp_size}"
    for name in _POOL_FIELDS:
        if hasattr(pool, name):
            extra[f"pool.{name}"] = _scalar(getattr(pool, name))
    if extra_config.get("model_revision") and extra_config.get("model_digest"):
        extra["revision"] = str(extra_config["model_revision"])
    for key, value in dict(extra_config.get("key_extra") or {}).items():
        extra[f"user.{key}"] = _scalar(value)
    kv = str(getattr(pool, "dtype", "bytes")).removeprefix("torch.")
    return snapstore.Identity(build=build, pack=pack, kv=kv, extra=extra)
