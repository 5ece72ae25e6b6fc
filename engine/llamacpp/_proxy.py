"""``snapstore llama-proxy``: an HTTP proxy in front of llama-server that adds prefix persistence.

Invisible by design: a client sees what llama-server would send — status, headers (framing:
Content-Length or chunked, Keep-Alive) and body as they arrive, errors untouched — except
``timings.cache_n`` (and the times) when a restore spared the server some reading. Completion and
chat completion requests also go through ``LlamaBridge`` (restore before, save after; a request
with ``cache_prompt: false`` is left alone). A client that disconnects cancels the upstream request
at once. ``/metrics`` serves llama-server's own series, then the proxy's; ``/metrics`` and ``/slots`` come
without what the identity probe left in them (``_trace``). With ``--api-key`` the
proxy does its own work only for requests carrying the key; any other request is passed through
as it came, so llama-server answers it (401) itself. aiohttp serves and forwards; the bridge's
store and slot work runs on a thread pool of its own, where no job waits for another.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from snapstore import PrefillRate

from ._bridge import SLOT_FREE_PATHS, LlamaBridge, Plan
from ._metrics import BridgeMetrics
from ._prompt import CHAT_PATHS, COMPLETION_PATHS
from ._rawhttp import exchange

if TYPE_CHECKING:
    from aiohttp import web
    from multidict import CIMultiDict

__all__ = ["make_app", "run_proxy"]

log = logging.getLogger("snapstore.engine.llamacpp")
# hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp writes itself from the body
_HOP_REQUEST = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                "transfer-encoding", "upgrade", "host", "content-length"}
_HOP_RESPONSE = {"connection", "proxy-authenticate", "proxy-authorization", "te", "trailers", "transfer-encoding",
                 "upgrade", "content-length"}
_ID_SLOT = re.compile(rb'(?<!\\)"id_slot":(\d+)')
# llama-server's own timing of the prompt it read (``timings``): the proxy's measured prefill rate
_PROMPT_N = re.compile(rb'(?<!\\)"prompt_n":(\d+)')
_PROMPT_MS = re.compile(rb'(?<!\\)"prompt_ms":([0-9.eE+-]+)[,}]')
_CACHE_N = re.compile(rb'(?<!\\)"cache_n":(\d+)')
# llama-server's relay of other servers' answers: a bodiless status comes with a chunked terminator
# that a strict client reads as the next response (_rawhttp); these go through the proxy's own framing
RAW_PATHS = frozenset({"/cors-proxy"})


def authorized(headers: Mapping[str, str], key: str | None) -> bool:
    """Whether a request carries llama-server's API key (``Authorization: Bearer`` or ``X-Api-Key``)."""
    if not key:
        return True
    auth = headers.get("Authorization", "")
    given = auth[len("Bearer "):] if auth.startswith("Bearer ") else headers.get("X-Api-Key", "")
    return hmac.compare_digest(given.encode(), key.encode())


class _SlotSniffer:
    """The last ``"id_slot": N`` (N >= 0) in a response body, as it streams past (the slot that served it)."""

    def __init__(self) -> None:
        self.slot: int | None = None
        self.prompt_n: int | None = None  # and the server's timing of the prompt it read (``timings``)
        self.prompt_ms: float | None = None
        self.cache_n: int | None = None  # prompt tokens the server reused (the proof of a save: LlamaBridge._copy_out)
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        buf = self._tail + chunk
        for m in _ID_SLOT.finditer(buf):
            self.slot = int(m.group(1))
        for m in _PROMPT_N.finditer(buf):
            self.prompt_n = int(m.group(1))
        for m in _CACHE_N.finditer(buf):
            self.cache_n = int(m.group(1))
        for m in _PROMPT_MS.finditer(buf):
            try:
                self.prompt_ms = float(m.group(1))
            except ValueError:
                pass
        self._tail = buf[-40:]

    def timed(self, rate: PrefillRate) -> None:
        """Give the prompt's timing to the bridge's prefill rate (passed to its store's match)."""
        if self.prompt_n and self.prompt_ms:
            rate.observe(self.prompt_n, self.prompt_ms / 1e3)


