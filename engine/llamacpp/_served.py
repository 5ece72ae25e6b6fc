"""What a running llama-server serves *now*, and the runtime part of its slots' identity.

``served_now`` is the cheap look taken before every restore and save: ``/props`` (model path,
build, the per-process random media marker, slot count, generation defaults) and
``/lora-adapters`` (adapters and their scales), plus the local file's stat. Any change means
another model, build, process or setting, and the identity is taken again by ``identify``:
the weights' SHA-256, each adapter's SHA-256 and scale, and a K/V probe — the SHA-256 of the
K/V the server computes for a fixed 32-token prompt. llama-server does not report RoPE base or
scaling, YaRN, control vectors or flash-attention numerics; the probe sees each of them through
the K/V it changes. What cannot be seen refuses persistence (``Refusal``), never a guess.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from snapstore import SnapstoreError

from ._identify import ModelInfo, file_sha256, model_info
from ._slotfile import SlotFile
from ._trace import ProbeTrace
from ._upstream import LlamaServer

__all__ = ["PROBE_TOKENS", "Refusal", "Runtime", "Served", "effective_lora", "identify", "lora_matches", "model_of",
           "request_unkeyable", "requested_slot", "served_now", "unseen_runtime"]

log = logging.getLogger("snapstore.engine.llamacpp")

PROBE_TOKENS = 32
# a fixed text every tokenizer turns into well over PROBE_TOKENS tokens (letters, digits, punctuation)
_PROBE_TEXT = ("The quick brown fox jumps over the lazy dog; 0123456789. Pack my box with five dozen liquor "
               "jugs! How vexingly quick daft zebras jump, said the system to the user and the assistant.")
_VOLATILE = frozenset({"is_sleeping"})  # /props fields that change while one server process runs
UNSEEN = "unseen"  # an identity value for what was not measured: no proxy's identity ever has it


class Refusal(SnapstoreError):
    """Something that changes the numbers cannot be seen: nothing is restored or saved (``reason`` names it)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Served:
    """The server's reported state at one look; equal values mean the same process, model and settings."""

    model_path: str
    build: str
    n_slots: int
    loras: tuple[Mapping[str, Any], ...]
    signature: str  # SHA-256 over every reported field but the volatile ones, and the model file's stat
    process: str = ""  # /props media_marker: random per server process ('' when not reported)


@dataclass(frozen=True)
class Runtime:
    """The runtime part of an identity: what the GGUF does not say but the numbers depend on."""

    kv_probe: str  # SHA-256 of the probe's K/V (UNSEEN: not measured)
    lora: str  # canonical adapters: sha256 and scale of each ('' none, UNSEEN: not known)

    def to_extra(self) -> dict[str, str]:
        """Identity extra keys."""
        return {"kv_probe": self.kv_probe, "lora": self.lora}


def unseen_runtime() -> Runtime:
    """The runtime of a slot file known without its server (import-slot without --upstream)."""
    return Runtime(UNSEEN, UNSEEN)


