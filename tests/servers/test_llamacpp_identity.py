"""The llama.cpp identity covers what the server serves now: its model, build, runtime settings.

Real parts: llama-server (xllamacpp) in its own process, restarted on the same port with another
model or setting behind a running proxy (the proxy's aiohttp app, a real store); the CLI as a
subprocess for its start-up line and errors. Each case compares the proxy's greedy output with
the store-less output of the server it fronts now.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp._bridge import LlamaBridge  # noqa: E402
from snapstore.engine.llamacpp._identify import model_info  # noqa: E402

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

BUILD = "test-build-1"
SYS = h.text_of(60, seed=5)
SYSTEM_END = 446  # tokens of SYS as the chat template renders it
ROPE = {"rope_freq_base": 50000.0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {"a": h.write_llama(str(d / "a.gguf")), "b": h.write_llama(str(d / "b.gguf"), seed=7)}


def _chat(url, user, system=SYS):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    r = h.post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    return r["choices"][0]["message"]["content"], r["timings"]["cache_n"]


def _metric(url, name):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _saved(url, n):
    """Wait until the proxy has saved ``n`` snapshots (saves run after the response is sent)."""
    for _ in range(400):
        if _metric(url, "snapstore_llama_saves_total") >= n:
            return
        time.sleep(0.025)
    raise AssertionError("the proxy did not save")


def _reference(model, slots, user, **kw):
    with h.server_process(model, slots, **kw) as ref:  # the server alone, no store: what it computes itself
        return _chat(ref.url, user)


@pytest.mark.parametrize("where", ["other_path", "same_path"])
def test_model_swap_behind_the_proxy_never_restores_foreign_state(models, tmp_path, where):
    """Upstream restarted on the same port with model B (another file, or the same file rewritten):
    the proxy notices before its next restore and restores nothing of model A into B."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    path_a = str(tmp_path / "served.gguf")
    shutil.copyfile(models["a"], path_a)
    want = _reference(models["b"], slots, "the cache question")
    port = h.free_port()
    srv = h.ServerProcess(path_a, slots, port=port)
    try:
        bridge = LlamaBridge(srv.url, slots, path_a, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            _chat(url, "hello world")
            _chat(url, "hello world", system=h.text_of(50, seed=9))  # the slot now holds another prompt
            _saved(url, 4)  # model A's system prompts and conversations
            srv.close()
            if where == "same_path":  # a re-quantized checkpoint written over the served file
                shutil.copyfile(models["b"], path_a)
                path_b = path_a
            else:
                path_b = models["b"]
            srv = h.ServerProcess(path_b, slots, port=port)
            hits = _metric(url, "snapstore_llama_hits_total")
            got = _chat(url, "the cache question")
            assert got == want  # B's greedy output, as B alone computes it; its whole prompt read (cache_n 0)
            assert _metric(url, "snapstore_llama_hits_total") == hits  # nothing of A restored
            _saved(url, 6)  # B's own boundaries are stored under B's identity
            again = _chat(url, "the cache question")
        assert bridge.slots.model.sha256 == model_info(models["b"]).sha256
        bridge.close()
    finally:
        srv.close()
    assert again[0] == want[0] and again[1] >= SYSTEM_END  # B's own state restores under B's identity


def test_a_model_it_cannot_read_is_refused_not_guessed(models, tmp_path):
    """Upstream restarted with a model file the proxy cannot read (gone after loading): nothing is
    restored or saved, and each declined request is counted."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    gone = str(tmp_path / "gone.gguf")
    shutil.copyfile(models["b"], gone)
    want = _reference(models["b"], slots, "the cache question")
    port = h.free_port()
    srv = h.ServerProcess(models["a"], slots, port=port)
    try:
        bridge = LlamaBridge(srv.url, slots, models["a"], store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            _chat(url, "hello world")
            _chat(url, "hello world", system=h.text_of(50, seed=9))
            _saved(url, 4)
            srv.close()
            srv = h.ServerProcess(gone, slots, port=port)
            os.unlink(gone)  # the server keeps it mapped; the proxy cannot hash it
            got = _chat(url, "the cache question")
            refused = _metric(url, 'snapstore_llama_skipped_saves_total{reason="model_unseen"}')
            hits = _metric(url, "snapstore_llama_hits_total")
        reason = getattr(bridge, "refusal_reason", None)
        bridge.close()
    finally:
        srv.close()
    assert got == want and hits == 0  # B's own output: nothing of A restored into it
    assert reason == "model_unseen" and refused == 1  # refused, and counted


def test_runtime_setting_is_part_of_the_identity(models, tmp_path):
    """The same GGUF served with another --rope-freq-base (not reported by /props): a miss, both for
    a new proxy and for a running one whose upstream restarts; the same settings again: a hit."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    model = models["a"]
    want_rope = _reference(model, slots, "the cache question", params=ROPE)
    want_plain = _reference(model, slots, "the cache question")
    assert want_rope[0] != want_plain[0]  # the setting does change the numbers
    port = h.free_port()
    with h.server_process(model, slots, port=port) as srv:  # default RoPE: its state is stored
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            _chat(url, "hello world")
            _saved(url, 2)
        plain_key = bridge.slots.store.identity.key
        bridge.close()
    srv = h.ServerProcess(model, slots, port=port, params=ROPE)
    try:
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store, build=BUILD, keep_stale=True)
        bridge.start()  # a new proxy in front of the other setting
        assert bridge.slots.store.identity.key != plain_key
        with h.proxy(bridge) as (url, _):
            got_rope = _chat(url, "the cache question")
            srv.close()
            srv = h.ServerProcess(model, slots, port=port)  # back to the default setting, proxy running
            got_plain = _chat(url, "the cache question")
        assert bridge.slots.store.identity.key == plain_key  # the probe is stable across processes
        bridge.close()
    finally:
        srv.close()
    assert got_rope == want_rope  # no restore: the whole prompt read, RoPE 50000's own output
    assert got_plain[0] == want_plain[0] and got_plain[1] >= SYSTEM_END  # restored from the first run's store


