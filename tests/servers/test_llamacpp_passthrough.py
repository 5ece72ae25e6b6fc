"""llama-server's endpoints, once directly and once through ``snapstore llama-proxy``: equal outcomes.

Every test is parametrized over ``direct`` / ``proxy``: the same requests against a fresh real
llama-server (xllamacpp, a tiny GGUF written here), the outcome recorded by the direct run and
required of the proxy run — the proxy may change nothing a client can observe but ``cache_n`` and
timings. The proxy-only tests at the end check what only the proxy does (restore across a
restart, what it logs, what it does not save).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import LlamaBridge  # noqa: E402
from snapstore.engine.llamacpp._prompt import tokens_in  # noqa: E402

BUILD = "test-build-pt"
KEY = "sekrit-key"
SYS = h.text_of(60, seed=5)
VIA = ["direct", "proxy"]
_seen: dict[str, Any] = {}


def same(key: str, value: Any) -> None:
    """The direct run records ``value``; the proxy run must produce the same."""
    if key in _seen:
        assert value == _seen[key], key
    else:
        _seen[key] = value


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return h.write_llama(str(tmp_path_factory.mktemp("models") / "llama.gguf"))


@dataclass
class Target:
    url: str  # where the client talks: the server, or the proxy in front of it
    server: Any  # the llama-server itself
    bridge: LlamaBridge | None = None
    metrics: Any = None
    host: str = "127.0.0.1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def target(via: str, model: str, tmp_path: Any, *, store: str | None = None, api_key: str | None = None,
           **kw: Any) -> Iterator[Target]:
    """A fresh llama-server (two slots), and for ``proxy`` the proxy in front of it with its own store."""
    slots = str(tmp_path / "slots")
    kw.setdefault("n_parallel", 2)
    if api_key:
        outer = kw.pop("tweak", None)

        def tweak(p: Any) -> None:
            p.api_keys = [api_key]
            if outer:
                outer(p)
        kw["tweak"] = tweak
    with h.llama_server(model, slots, **kw) as srv:
        if via == "direct":
            yield Target(srv.url, srv)
            return
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store or str(tmp_path / "store"), build=BUILD,
                             **({"api_key": api_key} if api_key else {}))
        bridge.start()
        try:
            with h.proxy(bridge) as (url, metrics):
                yield Target(url, srv, bridge, metrics)
        finally:
            bridge.close()


def settle(bridge: LlamaBridge) -> None:
    """Wait for the proxy's background saves of the requests answered so far."""
    if hasattr(bridge, "settle"):
        bridge.settle()
    else:  # the bridge before saves went to the background: its after() ran before the response ended
        time.sleep(0.5)