def _stat_key(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def served_now(server: LlamaServer, model_hint: str | None = None) -> Served:
    """Ask the server what it serves now (two small GETs) and stat the model file here."""
    props = server.get("/props", what="the model, build and settings it serves")
    raw: Any = server.get_any("/lora-adapters", what="the LoRA adapters it applies")
    loras = raw if isinstance(raw, list) else []
    path = str(props.get("model_path") or "")
    build = props.get("build_info")
    stable = {k: v for k, v in props.items() if k not in _VOLATILE}
    local = path if path and os.path.isfile(path) else model_hint
    sig = json.dumps([stable, loras, _stat_key(local) if local else None], sort_keys=True, default=str)
    return Served(model_path=path, build=build if isinstance(build, str) else "",
                  n_slots=int(props.get("total_slots") or 1),
                  loras=tuple(x for x in loras if isinstance(x, dict)),
                  signature=hashlib.sha256(sig.encode()).hexdigest(), process=str(props.get("media_marker") or ""))


def model_of(served: Served, model_hint: str | None, hint_path: str | None) -> ModelInfo:
    """The GGUF the server serves: its reported path when readable here, else the operator's --model
    (valid only for the path the server reported when --model was given)."""
    if served.model_path and os.path.isfile(served.model_path):
        return model_info(served.model_path)
    if model_hint and (hint_path is None or served.model_path in ("", hint_path)):
        return model_info(model_hint)
    raise Refusal("model_unseen", f"llama-server serves {served.model_path or 'a model it does not name'}, a file "
                  "not readable here, so its weights cannot be hashed; nothing is restored or saved until it "
                  "serves a model this host can read (or restart the proxy with --model naming that file)")


def _lora_of(served: Served) -> str:
    out = []
    for a in sorted(served.loras, key=lambda a: int(a.get("id", 0))):
        path = a.get("path")
        if not isinstance(path, str) or not os.path.isfile(path):
            raise Refusal("lora_unseen", f"llama-server applies LoRA adapter {path!r}, not readable here, so it "
                          "cannot be hashed; nothing is restored or saved while it is loaded")
        rest = {k: v for k, v in a.items() if k not in ("id", "path")}
        out.append({"sha256": file_sha256(path), **rest})
    return json.dumps(out, sort_keys=True, separators=(",", ":")) if out else ""


def _kv_hash(sf: SlotFile) -> str:
    """SHA-256 of a slot's tokens and K/V (and recurrent) bytes: not its slot number or stream."""
    h = hashlib.sha256(sf.tokens.tobytes())
    for ly in sf.kv:
        h.update(ly.k)
        h.update(ly.v)
    for rl in sf.rec:
        h.update(rl.r)
        h.update(rl.s)
    return h.hexdigest()


def _probe(server: LlamaServer, slot: int, decode: Callable[[bytes], SlotFile]) -> tuple[SlotFile, str]:
    """Evaluate the probe freshly (``cache_prompt`` off: one batch, nothing reused) and hash its K/V, twice."""
    toks = server.tokenize(_PROBE_TEXT)[:PROBE_TOKENS]
    hashes = []
    for _ in range(2):
        server.post("/completion", {"prompt": toks, "n_predict": 0, "id_slot": slot, "cache_prompt": False,
                                    "stream": False})
        sf = decode(server.save_slot(slot))
        if sf.tokens.tolist() != toks:
            raise Refusal("kv_unseen", f"the K/V probe in slot {slot} came back with {sf.n_tokens} other tokens")
        hashes.append(_kv_hash(sf))
    if hashes[0] != hashes[1]:
        raise Refusal("kv_unstable", "llama-server computed different K/V for the same probe twice (a "
                      "nondeterministic backend): a restored prefix would not equal a recomputed one, so nothing "
                      "is restored or saved")
    return sf, hashes[0]


def _settle(server: LlamaServer, slot: int, data: bytes, decode: Callable[[bytes], SlotFile]) -> None:
    """Put the slot's earlier content ``data`` back, or erase the slot (no content, or not to be kept)."""
    try:
        n = decode(data).n_tokens if len(data) > 64 else 0
    except SnapstoreError:
        n = 0
    try:
        if n:
            server.restore_slot(slot, data, n)
            return
    except SnapstoreError as e:
        log.warning("slot %d: could not put its content back after the identity probe (%s); erased", slot, e)
    server.post(f"/slots/{slot}?action=erase", {})


def identify(server: LlamaServer, served: Served, slot: int, *, model_hint: str | None, hint_path: str | None,
             decode_with: Callable[[ModelInfo], Callable[[bytes], SlotFile]],
             keep_slot: Callable[[ModelInfo, Runtime], bool], trace: ProbeTrace | None = None
             ) -> tuple[ModelInfo, SlotFile, Runtime]:
    """The model, a probe slot file (its constants) and the runtime the server computes with now.

    Runs the probe in ``slot`` (the caller holds it), then puts the slot's earlier content back when
    ``keep_slot(model, runtime)`` says it was computed under this identity, else erases the slot
    (llama-server would reuse state of the previous identity); raises ``Refusal`` for what cannot
    be seen (the slot erased). ``trace`` records what the probe leaves in the server's counters and
    ``/slots`` (the proxy serves both without it).
    """
    model = model_of(served, model_hint, hint_path)
    lora = _lora_of(served)
    decode = decode_with(model)
    with trace.around(server, slot, served.process) if trace is not None else contextlib.nullcontext():
        before = server.save_slot(slot)
        keep = False
        try:
            sf, kv = _probe(server, slot, decode)
            runtime = Runtime(kv_probe=kv, lora=lora)
            keep = keep_slot(model, runtime)
            return model, sf, runtime
        finally:
            _settle(server, slot, before if keep else b"", decode)


def _f32(x: float) -> float:
    """``x`` as the C ``float`` llama-server keeps a LoRA scale in (so 0.1 sent equals 0.1 reported)."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def effective_lora(field: Any, served: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """The scale of each of the server's adapters a request with ``lora: field`` computes with, read
    as llama-server reads it (``parse_lora_request``, ``construct_lora_list``): no field, null or an
    empty list: the server's own scales; otherwise every adapter not listed at 0.0 and a listed one
    without ``scale`` at 0.0 too. None: the field holds what llama-server reads by a fallback (an
    id or scale that is not a number, an entry that is not an object, not a list), so it is not
    keyed — declined, never guessed."""
    base = [_f32(float(a.get("scale", 0.0))) if _is_number(a.get("scale", 0.0)) else math.nan for a in served]
    if field is None or (isinstance(field, list) and not field):
        return base
    if not isinstance(field, list):
        return None
    chosen: dict[int, float] = {}
    for entry in field:
        if not isinstance(entry, dict):
            return None
        ident, scale = entry.get("id"), entry.get("scale")
        if not isinstance(ident, int) or isinstance(ident, bool):
            return None
        if scale is None:
            scale = 0.0  # llama-server's default for a missing (or null) scale: the adapter is off
        if not _is_number(scale):
            return None
        chosen[ident] = _f32(float(scale))
    return [chosen.get(i, 0.0) for i in range(len(served))]


def lora_matches(field: Any, served: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a request's (or a slot's last task's) ``lora`` computes with exactly the server's adapters."""
    mine, theirs = effective_lora(field, served), effective_lora(None, served)
    return mine is not None and mine == theirs and not any(math.isnan(x) for x in theirs)


def request_unkeyable(body: Mapping[str, Any], served: Served) -> str | None:
    """Why a request's own inputs change its K/V beyond its tokens (per-request LoRA, images, audio), or None."""
    lora = body.get("lora")
    if lora is not None:
        scales = effective_lora(lora, served.loras)
        if scales is None:
            return "request_lora_unread"
        if not lora_matches(lora, served.loras):
            return "request_lora"
    if body.get("multimodal_data"):
        return "request_media"
    prompt = body.get("prompt")
    if isinstance(prompt, dict) and prompt.get("multimodal_data"):
        return "request_media"
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") not in (None, "text")
                                                 for p in content):
                return "request_media"
    return None


def requested_slot(body: Mapping[str, Any], n_slots: int) -> int | None:
    """The slot a request names, read as llama-server reads ``id_slot`` (``json_value<int>``, then
    ``get_slot_by_id``'s wrap-around): None for any idle slot (no field, null, -1, or a value it
    reads as -1 such as a string); -1 for a slot the server cannot find (another negative number)."""
    v = body.get("id_slot")
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        v = int(v)
    elif isinstance(v, bool):
        v = int(v)
    if not isinstance(v, int) or v == -1:
        return None
    if v < 0:
        return -1
    return v % max(n_slots, 1)
