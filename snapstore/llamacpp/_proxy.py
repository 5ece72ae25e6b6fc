"""``snapstore llama-proxy``: an HTTP proxy in front of llama-server that adds prefix persistence.

Every request is passed through unchanged (method, path, query, headers, body; the response's
status, headers and body streamed back as they arrive, errors untouched). Completion and chat
completion requests also go through ``LlamaBridge``: before forwarding, the longest stored prefix
is restored into the request's slot when it beats what the slot holds; after the response, the
system-prompt and conversation boundaries are saved. ``/metrics`` here is the proxy's own
(Prometheus text format); llama-server's stays at its own address. aiohttp serves and forwards
(one well-kept library for both sides, streaming included); store and slot work runs in a
worker thread so the event loop never blocks on disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from ._bridge import CHAT_PATHS, COMPLETION_PATHS, LlamaBridge, Plan
from ._metrics import BridgeMetrics

__all__ = ["make_app", "run_proxy"]

log = logging.getLogger("snapstore.llamacpp")
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length"}


def make_app(bridge: LlamaBridge, metrics: BridgeMetrics) -> Any:
    """The aiohttp application: /metrics, and everything else passed through to the bridge's upstream."""
    from aiohttp import ClientSession, ClientTimeout, web

    client_key = web.AppKey("client", ClientSession)

    async def on_startup(app: web.Application) -> None:
        app[client_key] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=30), auto_decompress=False)

    async def on_cleanup(app: web.Application) -> None:
        await app[client_key].close()

    async def metrics_handler(request: web.Request) -> web.Response:
        store = bridge.slots.store
        stats = await asyncio.to_thread(store.stats) if store is not None else None
        metrics.refresh(stats)
        body, ctype = metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def passthrough(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        plan: Plan | None = None
        kind = "chat" if path in CHAT_PATHS else "completion" if path in COMPLETION_PATHS else "other"
        metrics.requests.labels(kind=kind).inc()
        if kind != "other" and request.method == "POST":
            try:
                parsed = json.loads(body or b"null")
            except ValueError:
                parsed = None  # not JSON: llama-server answers it with its own error
            if isinstance(parsed, dict):
                headers = {k: v for k, v in request.headers.items()}
                try:
                    plan = await asyncio.to_thread(bridge.before, path, parsed, headers)
                    body = json.dumps(plan.body).encode()
                except Exception as e:  # the bridge never breaks a request: forward it as it came
                    log.warning("bridge skipped for %s: %s", path, e)
                    plan = None
        ok = False
        try:
            resp = await _forward(request, body)
            ok = resp.status < 400
            return resp
        finally:
            if plan is not None:
                p = plan
                try:
                    await asyncio.shield(asyncio.to_thread(_after, bridge, p, ok))
                except Exception as e:  # pragma: no cover - _after logs its own failures
                    log.warning("bridge after() failed: %s", e)

    async def _forward(request: web.Request, body: bytes) -> web.StreamResponse:
        client = request.app[client_key]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = bridge.upstream + request.rel_url.path_qs
        async with client.request(request.method, url, headers=headers, data=body) as up:
            out = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    out.headers.add(k, v)
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


def _after(bridge: LlamaBridge, plan: Plan, ok: bool) -> None:
    try:
        bridge.after(plan, ok)
    finally:
        bridge.release(plan)


def run_proxy(bridge: LlamaBridge, host: str, port: int, on_listen: Callable[[], None] | None = None) -> None:
    """Serve until interrupted (SIGINT/SIGTERM); ``on_listen`` runs once the port is bound."""
    from aiohttp import web

    metrics = BridgeMetrics()
    bridge.events = metrics.events()
    web.run_app(make_app(bridge, metrics), host=host, port=port, access_log=None,
                print=None if on_listen is None else lambda _banner: on_listen())
