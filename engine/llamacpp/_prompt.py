"""What the bridge reads of a request: its prompt tokens (by the server's own template and tokenizer),
where its system prompt ends, its session key; and the tokens a slot file holds."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._slotmodel import TOKEN_NULL
from ._upstream import LlamaServer

__all__ = ["CHAT_PATHS", "COMPLETION_PATHS", "SESSION_HEADER", "lcp", "prompt_of", "tokens_in"]

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETION_PATHS = ("/completion", "/completions", "/v1/completions")
SESSION_HEADER = "X-Snapstore-Session"


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else n


def tokens_in(data: bytes) -> list[int]:
    """The tokens a slot file holds (its token payload only; the state is checked when it is stored)."""
    try:
        _, _, n = struct.unpack_from("<III", data, 0)
        words = np.frombuffer(data, "<i4", count=n, offset=12)
    except (struct.error, ValueError):
        return []
    if len(words) >= 3 and int(words[0]) == TOKEN_NULL:
        words = words[3:3 + int(words[2])]
    return [int(t) for t in words]


def prompt_of(server: LlamaServer, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
              ) -> tuple[list[int], int, str | None]:
    """Prompt tokens, the end of the system prompt / tool list (0: none), and the session key."""
    session = (headers or {}).get(SESSION_HEADER) or None
    if path in CHAT_PATHS:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return [], 0, session
        full = server.tokenize(server.render(msgs, body))
        head = [m for m in msgs if isinstance(m, dict) and m.get("role") in ("system", "developer")]
        k = len(head)
        if head and msgs[:k] == head or body.get("tools"):
            sys_tokens = server.tokenize(server.render(msgs[:k], body))
            system_end = lcp(sys_tokens, full)
        else:
            system_end = 0
        if session is None:
            first_user = next((m for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
            key = json.dumps([msgs[:k], first_user, body.get("tools")], sort_keys=True, default=str)
            session = "chat:" + hashlib.sha256(key.encode()).hexdigest()[:24]
        return full, system_end, session
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt], 0, session
    if isinstance(prompt, str):
        return server.tokenize(prompt), 0, session
    return [], 0, session
