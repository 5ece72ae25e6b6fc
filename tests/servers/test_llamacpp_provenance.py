"""llama-proxy stores a slot only when it can prove what computed it (issue 47, items 1-3, 5, 7, 8, 11).

Real parts: llama-server (xllamacpp, in process or in its own process), the proxy's aiohttp app and a
real store. Where a wrong store is the defect, the test compares the K/V the store holds for a prompt
with the K/V a fresh server computes for it under the setting the identity stands for.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # real servers (tests/README.md: the slow tier)

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import BridgeEvents, LlamaBridge  # noqa: E402
from snapstore.engine.llamacpp._slotfile import decode  # noqa: E402

BUILD = "provenance-test"
SYS = h.text_of(60, seed=5)


def _messages(user: str = "hello world", system: str = SYS) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _k_of(data: bytes, shape: Any) -> np.ndarray:
    sf = decode(data, shape)
    return np.concatenate([np.frombuffer(ly.k, np.float16).astype(np.float32) for ly in sf.kv])


def _reference_k(model: str, slot_dir: str, tokens: list[int], **kw: Any) -> bytes:
    """The slot file a fresh llama-server (no proxy, no store) writes for exactly ``tokens``."""
    with h.llama_server(model, slot_dir, **kw) as ref:
        ref.post("/completion", {"prompt": tokens, "n_predict": 0, "id_slot": 0, "cache_prompt": True})
        ref.post("/slots/0?action=save", {"filename": "ref.bin"})
        with open(os.path.join(slot_dir, "ref.bin"), "rb") as f:
            return f.read()


def _stored_k(bridge: LlamaBridge, tokens: list[int]) -> tuple[int, bytes] | None:
    """(tokens, slot file) of the longest stored prefix of ``tokens`` under the current identity."""
    m = bridge.slots.match(tokens)
    if m is None:
        return None
    return m.n_tokens, bridge.slots.export_bytes(m)


def _bridge(url: str, slots: str, model: str, store: str) -> tuple[LlamaBridge, list[str]]:
    skipped: list[str] = []
    b = LlamaBridge(url, slots, model, store_dir=store, build=BUILD)
    b.start()
    return b, skipped


def _skips(metrics: Any) -> dict[str, float]:
    text = metrics.render()[0].decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("snapstore_llama_skipped_saves_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _same_k(got: bytes, want: bytes, shape: Any) -> bool:
    a, b = _k_of(got, shape), _k_of(want, shape)
    return a.shape == b.shape and bool(np.allclose(a, b, atol=2e-2, rtol=2e-2))


@pytest.fixture(scope="module")
def models(tmp_path_factory: Any) -> dict[str, str]:
    d = tmp_path_factory.mktemp("models")
    return {"llama": h.write_llama(str(d / "llama.gguf")), "lora": h.write_lora(str(d / "lora.gguf"))}


def test_a_lora_requests_slot_is_never_stored_as_the_base_models(models: dict[str, str], tmp_path: Path) -> None:
    """Item 1: the same chat with a per-request ``lora`` (declined) and without; the LoRA one generates
    fewer tokens (its slot is "nearer") and llama-server serves the base one from the LoRA slot's
    cache (a request without ``lora`` keeps a slot's cache whatever adapters computed it). Whatever
    the store holds for the base request's prompt is the base model's K/V; the declined store is
    counted."""
    from snapstore.engine.llamacpp._identify import model_info

    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    shape = model_info(models["llama"]).shape
    body = {"messages": _messages(), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with h.llama_server(models["llama"], slots, n_parallel=2, loras=[(models["lora"], 0.0)]) as srv:
        bridge, _ = _bridge(srv.url, slots, models["llama"], store)
        tokens = bridge.prompt_of("/v1/chat/completions", body)[0]
        with h.proxy(bridge) as (url, metrics):
            lora_body = {**body, "max_tokens": 1, "lora": [{"id": 0, "scale": 1.0}]}
            h.post(url, "/v1/chat/completions", lora_body)
            h.post(url, "/v1/chat/completions", body)
            bridge.settle()
            skips = _skips(metrics)
            stored = _stored_k(bridge, tokens)
        bridge.close()
    assert skips.get("request_lora", 0) >= 1
    if stored is not None:
        n, data = stored
        want = _reference_k(models["llama"], str(tmp_path / "ref"), tokens[:n], loras=[(models["lora"], 0.0)])
        assert _same_k(data, want, shape), "the store holds K/V computed with the request's LoRA"
    else:
        assert set(skips) & {"slot_unknown", "slot_unproven", "slot_lora"}, skips


def test_lora_entries_are_read_as_llama_server_reads_them(models: dict[str, str], tmp_path: Path) -> None:
    """Item 2: ``{"id": 0}`` without a scale is scale 0.0 to llama-server (the base model), not 1.0;
    a scale that is not a number is declined, not guessed."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    prompt = h.text_of(80, seed=21)
    with h.llama_server(models["llama"], slots, loras=[(models["lora"], 1.0)]) as srv:
        bridge, _ = _bridge(srv.url, slots, models["llama"], store)
        tokens = bridge.prompt_of("/completion", {"prompt": prompt})[0]
        with h.proxy(bridge) as (url, metrics):
            h.post(url, "/completion", {"prompt": prompt, "n_predict": 2, "lora": [{"id": 0}]})
            bridge.settle()
            h.post(url, "/completion", {"prompt": prompt + " the", "n_predict": 2, "lora": [{"id": 0, "scale": "1"}]})
            bridge.settle()
            skips = _skips(metrics)
            held = bridge.slots.holds(tokens)
        bridge.close()
    assert not held, "base-model K/V stored as adapter 0 at scale 1.0"
    assert skips.get("request_lora", 0) == 1 and skips.get("request_lora_unread", 0) == 1, skips


def test_an_adapter_scale_change_stores_no_slot_filled_before_it(models: dict[str, str], tmp_path: Path) -> None:
    """Item 3: ``POST /lora-adapters`` changes the scale; the next request for the same chat must not be
    stored from a slot computed at the old scale: what the store holds under the new identity is the
    K/V a fresh server computes at the new scale."""
    from snapstore.engine.llamacpp._identify import model_info

    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    shape = model_info(models["llama"]).shape
    body = {"messages": _messages(), "max_tokens": 4, "temperature": 0}
    with h.llama_server(models["llama"], slots, n_parallel=2, loras=[(models["lora"], 1.0)]) as srv:
        bridge, _ = _bridge(srv.url, slots, models["llama"], store)
        tokens = bridge.prompt_of("/v1/chat/completions", body)[0]
        with h.proxy(bridge) as (url, _metrics):
            h.post(url, "/v1/chat/completions", body)
            bridge.settle()
            assert bridge.slots.holds(tokens)  # stored at scale 1.0
            h.post(url, "/lora-adapters", [{"id": 0, "scale": 0.5}])  # type: ignore[arg-type]
            h.post(url, "/v1/chat/completions", body)
            bridge.settle()
            stored = _stored_k(bridge, tokens)
        bridge.close()
    if stored is not None:
        n, data = stored
        want = _reference_k(models["llama"], str(tmp_path / "ref"), tokens[:n], loras=[(models["lora"], 0.5)])
        assert _same_k(data, want, shape), "K/V computed at the old scale stored under the new identity"


def _stored_once(model: str, tmp_path: Any, store: str, body: dict[str, Any], n_parallel: int = 1) -> None:
    """Store ``body``'s prompt through a proxy in front of a server of its own (then both stop)."""
    slots = str(tmp_path / "slots-first")
    with h.llama_server(model, slots, n_parallel=n_parallel) as srv:
        bridge, _ = _bridge(srv.url, slots, model, store)
        with h.proxy(bridge) as (url, _metrics):
            h.post(url, "/completion", body)
        bridge.close()


def test_a_restore_gives_up_when_its_slot_is_taken_meanwhile(models: dict[str, str], tmp_path: Path) -> None:
    """Item 5: llama-server gives the slot the proxy chose to another request while the snapshot is
    read; the proxied request must not wait for that request's whole generation."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    prompt = h.text_of(200, seed=31)
    _stored_once(models["llama"], tmp_path, store, {"prompt": prompt, "n_predict": 2}, n_parallel=2)
    with h.llama_server(models["llama"], slots, n_parallel=2) as srv:
        bridge, _ = _bridge(srv.url, slots, models["llama"], store)
        with h.proxy(bridge) as (url, metrics):
            long_done = threading.Event()
            original = bridge.slots.export_bytes

            def other(slot: int) -> None:
                try:
                    srv.post("/completion", {"prompt": "hello", "n_predict": 6000, "ignore_eos": True,
                                             "id_slot": slot, "cache_prompt": False})
                finally:
                    long_done.set()

            def taken_meanwhile(*a: Any, **kw: Any) -> bytes:
                slot = next(iter(bridge._reserved))
                threading.Thread(target=other, args=(slot,), daemon=True).start()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # until the server runs the other request in that slot
                    if slot not in bridge.server.idle_slots():
                        break
                    time.sleep(0.005)
                return original(*a, **kw)

            bridge.slots.export_bytes = taken_meanwhile  # type: ignore[method-assign]
            t0 = time.monotonic()
            h.post(url, "/completion", {"prompt": prompt + " the", "n_predict": 2})
            waited = time.monotonic() - t0
            still_running = not long_done.is_set()
            bridge.slots.export_bytes = original  # type: ignore[method-assign]
            long_done.wait(120)
            skips = _skips(metrics)
        bridge.close()
    assert still_running, f"the proxied request waited {waited:.2f} s, until the other request's generation ended"
    assert skips.get("restore_slot_taken", 0) == 1, skips


def test_a_server_restarted_with_more_slots_stores_every_conversation(models: dict[str, str], tmp_path: Path) -> None:
    """Item 7: ``-np 1`` then ``-np 4`` on the same port: the per-slot bookkeeping follows the server's
    ``total_slots``; four conversations at once are all stored (no IndexError in after())."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    port = h.free_port()
    srv = h.ServerProcess(models["llama"], slots, port=port, n_parallel=1)
    try:
        bridge, _ = _bridge(srv.url, slots, models["llama"], store)
        with h.proxy(bridge) as (url, _metrics):
            h.post(url, "/v1/chat/completions", {"messages": _messages(), "max_tokens": 2})
            bridge.settle()
            srv.close()
            srv = h.ServerProcess(models["llama"], slots, port=port, n_parallel=4)
            bodies = [{"messages": _messages(f"question {i}", system=h.text_of(40 + 15 * i, seed=40 + i)),
                       "max_tokens": 3} for i in range(4)]
            errors: list[BaseException] = []

            def chat(b: dict[str, Any]) -> None:
                try:
                    h.post(url, "/v1/chat/completions", b)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=chat, args=(b,)) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            bridge.settle()
            stored = [bridge.slots.holds(bridge.prompt_of("/v1/chat/completions", b)[0]) for b in bodies]
        assert bridge.n_slots == 4
        bridge.close()
    finally:
        srv.close()
    assert not errors
    assert all(stored), stored