def test_lora_scale_change_and_request_lora_are_not_served_foreign_state(models, tmp_path):
    """A LoRA adapter's scale changed at run time (POST /lora-adapters, no restart): a miss and the
    base model's output; a request with its own adapter scales: declined (nothing restored or saved)."""
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    lora = h.write_lora(str(tmp_path / "lora.gguf"))
    want = _reference(models["a"], slots, "the cache question")  # scale 0: the base model's numbers
    with h.server_process(models["a"], slots, loras=[(lora, 1.0)]) as srv:
        bridge = LlamaBridge(srv.url, slots, models["a"], store_dir=store, build=BUILD, keep_stale=True)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            _chat(url, "hello world")
            _chat(url, "hello world", system=h.text_of(50, seed=9))
            _saved(url, 4)  # state computed with the adapter at scale 1
            srv.post("/lora-adapters", [{"id": 0, "scale": 0.0}])  # type: ignore[arg-type]
            hits = _metric(url, "snapstore_llama_hits_total")
            got = _chat(url, "the cache question")
            assert got == want and _metric(url, "snapstore_llama_hits_total") == hits
            _saved(url, 6)
            msgs = [{"role": "system", "content": SYS}, {"role": "user", "content": "the cache question"}]
            r = h.post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0,
                                                     "lora": [{"id": 0, "scale": 1.0}]})
            assert _metric(url, 'snapstore_llama_skipped_saves_total{reason="request_lora"}') == 1
            assert _metric(url, "snapstore_llama_hits_total") == hits and r["timings"]["cache_n"] < SYSTEM_END
        bridge.close()


