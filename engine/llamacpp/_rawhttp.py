"""One HTTP/1.1 exchange with llama-server read by the proxy's own framing, for ``/cors-proxy``.

llama-server's ``/cors-proxy`` relays whatever the target answers, and relays a bodiless status
(``204 No Content``) with ``Transfer-Encoding: chunked`` and a final ``0`` chunk after it. A strict
client (aiohttp's) reads that chunk as the next response's status line and fails the exchange, so
the proxy would answer 500 where llama-server answered 204. Here the status and headers are read,
a bodiless status (1xx, 204, 304, a HEAD's answer) ends the exchange at once (the connection is
closed, whatever follows it unread), and a body is relayed by its own framing (chunked,
``Content-Length``, or until the server closes).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass

__all__ = ["RawResponse", "exchange"]


@dataclass
class RawResponse:
    """The server's status, reason and headers (as sent, repeated ones kept), and its body as it streams."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: AsyncGenerator[bytes, None]
    close: bool  # the server asked to close the connection (``Connection: close``)


async def exchange(url: str, method: str, headers: Mapping[str, str], body: bytes) -> RawResponse:
    """Send one request on a new connection to ``url`` and read its answer's head (the body streams)."""
    u = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    head = [f"{method} {target} HTTP/1.1", f"Host: {u.netloc}", "Connection: close", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()
    status_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        writer.close()
        raise ConnectionError(f"llama-server answered with no HTTP status line: {status_line[:80]!r}")
    status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
    out: list[tuple[str, str]] = []
    while (line := (await reader.readline()).decode("latin-1").rstrip("\r\n")):
        k, _, v = line.partition(":")
        out.append((k.strip(), v.strip()))
    lower = {k.lower(): v for k, v in out}
    bodiless = status in (204, 304) or 100 <= status < 200 or method == "HEAD"

    async def stream() -> AsyncGenerator[bytes, None]:
        try:
            if bodiless:
                return
            if "chunked" in lower.get("transfer-encoding", "").lower():
                while True:
                    size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        return
                    yield await reader.readexactly(size)
                    await reader.readline()
            elif "content-length" in lower:
                left = int(lower["content-length"])
                while left > 0:
                    chunk = await reader.read(min(left, 1 << 16))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk
            else:
                while chunk := await reader.read(1 << 16):
                    yield chunk
        finally:
            writer.close()

    return RawResponse(status, reason, out, stream(), lower.get("connection", "").lower() == "close")