def test_id_slot_minus_one_means_any_idle_slot(models: dict[str, str], tmp_path: Path) -> None:
    """Item 8: ``id_slot: -1`` is llama-server's "any idle slot", not a slot out of range: the stored
    prefix is restored for it (after a restart) as for a request without the field."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    prompt = h.text_of(200, seed=51)
    _stored_once(models["llama"], tmp_path, store, {"prompt": prompt, "n_predict": 2})
    with h.llama_server(models["llama"], slots) as srv:
        n = len(h.post(srv.url, "/tokenize", {"content": prompt, "add_special": True})["tokens"])
        bridge, _ = _bridge(srv.url, slots, models["llama"], store)
        with h.proxy(bridge) as (url, _metrics):
            again = h.post(url, "/completion", {"prompt": prompt + " the", "n_predict": 2, "id_slot": -1})
        bridge.close()
    assert again["timings"]["cache_n"] >= n - 1


def test_a_server_without_slots_is_fronted_untouched(models: dict[str, str], tmp_path: Path) -> None:
    """Item 11: llama-server started with ``--no-slots`` (as llama.cpp's own test harness starts it):
    the proxy starts, says what it cannot do, and passes every request through as the server answers."""
    from snapstore.engine.llamacpp.cli import listen_line

    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    prompt = h.text_of(50, seed=61)
    with h.llama_server(models["llama"], slots, params={"endpoint_slots": False}) as srv:
        direct = srv.post("/completion", {"prompt": prompt, "n_predict": 4, "cache_prompt": False})
        bridge = LlamaBridge(srv.url, slots, models["llama"], store_dir=store, build=BUILD,
                             events=BridgeEvents())
        bridge.start()  # on the old code: UpstreamError, HTTP 501 from /slots (the CLI exits 2)
        line = listen_line(bridge, "127.0.0.1", 1, store)
        with h.proxy(bridge) as (url, _metrics):
            got = h.post(url, "/completion", {"prompt": prompt, "n_predict": 4, "cache_prompt": False})
            try:
                urllib.request.urlopen(url + "/slots")
                status = 200
            except urllib.error.HTTPError as e:
                status = e.code
                json.loads(e.read())  # the server's own error body
        bridge.close()
    assert bridge.passthrough is not None and "--no-slots" in bridge.passthrough
    assert "not persisting: no_slots" in line
    assert got["content"] == direct["content"]
    assert status == 501
