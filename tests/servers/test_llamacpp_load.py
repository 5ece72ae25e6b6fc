"""llama-proxy under load: N >= 4 x slots concurrent clients against a real llama-server, bounded time.

Chat and completion, streaming and not, with shared system prompts (so restores and saves happen
all along): every request completes, every output equals the store-less reference (the same
request sent alone, straight to the server), and the proxy's /metrics answers throughout. The
same load straight to the server gives the latency the proxy adds (p50/p99, printed).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import LlamaBridge  # noqa: E402

SLOTS = 2
CLIENTS = 4 * SLOTS
SECONDS = 8.0
TIMEOUT = 30.0
THINK = (0.0, 1.5)  # a client's pause between requests (uniform): slots fall idle now and then, so the
# proxy restores and saves while other requests run (at full saturation it has no idle slot for either)


def _requests() -> list[tuple[str, dict[str, Any]]]:
    systems = [h.text_of(120, seed=20), h.text_of(90, seed=21)]
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(8):
        stream = i % 2 == 1
        if i % 4 < 2:
            msgs = [{"role": "system", "content": systems[i % 2]}, {"role": "user", "content": h.text_of(6, 30 + i)}]
            out.append(("/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                 "stream": stream}))
        else:
            out.append(("/completion", {"prompt": systems[i % 2] + " " + h.text_of(8, 40 + i), "n_predict": 6,
                                        "stream": stream}))
    return out


def _send(url: str, path: str, body: dict[str, Any]) -> str:
    """The generated text of one request (streamed or not)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        raw = r.read().decode()
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        out = json.loads(raw)
        return str(out["choices"][0]["message"]["content"] if chat else out["content"])
    text = []
    for line in raw.splitlines():
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if chat:
            text += [c["delta"].get("content") or "" for c in ev.get("choices", [])]
        else:
            text.append(ev.get("content", ""))
    return "".join(text)


def _load(url: str, reqs: list[tuple[str, dict[str, Any]]], want: list[str], metrics_url: str | None
          ) -> tuple[list[float], list[str], list[float]]:
    """CLIENTS threads for SECONDS: latencies, failures, and /metrics answer times."""
    lat: list[float] = []
    bad: list[str] = []
    polls: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + SECONDS

    def client(k: int) -> None:
        i = k
        rng = np.random.default_rng(k)
        while time.monotonic() < stop:
            path, body = reqs[i % len(reqs)]
            t0 = time.perf_counter()
            try:
                got = _send(url, path, body)
            except Exception as e:  # a hang (timeout) or an error: a failure, recorded
                with lock:
                    bad.append(f"request {i % len(reqs)}: {e!r}")
                return
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                if got != want[i % len(reqs)]:
                    bad.append(f"request {i % len(reqs)}: {got!r} != {want[i % len(reqs)]!r}")
            i += 1
            time.sleep(rng.uniform(*THINK))

    def poll() -> None:
        assert metrics_url is not None
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(metrics_url, timeout=5) as r:
                    r.read()
                polls.append(time.perf_counter() - t0)
            except Exception as e:
                with lock:
                    bad.append(f"/metrics: {e!r}")
            time.sleep(0.2)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
    if metrics_url:
        threads.append(threading.Thread(target=poll, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + TIMEOUT + 10)
    hung = [t for t in threads if t.is_alive()]
    assert not hung, f"{len(hung)} clients never finished"
    return lat, bad, polls


def test_load_through_proxy(tmp_path):
    model = h.write_llama(str(tmp_path / "llama.gguf"))
    reqs = _requests()
    with h.llama_server(model, str(tmp_path / "slots"), n_parallel=SLOTS) as srv:
        want = [_send(srv.url, p, b) for p, b in reqs]  # alone, straight to the server: the reference
        direct, bad, _ = _load(srv.url, reqs, want, None)
        assert not bad, bad[:5]
        bridge = LlamaBridge(srv.url, str(tmp_path / "slots"), model, store_dir=str(tmp_path / "store"),
                             build="load-test")
        bridge.start()
        try:
            with h.proxy(bridge) as (url, metrics):
                proxied, bad, polls = _load(url, reqs, want, url + "/metrics")
                text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        finally:
            bridge.close()
    assert not bad, bad[:5]
    assert len(proxied) >= CLIENTS and polls and max(polls) < 5
    assert "snapstore_llama_hits_total" in text and "llamacpp:prompt_tokens_total" in text
    hits = next(float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("snapstore_llama_hits_total "))
    d50, d99 = np.percentile(direct, [50, 99])
    p50, p99 = np.percentile(proxied, [50, 99])
    print(f"\n{CLIENTS} clients, {SLOTS} slots, {SECONDS:.0f} s: direct {len(direct)} requests p50 {d50 * 1e3:.1f} ms "
          f"p99 {d99 * 1e3:.1f} ms; proxy {len(proxied)} requests ({hits:.0f} restores) p50 {p50 * 1e3:.1f} ms "
          f"p99 {p99 * 1e3:.1f} ms; added p50 {(p50 - d50) * 1e3:+.1f} ms p99 {(p99 - d99) * 1e3:+.1f} ms; "
          f"/metrics max {max(polls) * 1e3:.0f} ms")
