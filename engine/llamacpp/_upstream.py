"""llama-server's control API as the bridge uses it: JSON calls, and slot files moved through its slot directory.

``/slots/N?action=save|restore`` read and write files in the directory llama-server was started
with (``--slot-save-path``); :class:`LlamaServer` names each file uniquely, hands the bytes over
and removes the file afterwards, whatever happened. The proxy streams the real requests itself.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from snapstore import SnapstoreError, StoreIOError

__all__ = ["JsonObject", "LlamaServer", "UpstreamError", "unreachable"]

JsonObject = dict[str, Any]
"""A JSON object as llama-server sends and takes it (request bodies, responses)."""


class UpstreamError(SnapstoreError):
    """llama-server refused or failed a control request (tokenize, slot save/restore, ...)."""


def _for(what: str) -> str:
    return f" ({what})" if what else ""


def unreachable(url: str, doing: str, e: BaseException) -> str:
    """The message for a server that could not be reached: its URL, what was asked, and why in words."""
    reason = getattr(e, "reason", e)  # URLError wraps the socket error
    if isinstance(reason, OSError) and reason.strerror:
        why = reason.strerror.lower()
    else:
        why = str(reason) or type(reason).__name__
    return (f"cannot reach llama-server at {url} ({doing}): {why}; is it running there, and is --upstream "
            "its address?")


class LlamaServer:
    """Control calls to one llama-server at ``upstream`` whose slot files live in ``slot_dir``."""

    def __init__(self, upstream: str, slot_dir: str, timeout: float, api_key: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.slot_dir = slot_dir
        self.timeout = timeout
        # the key llama-server was started with (--api-key): sent on every control call
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._seq_lock = threading.Lock()
        self._seq = 0

    def get(self, path: str, what: str = "") -> JsonObject:
        """GET ``path``'s JSON object (``what`` says what it asks for); UpstreamError when the server cannot
        be reached or answers garbage."""
        out = self.get_any(path, what)
        if not isinstance(out, dict):
            raise UpstreamError(f"llama-server at {self.upstream} answered GET {path}{_for(what)} with a JSON "
                                f"{type(out).__name__}, not an object")
        return out

    def get_any(self, path: str, what: str = "") -> Any:
        """GET ``path``'s JSON value (``/slots`` and ``/lora-adapters`` are lists), the api key sent."""
        try:
            return json.loads(self._get(path, what))
        except ValueError as e:
            raise UpstreamError(f"llama-server at {self.upstream} answered GET {path}{_for(what)} with no JSON: "
                                f"{e}") from None

    def get_text(self, path: str, what: str = "") -> str:
        """GET ``path``'s body as text (``/metrics``)."""
        return self._get(path, what).decode(errors="replace")

    def _get(self, path: str, what: str) -> bytes:
        req = urllib.request.Request(self.upstream + path, headers=self.auth)  # noqa: S310 - operator URL
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310
                data: bytes = r.read()
                return data
        except urllib.error.HTTPError as e:
            raise UpstreamError(f"llama-server at {self.upstream} answered GET {path}{_for(what)} with HTTP "
                                f"{e.code}: {e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UpstreamError(unreachable(self.upstream, f"GET {path}{_for(what)}", e)) from None

    def slot_states(self) -> dict[int, JsonObject]:
        """Each slot's ``/slots`` entry by id: ``is_processing``, its last task's ``id_task`` and ``params``
        (``lora`` among them); UpstreamError when the server has no ``/slots`` (``--no-slots``)."""
        slots = self.get_any("/slots", "which slots are idle")
        if not isinstance(slots, list):
            raise UpstreamError("llama-server GET /slots: expected a list (is it started with --slots?)")
        return {int(s["id"]): s for s in slots if isinstance(s, dict) and isinstance(s.get("id"), int)}

    def idle_slots(self) -> set[int]:
        """The slots that run no task now (``/slots`` is_processing), as the server reports them."""
        return {i for i, s in self.slot_states().items() if not s.get("is_processing")}

    def post(self, path: str, body: Mapping[str, Any]) -> JsonObject:
        """POST ``body`` as JSON to ``path``; UpstreamError (with the server's words) when it fails."""
        req = urllib.request.Request(self.upstream + path, data=json.dumps(body).encode(),  # noqa: S310
                                     headers={"Content-Type": "application/json", **self.auth})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310
                out: JsonObject = json.loads(r.read())
                return out
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise UpstreamError(f"llama-server POST {path}: HTTP {e.code}: {detail}") from None
        except ValueError as e:
            raise UpstreamError(f"llama-server at {self.upstream} answered POST {path} with no JSON: {e}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UpstreamError(unreachable(self.upstream, f"POST {path}", e)) from None

    def tokenize(self, text: str) -> list[int]:
        """The server's tokens of ``text`` (special tokens added and parsed, as a prompt is)."""
        out = self.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})
        return [int(t) for t in out.get("tokens", [])]

    def render(self, messages: list[Any], extra: Mapping[str, Any]) -> str:
        """The prompt text the server's chat template makes of ``messages`` (and tools, template kwargs)."""
        body = {"messages": messages, **{k: extra[k] for k in ("tools", "chat_template_kwargs") if k in extra}}
        return str(self.post("/apply-template", body)["prompt"])

    def _slot_file(self, slot: int) -> tuple[str, str]:
        with self._seq_lock:
            self._seq += 1
            name = f"snapstore-{os.getpid()}-{slot}-{self._seq}.bin"
        return name, os.path.join(self.slot_dir, name)

    def save_slot(self, slot: int) -> bytes:
        """The bytes of ``slot``'s state, as the server's slot save writes them."""
        name, path = self._slot_file(slot)
        try:
            self.post(f"/slots/{slot}?action=save", {"filename": name})
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise StoreIOError(f"reading the slot file llama-server wrote at {path}: {e} (is --slot-save-path "
                               "the directory llama-server was started with?)") from None
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass

    def erase_slot(self, slot: int) -> None:
        """Empty ``slot``'s cache (``/slots/N?action=erase``)."""
        self.post(f"/slots/{slot}?action=erase", {})

    def restore_slot(self, slot: int, data: bytes, n: int) -> None:
        """Load slot file bytes ``data`` of ``n`` tokens into ``slot``; UpstreamError if it restored other than n."""
        name, path = self._slot_file(slot)
        tmp = path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            out = self.post(f"/slots/{slot}?action=restore", {"filename": name})
            if int(out.get("n_restored", -1)) != n:
                raise UpstreamError(f"slot {slot} restored {out.get('n_restored')} tokens, expected {n}")
        finally:
            for p in (tmp, path):
                try:
                    os.unlink(p)
                except OSError:
                    pass