def call(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    """One HTTP exchange on a fresh connection: status, headers (lower-case names), raw body."""
    port = int(url.rsplit(":", 1)[1])
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = None if body is None else json.dumps(body).encode()
    hd = {"Content-Type": "application/json"} if data is not None else {}
    c.request(method, path, body=data, headers={**hd, **(headers or {})})
    r = c.getresponse()
    out = r.read()
    hdrs = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hdrs, out


def framing(hdrs: dict[str, str], body: bytes) -> dict[str, Any]:
    """What a client sees of a response's shape: header names (but Date), framing and fixed values."""
    if "content-length" in hdrs:
        assert int(hdrs["content-length"]) == len(body)
    return {"names": sorted(set(hdrs) - {"date"}),
            **{k: hdrs.get(k) for k in ("content-type", "keep-alive", "transfer-encoding", "server", "connection")}}


def gen(out: dict[str, Any]) -> dict[str, Any]:
    """The generation facts of a /completion reply (no timings)."""
    return {k: out.get(k) for k in ("content", "tokens_predicted", "tokens_evaluated", "stop_type", "truncated")}


SLOT_STATE = ("id", "n_ctx", "speculative", "is_processing")  # what /slots says of a slot, not of its last task


def slot_states(body: bytes) -> list[dict[str, Any]]:
    return [{k: s.get(k) for k in SLOT_STATE} for s in json.loads(body)]


def sse(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]


def idle_within(t: Target, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        st, _, b = call(t.server.url, "GET", "/slots")
        if st == 200 and not any(s.get("is_processing") for s in json.loads(b)):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("via", VIA)
def test_completion_and_framing(model, tmp_path, via):
    with target(via, model, tmp_path) as t:
        st, hdrs, body = call(t.url, "POST", "/completion", {"prompt": h.text_of(40, 1), "n_predict": 8})
        assert st == 200
        out = json.loads(body)
        assert out["timings"]["cache_n"] == 0  # no start-up probe left a token in a slot
        same("completion", gen(out))
        same("completion.framing", framing(hdrs, body))
        assert "content-length" in hdrs and "transfer-encoding" not in hdrs and "keep-alive" in hdrs
        st, hdrs, body = call(t.url, "POST", "/completion", {"prompt": 12})  # the server's own 400
        same("completion.error", (st, json.loads(body), framing(hdrs, body)))


@pytest.mark.parametrize("via", VIA)
def test_chat_repeat_and_next_turn(model, tmp_path, via):
    """An exact repeat reads one token; the next turn, sent at once, continues the first's slot."""
    with target(via, model, tmp_path) as t:
        msgs = [{"role": "system", "content": SYS}, {"role": "user", "content": "hello world"}]
        req = {"messages": msgs, "max_tokens": 8, "temperature": 0}
        a = json.loads(call(t.url, "POST", "/v1/chat/completions", req)[2])
        b = json.loads(call(t.url, "POST", "/v1/chat/completions", req)[2])
        n = a["usage"]["prompt_tokens"]
        assert b["timings"]["cache_n"] == n - 1
        turn2 = {**req, "messages": [*msgs, a["choices"][0]["message"], {"role": "user", "content": "the cache"}]}
        c = json.loads(call(t.url, "POST", "/v1/chat/completions", turn2)[2])
        assert c["timings"]["cache_n"] >= n
        same("chat", [(x["choices"], x["usage"], x["timings"]["cache_n"]) for x in (a, b, c)])


@pytest.mark.parametrize("via", VIA)
def test_streaming(model, tmp_path, via):
    with target(via, model, tmp_path) as t:
        st, hdrs, body = call(t.url, "POST", "/completion", {"prompt": h.text_of(30, 2), "n_predict": 6,
                                                             "stream": True})
        events = sse(body)
        assert st == 200 and hdrs.get("transfer-encoding") == "chunked" and events[-1]["stop"]
        same("stream.completion", ("".join(e["content"] for e in events), len(events), framing(hdrs, body)))
        msgs = [{"role": "system", "content": SYS}, {"role": "user", "content": "tool answer"}]
        st, hdrs, body = call(t.url, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                                      "stream": True})
        events = sse(body)
        text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e.get("choices"))
        assert body.rstrip().endswith(b"data: [DONE]")
        same("stream.chat", (text, len(events), framing(hdrs, body)))


