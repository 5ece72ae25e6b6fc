"""llama-proxy in front of a server with four slots (issue 27 item 4), ``--kv-unified`` off and on, on
plain attention (llama) and a Mamba2 hybrid (granitehybrid, whose boundaries the proxy captures).

Four conversations run concurrently through the proxy, then the server restarts (a new process: no
slot holds anything) and every conversation's next turn arrives at once through a new proxy on the
same store. Each restore must land in the slot that then serves its request (four distinct slots in
the restore log, and the server reuses the restored prefix: ``cache_n``, which only that slot can
give on a fresh server), and every output must equal the same request sent alone to a fresh server with no
proxy — a conversation restored into another's slot would be read over foreign state.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import LlamaBridge, holding_candidates  # noqa: E402

pytestmark = pytest.mark.slow

SLOTS = 4
CHAT = "/v1/chat/completions"
_RESTORED = re.compile(r"^slot (\d+): restored (\d+) of (\d+) prompt tokens")


def _first_turns() -> list[list[dict[str, str]]]:
    """Four conversations: each its own system prompt (so none can reuse another's prefix)."""
    return [[{"role": "system", "content": h.text_of(150 + 10 * i, seed=70 + i)},
             {"role": "user", "content": h.text_of(8, seed=80 + i)}] for i in range(SLOTS)]


def _at_once(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send every body to ``url`` at the same time (a thread each, released together); the replies in order."""
    out: list[Any] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def one(i: int) -> None:
        start.wait(30)
        try:
            out[i] = h.post(url, CHAT, bodies[i])
        except Exception as e:  # reported below with the others
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    bad = [o for o in out if not isinstance(o, dict)]
    assert not bad, bad
    return out


def _proxied(model: str, tmp: Any, name: str, store: str, params: dict[str, Any],
             bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``bodies`` sent at once through a proxy over a fresh server; returns when their saves landed."""
    slots = str(tmp / name)
    with h.llama_server(model, slots, n_parallel=SLOTS, params=params) as srv:
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store, build="slots-test")
        bridge.start()
        try:
            with h.proxy(bridge) as (url, _metrics):
                return _at_once(url, bodies)
        finally:
            bridge.close()


WRITERS = {"llama": h.write_llama, "granitehybrid": h.write_granitehybrid}


@pytest.mark.parametrize("unified", [False, True], ids=["per-slot-kv", "kv-unified"])
@pytest.mark.parametrize("arch", list(WRITERS))
def test_concurrent_restores_land_in_the_slots_that_serve_them(tmp_path, arch, unified, caplog):
    caplog.set_level(logging.INFO, logger="snapstore.engine.llamacpp")
    model = WRITERS[arch](str(tmp_path / f"{arch}.gguf"))
    params = {"kv_unified": unified}
    store = str(tmp_path / "store")
    turns = _first_turns()
    first = _proxied(model, tmp_path, "a", store, params, [{"messages": m, "max_tokens": 6} for m in turns])
    seconds = [[*m, r["choices"][0]["message"], {"role": "user", "content": h.text_of(6, seed=90 + i)}]
               for i, (m, r) in enumerate(zip(turns, first, strict=True))]
    bodies = [{"messages": m, "max_tokens": 6} for m in seconds]

    with h.llama_server(model, str(tmp_path / "ref"), n_parallel=SLOTS, params=params) as ref:
        want = [ref.post(CHAT, b) for b in bodies]  # alone, one after another, no proxy: the reference
    caplog.clear()
    got = _proxied(model, tmp_path, "b", store, params, bodies)

    restores = [_RESTORED.match(r.getMessage()) for r in caplog.records]
    restored = {int(m.group(3)): (int(m.group(1)), int(m.group(2))) for m in restores if m}
    served = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"], i
        n = g["usage"]["prompt_tokens"]
        assert n in restored, (i, n, restored)  # every conversation was restored (lengths differ by design)
        slot, kept = restored[n]
        # a fresh server: only the slot restored for this conversation holds its tokens, so a reuse
        # this long proves the request was served there (any other slot shares none of its prompt)
        assert g["timings"]["cache_n"] >= kept - 1, (i, g["timings"], kept)
        served.append(slot)
    assert sorted(served) == list(range(SLOTS))  # four slots, one conversation each


def test_a_request_that_names_its_slot_gets_its_restore_there(tmp_path, caplog):
    """``id_slot`` in the request: the restore goes to that slot, not to one the proxy would pick."""
    caplog.set_level(logging.INFO, logger="snapstore.engine.llamacpp")
    model = h.write_llama(str(tmp_path / "llama.gguf"))
    store = str(tmp_path / "store")
    msgs = _first_turns()[0]
    _proxied(model, tmp_path, "a", store, {}, [{"messages": msgs, "max_tokens": 4}])
    caplog.clear()
    again = [*msgs[:1], {"role": "user", "content": "another question"}]
    got = _proxied(model, tmp_path, "b", store, {}, [{"messages": again, "max_tokens": 4, "id_slot": 3}])[0]
    slots = [int(m.group(1)) for r in caplog.records if (m := _RESTORED.match(r.getMessage()))]
    assert slots == [3]
    assert got["timings"]["cache_n"] > 100  # the shared system prompt, reused from slot 3 (nothing else holds it)


def test_the_slot_that_served_a_chat_is_found_among_later_longer_ones(tmp_path):
    """A chat reply names no slot: after it, two later requests with longer prompts ran in other
    slots. The save must still copy the slot that holds this prompt (its length, prompt and generated
    tokens, singles it out), not
    the latest tasks' slots — with four slots finishing together that lost saves."""
    model = h.write_llama(str(tmp_path / "llama.gguf"))
    slots = str(tmp_path / "slots")
    with h.llama_server(model, slots, n_parallel=SLOTS) as srv:
        bridge = LlamaBridge(srv.url, slots, model, store_dir=str(tmp_path / "store"), build="slots-test")
        try:
            prompts = [h.text_of(100 + 30 * i, seed=60 + i) for i in range(3)]
            sizes = []
            for i, p in enumerate(prompts):  # each in its own slot, the shortest first
                r = srv.post("/completion", {"prompt": p, "n_predict": 4, "id_slot": i})
                sizes.append(r["tokens_evaluated"])
            assert sizes[0] < sizes[1] < sizes[2]
            states = bridge.server.slot_states()
            assert holding_candidates(states, sizes[0])[0] == 0
            assert holding_candidates(states, sizes[1])[0] == 1
        finally:
            bridge.close()