def make_app(bridge: LlamaBridge, metrics: BridgeMetrics) -> Any:
    """The aiohttp application: /metrics, and everything else passed through to the bridge's upstream."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    client_key = web.AppKey("client", ClientSession)
    pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="snapstore-llama")

    async def on_startup(app: web.Application) -> None:
        # kept-alive upstream connections are dropped before llama-server's own Keep-Alive timeout
        # (5 s by default) would close them under a request (_open retries that case once)
        app[client_key] = ClientSession(connector=TCPConnector(keepalive_timeout=2.0),
                                        timeout=ClientTimeout(total=None, sock_connect=30), auto_decompress=False,
                                        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))

    async def on_cleanup(app: web.Application) -> None:
        await app[client_key].close()
        pool.shutdown(wait=True)

    def in_pool(fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def metrics_handler(request: web.Request) -> web.StreamResponse:
        if not authorized(request.headers, bridge.api_key):
            return await passthrough(request)
        client = request.app[client_key]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_REQUEST}
        async with client.get(bridge.upstream + request.rel_url.path_qs, headers=headers) as up:
            theirs, status, up_headers = await up.read(), up.status, up.headers
        if status != 200:  # the server's answer stands: bad credentials, or no --metrics (501)
            return _answer(web.Response(status=status, body=theirs, headers=_response_headers(up_headers)),
                           up_headers)
        # the proxy's series count the saves of every request answered before this read (they land
        # in the background a few ms after the response), so that two reads with no request between
        # them are equal, as the server's are (llama.cpp's test_server_sleep_read_only_endpoints)
        await in_pool(bridge.wait_landed, 2.0)
        store = bridge.slots.store
        stats = await asyncio.to_thread(store.stats) if store is not None else None
        metrics.refresh(stats)
        ours, _ = metrics.render()
        out = _response_headers(up_headers)
        theirs = bridge.watch.trace.metrics(theirs.decode(errors="replace")).encode()  # the probes taken out
        return _answer(web.Response(body=theirs + (b"" if theirs.endswith(b"\n") or not theirs else b"\n") + ours,
                                    headers=out), up_headers)

    async def slots_handler(request: web.Request) -> web.StreamResponse:
        """``GET /slots``: the server's answer, each identity-probe slot shown as it was before its probe."""
        if not authorized(request.headers, bridge.api_key):
            return await passthrough(request)
        client = request.app[client_key]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_REQUEST}
        async with client.get(bridge.upstream + request.rel_url.path_qs, headers=headers) as up:
            theirs, status, up_headers = await up.read(), up.status, up.headers
        body = bridge.watch.trace.slots(theirs) if status == 200 else theirs
        return _answer(web.Response(status=status, body=body, headers=_response_headers(up_headers)), up_headers)

    async def passthrough(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        plan: Plan | None = None
        kind = "chat" if path in CHAT_PATHS else "completion" if path in COMPLETION_PATHS else "other"
        if kind != "other":  # the proxy's series move with the requests it works on only, as the
            metrics.requests.labels(kind=kind).inc()  # server's do with tasks (not /props, /health...)
        if kind != "other" and request.method == "POST" and authorized(request.headers, bridge.api_key):
            try:
                parsed = json.loads(body or b"null")
            except ValueError:
                parsed = None  # not JSON: llama-server answers it with its own error
            if isinstance(parsed, dict):
                headers = dict(request.headers.items())
                try:
                    plan = await in_pool(bridge.before, path, parsed, headers)
                    if plan is not None and plan.body != parsed:
                        body = json.dumps(plan.body).encode()
                except Exception as e:  # the bridge never breaks a request: forward it as it came
                    log.warning("bridge skipped for %s: %s", path, e)
                    plan = None
        sniff = _SlotSniffer()
        status, cancelled = 599, False
        # a request that may fill a slot with state the bridge does not key (not admitted by it): every
        # slot loses its proof while it runs and after it (LlamaBridge.foreign)
        foreign = request.method == "POST" and path not in SLOT_FREE_PATHS and (plan is None or plan.generation is None)
        if foreign:
            bridge.foreign(+1)
        try:
            if path in RAW_PATHS:  # relays any target's status, framed as llama-server frames it (_rawhttp)
                resp, status = await _forward_raw(request, body)
                return resp
            resp, status, cancelled = await _forward(request, body, sniff, plan)
            return resp  # a client that left: aiohttp's own finish of the response notices it quietly
        except asyncio.CancelledError:
            cancelled = True  # the client left: the upstream request was closed with it
            raise
        finally:
            if foreign:
                bridge.foreign(-1)
            sniff.timed(bridge.slots.prefill_rate)
            if plan is not None:
                plan.cache_n = sniff.cache_n  # not awaited: a cancelled handler must not wait for the save
                in_pool(_after, bridge, plan, status < 400 and not cancelled, sniff.slot, cancelled)

    async def _forward_raw(request: web.Request, body: bytes) -> tuple[web.StreamResponse, int]:
        """``request`` forwarded by ``_rawhttp.exchange``: status, headers and body as the server sent them."""
        from multidict import CIMultiDict

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_REQUEST}
        up = await exchange(bridge.upstream + request.rel_url.path_qs, request.method, headers, body)
        theirs: CIMultiDict[str] = CIMultiDict(up.headers)
        out = web.StreamResponse(status=up.status, reason=up.reason or None, headers=_response_headers(theirs))
        if up.close:
            out.force_close()
        if "chunked" not in theirs.get("Transfer-Encoding", "").lower() and "Content-Length" in theirs \
                and up.status not in (204, 304) and not 100 <= up.status < 200:
            out.content_length = int(theirs["Content-Length"])
        try:
            await out.prepare(request)
            async for chunk in up.body:
                await out.write(chunk)
            await out.write_eof()
        finally:
            await up.body.aclose()  # the upstream connection closed however the client's side ended
        return out, up.status

    async def _forward(request: web.Request, body: bytes, sniff: _SlotSniffer, plan: Plan | None
                       ) -> tuple[web.StreamResponse, int, bool]:
        """The server's response passed to the client as it comes: (response, status, whether the
        client left before the end — then the upstream request is closed at once, which cancels the
        server's task, and nothing is raised: a raise would be logged as a handler error)."""
        client = request.app[client_key]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_REQUEST}
        url = bridge.upstream + request.rel_url.path_qs
        up = await _open(client, request.method, url, headers, body)
        try:
            out = web.StreamResponse(status=up.status, reason=up.reason, headers=_response_headers(up.headers))
            if up.headers.get("Connection", "").lower() == "close":
                out.force_close()
            bodiless = up.status in (204, 304) or 100 <= up.status < 200 or request.method == "HEAD"
            if not bodiless and "chunked" not in up.headers.get("Transfer-Encoding", "").lower() \
                    and up.content_length is not None:
                out.content_length = up.content_length  # the server's framing: no chunking added
            try:
                await out.prepare(request)
                if bodiless:  # a status that has no body (RFC 9110 6.4.1): sent as it came, nothing read
                    await out.write_eof()
                    up.close()
                    return out, up.status, False
                async for chunk in up.content.iter_any():
                    sniff.feed(chunk)
                    await out.write(chunk)
                if plan is not None:
                    bridge.answered(plan)  # before the client can see the end (no await in between)
                await out.write_eof()
            except ConnectionResetError:  # the client went away (aiohttp's ClientConnectionResetError)
                up.close()
                return out, up.status, True
            up.release()
            return out, up.status, False
        except BaseException:
            up.close()  # drop the upstream connection: llama-server cancels a streamed task at once
            raise

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/slots", slots_handler)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


