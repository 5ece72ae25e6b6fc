"""The proxy's own framing for ``/cors-proxy`` (``_rawhttp``), against a real socket sending what
llama-server sends: a ``204 No Content`` relayed with ``Transfer-Encoding: chunked`` and a ``0``
chunk after it (issue 47 item 11, llama.cpp's ``test_mcp_proxy_no_content``: it came out as 500)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from snapstore.engine.llamacpp._rawhttp import exchange

NO_CONTENT = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nAccess-Control-Allow-Origin: *\r\n\r\n0\r\n\r\n"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nX-A: 2\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
SIZED = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nnope!"


@pytest.fixture
def upstream() -> Iterator[tuple[str, list[bytes]]]:
    """A TCP server that answers every connection with the bytes put in its list (one per connection)."""
    answers: list[bytes] = []
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answers.pop(0))

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}", answers
    srv.close()


async def _get(url: str) -> tuple[int, list[tuple[str, str]], bytes]:
    r = await exchange(url + "/cors-proxy?url=x", "POST", {"Content-Type": "application/json"}, b"{}")
    return r.status, r.headers, b"".join([c async for c in r.body])


def test_a_relayed_204_stays_204_with_no_body(upstream: tuple[str, list[bytes]]) -> None:
    url, answers = upstream
    answers.append(NO_CONTENT)
    status, headers, body = asyncio.run(_get(url))
    assert (status, body) == (204, b"")
    assert ("Access-Control-Allow-Origin", "*") in headers


def test_bodies_come_through_by_their_own_framing(upstream: tuple[str, list[bytes]]) -> None:
    url, answers = upstream
    answers += [CHUNKED, SIZED]
    status, headers, body = asyncio.run(_get(url))
    assert (status, body) == (200, b"abcde")
    assert [v for k, v in headers if k == "X-A"] == ["1", "2"]
    status, _, body = asyncio.run(_get(url))
    assert (status, body) == (404, b"nope!")
