"""mlx_lm prompt-cache files (``mlx_lm.cache_prompt``, ``save_prompt_cache``) <-> snapshots.

:func:`import_prompt_cache` stores a file's prompt cache as a snapshot: deduplicated (a delta over
the deepest stored prefix, chunks shared by content), checksummed, under the identity the MLX
PrefixCache and the server's StorePromptCache use for that model and those cache settings, so
either restores it. A file holds no token ids (mlx_lm's own files record only the model's name
and tokenizer config): they are supplied, or read from the ``snapstore_tokens`` metadata that
:func:`export_prompt_cache` records. A file made for another model is refused with what differs:
the name it records, the weights or config it records (``snapstore_pack``, ``snapstore_config_sha256``:
keys without dots, which mlx_lm's metadata round trip would nest) (files this module wrote), the number of
layers, a layer's cache kind, a part's dtype or shape.

:func:`export_prompt_cache` writes a stored snapshot back as such a file: ``load_prompt_cache``
loads it and ``mlx_lm.generate --prompt-cache-file`` generates from it as from the original.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from snapstore import (
    Budget,
    IdentityError,
    InvalidInputError,
    LayoutError,
    Match,
    NotFoundError,
    OutputFile,
    SaveResult,
)

from ._cache_state import Node, UnsupportedCacheError, describe, destinations, parts_of, rebuild
from ._identify import CacheSettings
from ._open import open_stores
from ._reading import DEFAULTS
from ._stores import Stores

__all__ = ["ExportResult", "ImportResult", "PromptCacheMismatchError", "export_prompt_cache", "import_prompt_cache"]

_WHAT = "the prompt-cache file"
_KINDS = {"kv": "KVCache", "qkv": "QuantizedKVCache", "rot": "RotatingKVCache", "arrays": "ArraysCache",
          "list": "CacheList"}


class PromptCacheMismatchError(IdentityError):
    """A prompt-cache file was made for another model (or other cache settings) than the one given."""


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_prompt_cache` stored: the save's result, the tokens, the identity key."""

    save: SaveResult
    n_tokens: int
    identity: str
    file_bytes: int


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_prompt_cache` wrote: the snapshot, its length, the file's size."""

    snapshot_id: int
    n_tokens: int
    file_bytes: int
    tokens_recorded: bool
    # False for a snapshot imported under an identity override (written with accept_identity): the
    # file cannot carry that mark, so it is an approximation, never this model's exact state
    exact: bool = True


def import_prompt_cache(file: str | os.PathLike[str], model: Any, path: str | os.PathLike[str] | None = None, *,
                        tokens: Sequence[int] | None = None, model_name: str | None = None,
                        session: str | None = None, budget: Budget | None = None,
                        **store_options: Any) -> ImportResult:
    """Store the prompt cache in ``file`` (mlx_lm's safetensors) as a snapshot of ``model``'s.

    tokens: the prompt's token ids (None: the ``snapstore_tokens`` the file records). model_name:
    the name the model goes by (a file recording another ``model`` name is refused, as mlx_lm's
    generate refuses it; None: not compared). Raises PromptCacheMismatchError (another model or
    other cache settings), InvalidInputError (not a prompt-cache file, no or wrong token ids).
    """
    cache, meta = _load(file)
    if model_name is not None and meta.get("model") not in (None, "", model_name):
        raise PromptCacheMismatchError(f"{os.fspath(file)} was made for model {meta['model']!r}, not {model_name!r} "
                                       "(pass the name it records if it is the same model)")
    try:
        schema, layout = describe(cache)
    except (UnsupportedCacheError, LayoutError) as e:
        raise InvalidInputError(f"{os.fspath(file)}: {e}") from None
    settings, phase = _settings(model, schema)
    stores = open_stores(model, settings, path, budget=budget, options=store_options)
    try:
        _check_recorded(meta, stores, file)
        _check_layout(stores.schemas.get(phase), (schema, layout), file)
        ids = _tokens(tokens, meta, file)
        n = _n_tokens(cache)
        if n is not None and n != len(ids):
            raise InvalidInputError(f"{os.fspath(file)} holds the state of {n} tokens, but {len(ids)} token ids "
                                    "were given")
        res = stores.store(phase).save(ids, parts_of(cache, len(ids)), session=session, parent="auto")
        return ImportResult(res, len(ids), stores.identity.key, os.path.getsize(file))
    finally:
        stores.close()


def export_prompt_cache(file: str | os.PathLike[str], model: Any, path: str | os.PathLike[str] | None = None, *,
                        tokens: Sequence[int] | None = None, snapshot_id: int | None = None,
                        model_name: str = "", kv_bits: int | None = None, kv_group_size: int = 64,
                        max_kv_size: int | None = None, tokenizer_config: dict[str, Any] | None = None,
                        accept_identity: str | None = None, overwrite: bool = True,
                        **store_options: Any) -> ExportResult:
    """Write a stored snapshot of ``model``'s as an mlx_lm prompt-cache file.

    The snapshot: ``snapshot_id``, else the deepest stored prefix of ``tokens``. kv_bits,
    kv_group_size, max_kv_size: the cache settings it was stored under (a quantized or windowed
    cache). model_name and tokenizer_config go to the metadata mlx_lm reads (``model``,
    ``tokenizer_config``); the token ids are recorded as ``snapstore_tokens`` when known. Raises
    NotFoundError when no such snapshot is stored for this model and these settings.

    The store is only read (opened ``read_only``, unless ``store_options`` says otherwise): left as it
    was, and one this user may not write exports too. Nothing written destroys a store
    (``snapstore.OutputFile``): never inside a store directory,
    never a store's own file name; an existing file elsewhere is replaced only with ``overwrite``
    (the default, as before), through a temporary file renamed into place. A snapshot imported under
    an identity override is written only when ``accept_identity`` names the identity that computed
    it (``Store.check_export``): the file cannot carry the mark, and imported again it
    would pass as this model's own state (issue 46 item 1); the result then says ``exact=False``.
    """
    if (tokens is None) == (snapshot_id is None):
        raise InvalidInputError("export_prompt_cache takes tokens= or snapshot_id=, one of them")
    target = OutputFile(file, overwrite=overwrite, what=_WHAT).path  # checked before any work
    start = 0 if kv_bits is not None else None
    settings = CacheSettings(int(DEFAULTS["prefill_step_size"]), kv_bits, kv_group_size if kv_bits else None, start,
                             max_kv_size if not hasattr(model, "make_cache") else None)
    # read only, as `snapstore export`: the store is left as it was, and one this user may not write exports too
    stores = open_stores(model, settings, path, options={"drop_stale": False, "read_only": True, **store_options})
    try:
        phase, ref = _find(stores, tokens, snapshot_id)
        store = stores.store(phase)
        out = OutputFile(target, overwrite=overwrite, store_root=store.path, what=_WHAT, suffix=".safetensors")
        own = store.check_export(ref, "prompt-cache file", accept_identity=accept_identity)
        schema, layout = stores.schemas[phase]
        n = ref.n_tokens
        dest = destinations(layout, n)
        stores.store(phase).restore(ref, into=dest)
        cache = rebuild(schema, layout, dest, n)
        meta = {"model": model_name, "tokenizer_config": json.dumps(tokenizer_config or {}),
                "snapstore_snapshot_id": str(ref.snapshot_id), "snapstore_n_tokens": str(n),
                "snapstore_pack": stores.identity.pack,
                "snapstore_config_sha256": str(stores.identity.extra.get("config_sha256", ""))}
        if tokens is not None:
            meta["snapstore_tokens"] = json.dumps([int(t) for t in tokens[:n]])
        with out:  # mx.save_safetensors adds the suffix to a name without it: the temporary name has it
            save_prompt_cache(out.tmp_path, cache, meta)
        return ExportResult(ref.snapshot_id, n, os.path.getsize(target), tokens is not None, own)
    finally:
        stores.close()


# -- helpers ---------------------------------------------------------------------------------------
def _load(file: str | os.PathLike[str]) -> tuple[list[Any], dict[str, str]]:
    name = os.fspath(file)
    if not os.path.isfile(name):
        raise InvalidInputError(f"{name}: no such file")
    try:
        cache, meta = load_prompt_cache(name, return_metadata=True)
    except Exception as e:  # mx.load / mlx_lm's parser: a file that is not an mlx_lm prompt cache
        raise InvalidInputError(f"{name} is not an mlx_lm prompt-cache file ({type(e).__name__}: {e})") from None
    if not cache:
        raise InvalidInputError(f"{name} holds no cache")
    return list(cache), dict(meta or {})


def _walk(schema: Sequence[Node]) -> list[Node]:
    out: list[Node] = []
    for n in schema:
        out.append(n)
        out.extend(_walk(n.children))
    return out


def _settings(model: Any, schema: Sequence[Node]) -> tuple[CacheSettings, str]:
    """The cache settings a file's cache was made with (KV quantization, a window for every layer), and its phase."""
    nodes = _walk(schema)
    q = next((n for n in nodes if n.kind == "qkv"), None)
    rot = next((n for n in nodes if n.kind == "rot"), None)
    window = rot.settings[0] if rot is not None and not hasattr(model, "make_cache") else None
    bits, group = (q.settings[1], q.settings[0]) if q is not None else (None, None)
    s = CacheSettings(int(DEFAULTS["prefill_step_size"]), bits, group, 0 if bits is not None else None, window)
    return s, ("q" if bits is not None else "p")


def _check_recorded(meta: dict[str, str], stores: Stores, file: str | os.PathLike[str]) -> None:
    """A file this module wrote records the weights and config it was computed with: they must be the model's."""
    pack, cfg = meta.get("snapstore_pack"), meta.get("snapstore_config_sha256")
    if pack and pack != stores.identity.pack:
        raise PromptCacheMismatchError(f"{os.fspath(file)} was computed with other weights ({pack}) than the "
                                       f"model's ({stores.identity.pack})")
    mine = str(stores.identity.extra.get("config_sha256", ""))
    if cfg and cfg != mine:
        raise PromptCacheMismatchError(f"{os.fspath(file)} was computed with another model config "
                                       f"(sha256 {cfg[:16]}…) than the model's ({mine[:16]}…)")


def _check_layout(want: Any, got: Any, file: str | os.PathLike[str]) -> None:
    """The file's cache against the one the model makes: layers, kinds, part names, dtypes and shapes."""
    name = os.fspath(file)
    if want is None:
        raise PromptCacheMismatchError(f"{name}: the model makes no cache of these settings")
    (ws, wl), (gs, gl) = want, got
    if len(ws) != len(gs):
        raise PromptCacheMismatchError(f"{name} holds {len(gs)} layer caches, the model makes {len(ws)}")
    for i, (a, b) in enumerate(zip(ws, gs)):
        if a != b:
            what = f"{_KINDS[b.kind]} {b.settings}" if a.kind == b.kind else _KINDS[b.kind]
            mine = f"{_KINDS[a.kind]} {a.settings}" if a.kind == b.kind else _KINDS[a.kind]
            raise PromptCacheMismatchError(f"{name}: layer {i} is a {what} in the file, a {mine} for the model")
    for kind, w, g in (("fixed part", wl.fixed, gl.fixed), ("row stream", wl.rows, gl.rows)):
        for part in sorted(set(w) | set(g)):
            if part not in w or part not in g:
                side = "file" if part in g else "model"
                raise PromptCacheMismatchError(f"{name}: {kind} {part} only in the {side}'s cache")
            if w[part] != g[part]:
                raise PromptCacheMismatchError(f"{name}: {kind} {part} is {_spec(g[part])} in the file, "
                                               f"{_spec(w[part])} for the model")


def _spec(s: Any) -> str:
    shape = getattr(s, "shape", None) or getattr(s, "row_shape", None)
    return f"{s.dtype} {tuple(shape) if shape is not None else ''}".strip()


def _tokens(tokens: Sequence[int] | None, meta: dict[str, str], file: str | os.PathLike[str]) -> list[int]:
    if tokens is None:
        raw = meta.get("snapstore_tokens")
        if raw is None:
            raise InvalidInputError(f"{os.fspath(file)} records no token ids (mlx_lm's files do not): pass the "
                                    "prompt's token ids")
        tokens = json.loads(raw)
    ids = [int(t) for t in tokens]
    if not ids or any(t < 0 for t in ids):
        raise InvalidInputError("token ids must be a non-empty list of non-negative ints")
    return ids


def _n_tokens(cache: list[Any]) -> int | None:
    """The tokens the cache has read, where a layer says (KV kinds keep an offset; recurrent state does not)."""
    for c in cache:
        for x in getattr(c, "caches", (c,)):
            off = getattr(x, "offset", None)
            if isinstance(off, int):
                return off
    return None


def _find(stores: Stores, tokens: Sequence[int] | None, snapshot_id: int | None) -> tuple[str, Match]:
    """The phase (layout) and a Match of the snapshot asked for."""
    best: tuple[str, Match] | None = None
    for phase, (_, layout) in stores.schemas.items():
        store = stores.store(phase)
        if snapshot_id is not None:
            try:
                d = store.describe(snapshot_id)
            except (NotFoundError, IdentityError, InvalidInputError):
                continue
            if set(d.rows) == set(layout.rows):
                return phase, Match(snapshot_id, d.n_tokens, d.namespace)
            continue
        m = store.match([int(t) for t in tokens or []])
        if m is not None and (best is None or m.n_tokens > best[1].n_tokens):
            best = (phase, m)
    if best is None:
        ident = f"identity {stores.identity.key[:19]}…"
        if snapshot_id is not None:
            raise NotFoundError(f"snapshot {snapshot_id} is not a committed snapshot of this model under these cache "
                                f"settings ({ident}; pass the kv/window settings it was stored with)")
        raise NotFoundError(f"no prefix of these tokens is stored for this model under these cache settings ({ident})")
    return best