async def _open(client: Any, method: str, url: str, headers: Mapping[str, str], body: bytes) -> Any:
    """The upstream response (headers read). A kept-alive connection the server closed meanwhile
    fails before the request reached it: that one case is sent again, on a new connection."""
    from aiohttp import ClientOSError, ServerDisconnectedError

    try:
        return await client.request(method, url, headers=headers, data=body)
    except (ClientOSError, ServerDisconnectedError) as e:
        log.info("upstream connection closed under %s %s (%s): sent again", method, url, e)
        return await client.request(method, url, headers=headers, data=body)


def _answer(resp: web.Response, up_headers: Mapping[str, str]) -> web.Response:
    """``resp`` closing the client's connection after it when the server closed its own (its framing)."""
    if up_headers.get("Connection", "").lower() == "close":
        resp.force_close()
    return resp


def _response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    from multidict import CIMultiDict

    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _HOP_RESPONSE:
            out.add(k, v)
    return out


def _after(bridge: LlamaBridge, plan: Plan, ok: bool, served: int | None, cancelled: bool) -> None:
    try:
        bridge.after(plan, ok, served, cancelled)
    except Exception as e:  # after() logs its own failures; anything else must not kill the pool
        log.warning("bridge after() failed: %s", e)
    finally:
        bridge.release(plan)


def run_proxy(bridge: LlamaBridge, host: str, port: int, on_listen: Callable[[], None] | None = None) -> None:
    """Serve until interrupted (SIGINT/SIGTERM); ``on_listen`` runs once the port is bound."""
    from aiohttp import web

    metrics = BridgeMetrics()
    bridge.events = metrics.events()
    web.run_app(make_app(bridge, metrics), host=host, port=port, access_log=None, handler_cancellation=True,
                print=None if on_listen is None else lambda _banner: on_listen())