def test_the_start_up_probe_leaves_the_slot_as_it_was(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    prompt = h.text_of(40, 2)
    with h.server_process(models["a"], slots) as srv:
        first = srv.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
        bridge = LlamaBridge(srv.url, slots, models["a"], store_dir=store, build=BUILD)
        bridge.start()  # the K/V probe runs in slot 0, then puts its content back
        bridge.close()
        again = srv.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1  # all but the token it must re-read


def test_a_background_save_planned_under_an_older_identity_is_refused(models, tmp_path):
    """The slot is copied out under the request's identity, the identity moves on before the
    background store runs: the save is refused (identity_changed), nothing stored under the new one."""
    from snapstore.engine.llamacpp._bridge import BridgeEvents

    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(models["a"], slots) as srv:
        skipped: list[str] = []
        bridge = LlamaBridge(srv.url, slots, models["a"], store_dir=store, build=BUILD,
                             events=BridgeEvents(on_skip=skipped.append))
        bridge.start()
        try:
            plan = bridge.before("/completion", {"prompt": h.text_of(40, 3), "n_predict": 0})
            assert plan is not None and plan.generation == bridge.slots.generation
            reply = srv.post("/completion", plan.body)
            bridge.slots.switch(bridge.slots.model, "build-next", bridge.slots.runtime)  # the identity moves on
            plan.cache_n = reply["timings"]["cache_n"]  # what the proxy reads of the response (its proof)
            bridge.after(plan, True, reply.get("id_slot"))
            bridge.release(plan)
            bridge.settle()
            assert "identity_changed" in skipped
            assert bridge.slots.store is None  # nothing was stored (the new identity's store never opened)
        finally:
            bridge.close()


def test_keep_stale_keeps_a_rebuilt_engines_snapshots(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    model = models["a"]
    with h.server_process(model, slots) as srv:
        old = LlamaBridge(srv.url, slots, model, store_dir=store, build="build-old")
        old.start()
        with h.proxy(old) as (url, _):
            _chat(url, "hello world")
            _saved(url, 2)
        n_old = len(old.slots.store.snapshots())
        old.close()
        kept = LlamaBridge(srv.url, slots, model, store_dir=store, build="build-new", keep_stale=True)
        kept.start()
        kept.close()
        again = LlamaBridge(srv.url, slots, model, store_dir=store, build="build-old", keep_stale=True)
        again.start()
        assert len(again.slots.store.snapshots()) == n_old > 0  # --keep-stale: the old build's snapshots stay
        again.close()
        dropped = LlamaBridge(srv.url, slots, model, store_dir=store, build="build-new")
        dropped.start()
        dropped.close()
        after = LlamaBridge(srv.url, slots, model, store_dir=store, build="build-old", keep_stale=True)
        after.start()
        assert after.slots.store.snapshots() == []  # the default: a rebuilt engine's snapshots go at start
        after.close()


def test_import_slot_takes_the_servers_identity_only_with_upstream(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    model = models["a"]
    prompt = h.text_of(40, 1)
    with h.server_process(model, slots) as srv:
        srv.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
        srv.post("/slots/0?action=save", {"filename": "x.bin"})
        f = os.path.join(slots, "x.bin")
        blind = _cli("--dir", store, "import-slot", f, "--model", model, "--build", BUILD, "--json")
        assert blind.returncode == 0 and "--upstream" in blind.stderr, blind.stderr
        seen = _cli("--dir", store, "import-slot", f, "--model", model, "--upstream", srv.url, "--json",
                    SNAPSTORE_LLAMA_BUILD=BUILD)
        assert seen.returncode == 0, seen.stderr
        other = _cli("--dir", store, "import-slot", f, "--model", models["b"], "--upstream", srv.url)
        assert other.returncode == 2 and "not --model" in other.stderr, other.stderr
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store, build=BUILD, keep_stale=True)
        bridge.start()
        tokens = [int(t) for t in srv.post("/tokenize", {"content": prompt, "add_special": True})["tokens"]]
        m = bridge.slots.match(tokens)
        bridge.close()
    assert m is not None and m.snapshot_id == json.loads(seen.stdout)["snapshot_id"]
    assert json.loads(blind.stdout)["snapshot_id"] != m.snapshot_id


def test_request_inputs_the_identity_cannot_key_are_declined():
    from snapstore.engine.llamacpp._served import Served, request_unkeyable

    served = Served(model_path="m.gguf", build="b", n_slots=1, loras=({"id": 0, "path": "l.gguf", "scale": 1.0},),
                    signature="s")
    assert request_unkeyable({"prompt": "x"}, served) is None
    assert request_unkeyable({"prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}, served) is None
    assert request_unkeyable({"prompt": "x", "lora": [{"id": 0, "scale": 0.5}]}, served) == "request_lora"
    # llama-server reads an empty list as "the server's own adapters" (params.lora empty: params_base)
    assert request_unkeyable({"prompt": "x", "lora": []}, served) is None
    assert request_unkeyable({"prompt": "x", "lora": "junk"}, served) == "request_lora_unread"
    assert request_unkeyable({"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}, served) == \
        "request_media"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    assert request_unkeyable({"messages": msgs}, served) == "request_media"
    assert request_unkeyable({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                             served) is None


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "snapstore", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=REPO_DIR)


def test_unreachable_upstream_names_the_url_and_what_was_asked(models, tmp_path):
    url = f"http://127.0.0.1:{h.free_port()}"
    r = _cli("--dir", str(tmp_path / "store"), "llama-proxy", "--upstream", url, "--slot-save-path",
             str(tmp_path), "--model", models["a"], "--build", BUILD)
    assert r.returncode == 2
    assert f"cannot reach llama-server at {url} (GET /props (the model, build and settings it serves))" in r.stderr
    assert "connection refused" in r.stderr and "urlopen" not in r.stderr, r.stderr


def test_start_line_and_unknown_build_warning(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    port = h.free_port()
    env = {k: v for k, v in os.environ.items() if k != "SNAPSTORE_LLAMA_BUILD"}
    with h.server_process(models["a"], slots) as srv:
        p = subprocess.Popen([sys.executable, "-m", "snapstore", "--dir", store, "llama-proxy", "--upstream", srv.url,
                              "--slot-save-path", slots, "--listen", f"127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert p.stdout is not None
            line = p.stdout.readline()  # printed once the port is bound
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as r:
                health = r.status
        finally:
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
    assert health == 200
    assert line.startswith(f"snapstore llama-proxy: listening on http://127.0.0.1:{port}, upstream {srv.url}, "
                           f"store {store}, identity id-"), line
    assert "model a.gguf sha256:" in line and "build b0-unknown" in line, line
    assert "build_info 'b0-unknown'" in err and "--build" in err, err  # the warning, at start-up