def _abandon(t: Target, body: dict[str, Any], after: float) -> None:
    """Send ``body`` to /completion and close the connection ``after`` seconds later, unread."""
    s = socket.create_connection(("127.0.0.1", t.port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    time.sleep(after)
    s.close()


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("stream", [False, True])
def test_cancel(model, tmp_path, via, stream, caplog):
    """A streaming client that leaves stops the server's work at once, through the proxy as directly
    (llama-server notices a closed connection only while it streams: a non-streamed request runs
    to its end either way); the proxy logs no traceback and saves nothing but a whole prompt."""
    caplog.set_level(logging.INFO)
    with target(via, model, tmp_path) as t:
        prompt = h.text_of(50, 3)
        _abandon(t, {"prompt": prompt, "n_predict": 7000 if stream else 300, "ignore_eos": True,
                     "stream": stream}, 0.5)
        assert idle_within(t, 3.0 if stream else 60.0), "llama-server kept generating after the client left"
        st, _, body = call(t.url, "POST", "/completion", {"prompt": "hello", "n_predict": 2})
        assert st == 200
        if t.bridge is not None:
            settle(t.bridge)
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
            assert not errors, [r.getMessage() for r in errors]
            allowed = {len(t.bridge.server.tokenize(prompt)), json.loads(body)["tokens_evaluated"]}
            # a cancelled request is saved only as the whole prompt the server had read
            assert {s.n_tokens for s in t.bridge.slots.store.snapshots()} <= allowed


@pytest.mark.parametrize("via", VIA)
def test_slots_tokenize_templates(model, tmp_path, via):
    with target(via, model, tmp_path) as t:
        st, hdrs, body = call(t.url, "GET", "/slots")
        same("slots.fresh", (st, json.loads(body)))  # no start-up probe's task shows
        text = h.text_of(20, 4)
        tok = json.loads(call(t.url, "POST", "/tokenize", {"content": text, "with_pieces": True})[2])
        ids = [p["id"] for p in tok["tokens"]]
        detok = json.loads(call(t.url, "POST", "/detokenize", {"tokens": ids})[2])
        msgs = [{"role": "system", "content": SYS}, {"role": "user", "content": "hi"}]
        tmpl = json.loads(call(t.url, "POST", "/apply-template", {"messages": msgs})[2])
        props = json.loads(call(t.url, "GET", "/props")[2])
        props.pop("model_path", None), props.pop("model_alias", None)
        same("tok", (tok, detok, tmpl, props))
        call(t.url, "POST", "/completion", {"prompt": text, "n_predict": 2, "id_slot": 1})
        st, _, body = call(t.url, "POST", "/slots/1?action=save", {"filename": "mine.bin"})
        saved = json.loads(body)
        saved.pop("timings")
        same("slots.save", (st, saved))
        st, _, body = call(t.url, "POST", "/slots/1?action=erase", {})
        same("slots.erase", (st, json.loads(body)))


@pytest.mark.parametrize("via", VIA)
def test_metrics(model, tmp_path, via):
    with target(via, model, tmp_path) as t:
        done = json.loads(call(t.url, "POST", "/completion", {"prompt": h.text_of(20, 6), "n_predict": 3})[2])
        st, hdrs, body = call(t.url, "GET", "/metrics")
        text = body.decode()
        series = {ln.split(" ")[0]: ln.split(" ")[1] for ln in text.splitlines()
                  if ln.startswith("llamacpp:") and "seconds" not in ln}
        counts = {k: v for k, v in series.items() if "per_decode" not in k}
        same("metrics", (st, hdrs.get("content-type"), sorted(series), counts))  # the server's series, its counts
        assert series["llamacpp:prompt_tokens_total"] == str(done["tokens_evaluated"])  # no probe counted
        if via == "proxy":
            assert text.index("llamacpp:") < text.index("snapstore_llama_requests_total")


@pytest.mark.parametrize("via", VIA)
def test_metrics_disabled(model, tmp_path, via):
    """A server without --metrics answers 501 through the proxy too (llama.cpp's test_metrics_disabled;
    the proxy's own series are served only beside the server's)."""
    def off(p: Any) -> None:
        p.endpoint_metrics = False

    with target(via, model, tmp_path, tweak=off) as t:
        st, hdrs, body = call(t.url, "GET", "/metrics")
        assert st == 501
        same("metrics.disabled", (st, json.loads(body), framing(hdrs, body)))


@pytest.mark.parametrize("via", VIA)
def test_api_key(model, tmp_path, via):
    with target(via, model, tmp_path, api_key=KEY) as t:
        bearer, xkey = {"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}
        body = {"prompt": h.text_of(30, 7), "n_predict": 3}
        outs = []
        for path, req, hd in [("/completion", body, {}), ("/completion", body, {"Authorization": "Bearer no"}),
                              ("/completion", body, bearer), ("/completion", body, xkey), ("/props", None, {}),
                              ("/metrics", None, {}), ("/metrics", None, bearer), ("/health", None, {}),
                              ("/v1/models", None, {})]:
            st, hdrs, b = call(t.url, "GET" if req is None else "POST", path, req, hd)
            outs.append((path, hd, st, framing(hdrs, b) if st == 401 else None,
                         json.loads(b) if st == 401 else None))
        same("api_key", outs)
        assert [o[2] for o in outs[:4]] == [401, 401, 200, 200]
        if t.bridge is not None:  # the proxy's own calls carry the key: its saves happened
            settle(t.bridge)
            assert t.bridge.slots.store.stats().entries >= 1


@pytest.mark.parametrize("via", VIA)
def test_cache_prompt_false(model, tmp_path, via):
    """``cache_prompt: false`` is the client's word: the server reads it all, the proxy saves nothing."""
    with target(via, model, tmp_path) as t:
        prompt = h.text_of(60, 8)
        first = json.loads(call(t.url, "POST", "/completion", {"prompt": prompt, "n_predict": 3})[2])
        if t.bridge is not None:  # the first's slot free again and its prompt stored: a proxy that forced
            settle(t.bridge)  # cache_prompt back on would have the server reuse (or restore) it
        again = json.loads(call(t.url, "POST", "/completion", {"prompt": prompt, "n_predict": 3,
                                                               "cache_prompt": False})[2])
        other = json.loads(call(t.url, "POST", "/completion", {"prompt": h.text_of(40, 9), "n_predict": 3,
                                                               "cache_prompt": False})[2])
        same("cache_prompt", [(gen(x), x["timings"]["cache_n"]) for x in (first, again, other)])
        assert again["timings"]["cache_n"] == 0
        if t.bridge is not None:
            settle(t.bridge)
            assert {s.n_tokens for s in t.bridge.slots.store.snapshots()} == {first["tokens_evaluated"]}


@pytest.mark.parametrize("via", VIA)
def test_server_ram_cache_still_works(model, tmp_path, via):
    """With --cache-ram, a prompt pushed out of the only slot comes back from the server's host-RAM
    cache; the proxy (which has not seen it) must leave the server to pick and load it."""
    def ram(p: Any) -> None:
        p.cache_ram_mib = 64

    with target(via, model, tmp_path, n_parallel=1, tweak=ram) as t:
        a, b = h.text_of(200, 10), h.text_of(200, 11)
        for p in (a, b):  # straight to the server: the proxy's store never sees them
            call(t.server.url, "POST", "/completion", {"prompt": p, "n_predict": 2})
        again = json.loads(call(t.url, "POST", "/completion", {"prompt": a, "n_predict": 2})[2])
        assert again["timings"]["cache_n"] > 150
        same("cache_ram", (gen(again), again["timings"]["cache_n"]))


# -- what only the proxy does ------------------------------------------------------------------------


def test_exact_repeat_restored_after_restart(model, tmp_path, caplog):
    """A completion stored whole is restored whole after a restart (the server re-reads one token),
    its save logged as what it is; the output equals a store-less run."""
    caplog.set_level(logging.INFO, logger="snapstore.engine.llamacpp")
    prompt = h.text_of(240, 12)
    store = str(tmp_path / "store")
    with target("proxy", model, tmp_path, store=store) as t:
        first = json.loads(call(t.url, "POST", "/completion", {"prompt": prompt, "n_predict": 6})[2])
        settle(t.bridge)
    n = first["tokens_evaluated"]
    saves = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved ")]
    assert saves and all("(completion prompt)" in m for m in saves), saves
    with target("proxy", model, tmp_path, store=store) as t:
        again = json.loads(call(t.url, "POST", "/completion", {"prompt": prompt, "n_predict": 6})[2])
    with target("direct", model, tmp_path) as t:
        want = json.loads(call(t.url, "POST", "/completion", {"prompt": prompt, "n_predict": 6})[2])
    assert again["content"] == want["content"] == first["content"]
    assert again["timings"]["cache_n"] == n - 1 and want["timings"]["cache_n"] == 0


def test_no_restore_over_a_slot_that_holds_more(model, tmp_path):
    """A slot whose own cache covers more of the prompt than the store keeps it: no restore."""
    with target("proxy", model, tmp_path) as t:
        msgs = [{"role": "system", "content": SYS}, {"role": "user", "content": "hello"}]
        a = json.loads(call(t.url, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 4})[2])
        settle(t.bridge)
        before = t.metrics.hits._value.get()
        turn2 = [*msgs, a["choices"][0]["message"], {"role": "user", "content": "world"}]
        b = json.loads(call(t.url, "POST", "/v1/chat/completions", {"messages": turn2, "max_tokens": 4})[2])
        assert t.metrics.hits._value.get() == before
        assert b["timings"]["cache_n"] >= a["usage"]["prompt_tokens"]


def test_start_leaves_every_slot_cache_as_it_was(model, tmp_path):
    """Starting the proxy (the identity's K/V probe in an idle slot) leaves what every slot holds as it
    was, no file behind, and no cached-token count changed (the probe's task, which only the server
    itself shows, is taken out of what the proxy serves: tests/servers/test_llamacpp_invisible.py)."""
    slots = str(tmp_path / "slots")

    def held(srv: Any) -> list[list[int]]:
        out = []
        for s in range(2):
            call(srv.url, "POST", f"/slots/{s}?action=save", {"filename": "look.bin"})
            with open(os.path.join(slots, "look.bin"), "rb") as f:
                out.append(tokens_in(f.read()))
            os.unlink(os.path.join(slots, "look.bin"))
        return out

    def cached(srv: Any) -> str:
        text = call(srv.url, "GET", "/metrics")[2].decode()
        return next(ln for ln in text.splitlines() if ln.startswith("llamacpp:prompt_tokens_cached_total"))

    prompts = [h.text_of(30, 21), h.text_of(50, 22)]
    with h.llama_server(model, slots, n_parallel=2) as srv:
        for s, p in enumerate(prompts):
            call(srv.url, "POST", "/completion", {"prompt": p, "n_predict": 0, "id_slot": s})
        before, busy, hits = held(srv), slot_states(call(srv.url, "GET", "/slots")[2]), cached(srv)
        assert all(before)
        bridge = LlamaBridge(srv.url, slots, model, store_dir=str(tmp_path / "store"), build=BUILD)
        bridge.start()
        bridge.close()
        assert held(srv) == before and slot_states(call(srv.url, "GET", "/slots")[2]) == busy
        assert cached(srv) == hits
        again = json.loads(call(srv.url, "POST", "/completion", {"prompt": prompts[0], "n_predict": 0,
                                                                 "id_slot": 0})[2])
        assert again["timings"]["cache_n"] == len(before[0]) - 1  # slot 0's cache survived the probe
    assert not [f for f in os.listdir(slots) if f.startswith("snapstore-")]


def test_storer_thread_ends_with_bridge(model, tmp_path):
    """The storer thread stops with the bridge (no thread left behind)."""
    with target("proxy", model, tmp_path) as t:
        call(t.url, "POST", "/completion", {"prompt": h.text_of(30, 13), "n_predict": 2})
    assert not [th for th in threading.enumerate() if th.name == "snapstore-llama-storer"]


@pytest.mark.parametrize("via", VIA)
def test_metrics_read_after_a_response_is_stable(model, tmp_path, via):
    """A /metrics read right after a response and one a while later, with only read-only requests
    between, are equal (llama.cpp's test_server_sleep_read_only_endpoints): the proxy's own series
    already count that response's save, which lands in the background, and count no /props or
    /health poll. The store is held busy by another writer for a moment, so the save lands only
    after the response; before, the first read did not count it (and every poll was counted)."""
    import apsw

    def settled(text: str) -> list[str]:  # the throughput gauges: a window since the last read
        return [ln for ln in text.splitlines() if not ln.startswith(("llamacpp:prompt_tokens_seconds",
                                                                     "llamacpp:predicted_tokens_seconds"))]

    with target(via, model, tmp_path) as t:
        hold = None
        if t.bridge is not None:  # another writer holds the store's database for 0.5 s
            hold = apsw.Connection(os.path.join(str(tmp_path / "store"), "snapstore.db"))
            hold.execute("BEGIN IMMEDIATE")
            threading.Timer(0.5, lambda: hold.execute("COMMIT")).start()
        call(t.url, "POST", "/completion", {"prompt": h.text_of(120, 50), "n_predict": 2})
        first = call(t.url, "GET", "/metrics")[2].decode()
        time.sleep(1.0)  # the save has landed by now either way
        for path in ("/props", "/health", "/slots", "/v1/models"):  # what polls a server: no task, no count
            call(t.url, "GET", path)
        second = call(t.url, "GET", "/metrics")[2].decode()
        assert settled(first) == settled(second)
        if hold is not None:
            hold.close()
