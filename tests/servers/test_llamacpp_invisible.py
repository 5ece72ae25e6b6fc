"""What llama-server does for a client is what it does through ``snapstore llama-proxy`` (issue 25).

Measured on the server's side, against the real llama-server (xllamacpp, a tiny GGUF written
here): how many tokens it generates after a client leaves (the proxy as the CLI runs it), which
slot and cache it reuses for a repeated prompt, and what its ``/slots`` and ``/metrics`` say once
a proxy has started in front of it. These tests use only what the proxy's first version had too
(``LlamaBridge(url, slots, model, store_dir=, build=)``, the ``llama-proxy`` command), so each
can be run against it and fails there.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import LlamaBridge  # noqa: E402

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

pytestmark = pytest.mark.slow
BUILD = "test-build-inv"
ROOT = REPO_DIR


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return h.write_llama(str(tmp_path_factory.mktemp("models") / "llama.gguf"))


def get(url: str, path: str) -> bytes:
    with urllib.request.urlopen(url + path, timeout=120) as r:
        data: bytes = r.read()
        return data


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def counters(url: str) -> dict[str, float]:
    """llama-server's own counters (``llamacpp:*_total`` and ``n_tokens_max``), read without resetting
    anything a client could see (the throughput gauges are left out: a /metrics read resets them)."""
    out = {}
    for ln in get(url, "/metrics").decode().splitlines():
        if ln.startswith("llamacpp:") and (ln.split(" ")[0].endswith("_total") or "n_tokens_max" in ln):
            name, value = ln.split(" ")
            if "seconds" not in name:
                out[name] = float(value)
    return out


def wait_idle(url: str, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not any(s.get("is_processing") for s in json.loads(get(url, "/slots"))):
            return
        time.sleep(0.05)
    raise AssertionError("llama-server still busy")


@contextlib.contextmanager
def cli_proxy(srv: Any, model: str, slots: str, store: str, log: list[str]) -> Iterator[str]:
    """``snapstore llama-proxy`` as an operator runs it (its own process, its own event loop settings);
    what it wrote on stderr is added to ``log`` when it has stopped."""
    port = h.free_port()
    p = subprocess.Popen([sys.executable, "-m", "snapstore", "--dir", store, "llama-proxy", "--upstream", srv.url,
                          "--slot-save-path", slots, "--model", model, "--build", BUILD,
                          "--listen", f"127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:  # listening once the port accepts (the first version printed no start line)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert p.poll() is None and time.monotonic() < deadline, "llama-proxy did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        p.terminate()
        log.append(p.communicate(timeout=60)[1].decode(errors="replace"))


def abandon(url: str, server_url: str, body: dict[str, Any], stream: bool) -> None:
    """Send ``body`` to /completion, wait until the server has generated a few tokens for it (its
    ``/slots``), read what came (a streamed request: events) and leave."""
    port = int(url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps({**body, "stream": stream}).encode()
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    deadline = time.monotonic() + 120
    while not any(s.get("is_processing") and s.get("next_token", [{}])[0].get("n_decoded", 0) >= 8
                  for s in json.loads(get(server_url, "/slots"))):
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.01)
    s.close()


N_PREDICT = 20000


@pytest.mark.parametrize("via", ["direct", "proxy"])
def test_a_client_that_leaves_stops_the_servers_generation(model, tmp_path, via):
    """Item 3: a streaming client disconnects once the server has generated a few tokens.
    llama-server stops at once directly; through ``llama-proxy`` (the command, as operators run it)
    it must too — counted in tokens the server generated for the request
    (``llamacpp:tokens_predicted_total``), not in time — and the proxy logs no traceback. (A
    non-streamed request runs to its end directly too: llama-server does not watch its connection
    then.) The first proxy noticed the disconnect only when its next write to the client failed,
    with an aiohttp traceback in its log."""
    slots, log = str(tmp_path / "slots"), []
    with h.llama_server(model, slots, n_parallel=2) as srv:
        with contextlib.ExitStack() as stack:
            url = srv.url if via == "direct" else stack.enter_context(
                cli_proxy(srv, model, slots, str(tmp_path / "store"), log))
            before = counters(srv.url)["llamacpp:tokens_predicted_total"]
            abandon(url, srv.url, {"prompt": h.text_of(30, 3), "n_predict": N_PREDICT, "ignore_eos": True}, True)
            wait_idle(srv.url)
            generated = counters(srv.url)["llamacpp:tokens_predicted_total"] - before
    # directly the server stops within a few tokens of the disconnect; allow the proxy a margin
    # for its own buffering, far below what a request left running generates
    assert 8 <= generated <= 1000, generated
    assert not [ln for ln in "".join(log).splitlines() if "Traceback" in ln or "Error" in ln], log


def _repeat_after_other(url: str, server_url: str, a: str, x: str) -> dict[str, Any]:
    """``x`` then ``a`` straight to the server (a lands in slot 1: slot 0 holds x), then ``a`` again via ``url``."""
    post(server_url, "/completion", {"prompt": x, "n_predict": 2, "id_slot": 0})
    post(server_url, "/completion", {"prompt": a, "n_predict": 2, "id_slot": 1})
    return post(url, "/completion", {"prompt": a, "n_predict": 2})


@pytest.mark.parametrize("cache_ram", [0, 64])
def test_the_server_still_picks_the_slot_that_holds_the_prompt(model, tmp_path, cache_ram):
    """Item 4: a prompt some slot already holds (and, with ``--cache-ram``, the server's own prompt
    cache) is reused as much through the proxy, which has not seen it, as directly: the proxy must
    not force its own slot choice (the first version sent it to slot 0, holding another prompt)."""
    def ram(p: Any) -> None:
        p.cache_ram_mib = cache_ram

    a, x = h.text_of(120, 31), h.text_of(120, 32)
    with h.llama_server(model, str(tmp_path / "d"), n_parallel=2, tweak=ram) as srv:
        direct = _repeat_after_other(srv.url, srv.url, a, x)
    slots = str(tmp_path / "p")
    with h.llama_server(model, slots, n_parallel=2, tweak=ram) as srv:
        bridge = LlamaBridge(srv.url, slots, model, store_dir=str(tmp_path / "store"), build=BUILD)
        bridge.start()
        try:
            with h.proxy(bridge) as (url, _):
                via = _repeat_after_other(url, srv.url, a, x)
        finally:
            bridge.close()
    assert direct["timings"]["cache_n"] == direct["tokens_evaluated"] - 1
    assert via["timings"]["cache_n"] == direct["timings"]["cache_n"]
    assert via["content"] == direct["content"]


THROUGHPUT = ("llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds")  # reset by every /metrics read


def series(url: str) -> dict[str, float]:
    """Every ``llamacpp:*`` sample but the throughput gauges (a window since the last /metrics read)."""
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in get(url, "/metrics").decode().splitlines()
            if ln.startswith("llamacpp:") and ln.split(" ")[0] not in THROUGHPUT}


def assert_same_series(got: dict[str, float], want: dict[str, float]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():  # times and averages as the server prints them (6 decimals): rounding aside
        assert got[k] == pytest.approx(v, abs=1e-5) if "seconds" in k or "per_decode" in k else got[k] == v, k


def test_starting_the_proxy_leaves_slots_and_metrics_as_they_were(model, tmp_path):
    """Item 2: a client of the proxy sees llama-server's ``/slots`` and ``/metrics`` as they were before
    the proxy started — no task of the identity probe in a slot, none in the counters — and the
    counters then count the client's requests only. (The first version's start-up capture showed as
    slot 0's last task and in the counters.)"""
    slots = str(tmp_path / "slots")
    with h.llama_server(model, slots, n_parallel=2) as srv:
        post(srv.url, "/completion", {"prompt": h.text_of(30, 41), "n_predict": 3, "id_slot": 0})
        before_slots, before = json.loads(get(srv.url, "/slots")), series(srv.url)
        bridge = LlamaBridge(srv.url, slots, model, store_dir=str(tmp_path / "store"), build=BUILD)
        bridge.start()
        try:
            with h.proxy(bridge) as (url, _):
                assert json.loads(get(url, "/slots")) == before_slots
                assert_same_series(series(url), before)
                done = post(url, "/completion", {"prompt": h.text_of(40, 42), "n_predict": 4})
                after = series(url)
                want = {**before, "llamacpp:prompt_tokens_total": before["llamacpp:prompt_tokens_total"]
                        + done["tokens_evaluated"] - done["timings"]["cache_n"],
                        "llamacpp:tokens_predicted_total": before["llamacpp:tokens_predicted_total"] + 4}
                for k in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"):
                    assert after[k] == want[k], k
        finally:
            bridge.close()
