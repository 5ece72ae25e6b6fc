"""llama-server slots through snapstore: import/export, identity, the proxy across a restart, dedup.

Real parts: llama-server (xllamacpp) in its own process on 127.0.0.1, tiny GGUFs written here,
the proxy's aiohttp app on a free loopback port; every server and proxy is stopped by the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("aiohttp")

import helpers_llamacpp as h  # noqa: E402

import snapstore as ss  # noqa: E402
from snapstore.engine.llamacpp._bridge import LlamaBridge  # noqa: E402
from snapstore.engine.llamacpp._slotstore import SlotStore, export_snapshot  # noqa: E402

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

BUILD = "test-build-1"
SYS = h.text_of(60, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {"llama": h.write_llama(str(d / "llama.gguf")), "lfm2": h.write_lfm2(str(d / "lfm2.gguf")),
            "llama2": h.write_llama(str(d / "llama2.gguf"), seed=7)}


def _chat(url, user, prev=(), system=SYS, **kw):
    msgs = [{"role": "system", "content": system}, *prev, {"role": "user", "content": user}]
    r = h.post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0, **kw})
    return r["choices"][0]["message"]["content"], r["timings"]["cache_n"], r["usage"]["prompt_tokens"]


def _save_slot(srv, tmp, name, prompt, n_predict=0):
    srv.post("/completion", {"prompt": prompt, "n_predict": n_predict, "cache_prompt": True, "id_slot": 0})
    srv.post("/slots/0?action=save", {"filename": name})
    with open(os.path.join(tmp, name), "rb") as f:
        return f.read()


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "snapstore", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=REPO_DIR)


def test_import_extends_as_delta_export_restores(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(models["llama"], slots) as srv:
        a = _save_slot(srv, slots, "a.bin", h.text_of(40, 1))
        b = _save_slot(srv, slots, "b.bin", h.text_of(40, 1) + " " + h.text_of(20, 2))
    ra = _cli("--dir", store, "import-slot", os.path.join(slots, "a.bin"), "--model", models["llama"],
              "--build", BUILD, "--json")
    assert ra.returncode == 0, ra.stderr
    rb = _cli("--dir", store, "import-slot", os.path.join(slots, "b.bin"), "--model", models["llama"],
              "--build", BUILD, "--json")
    da, db = json.loads(ra.stdout), json.loads(rb.stdout)
    assert db["parent_id"] == da["snapshot_id"]
    # the second file stores only its new rows: about (len(b)-len(a)) worth of K/V, not the whole file
    assert db["stored_bytes"] < 0.6 * len(b) and da["stored_bytes"] > 0.9 * (len(a) - 2000)
    out = tmp_path / "slots" / "back.bin"
    re = _cli("--dir", store, "export-slot", str(db["snapshot_id"]), str(out))
    assert re.returncode == 0, re.stderr
    assert out.read_bytes() == b  # byte-identical round trip through the store
    with h.server_process(models["llama"], slots) as srv2:
        r = srv2.post("/slots/0?action=restore", {"filename": "back.bin"})
        assert r["n_restored"] == db["n_tokens"]


def test_bad_files_refused_store_unchanged(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(models["llama"], slots) as srv:
        good = _save_slot(srv, slots, "g.bin", h.text_of(30, 3))
    other_shape = h.write_llama(str(tmp_path / "wide.gguf"), n_head_kv=4, seed=3)
    cases = {"truncated": good[: len(good) // 2], "flipped": bytearray(good)}
    cases["flipped"][20:24] = b"\xff\xff\xff\x7f"  # the token payload's count
    for name, blob in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(bytes(blob))
        r = _cli("--dir", store, "import-slot", str(p), "--model", models["llama"], "--build", BUILD)
        assert r.returncode == 2 and "error" in r.stderr, (name, r.stderr)
    p = tmp_path / "g.bin"
    p.write_bytes(good)
    r = _cli("--dir", store, "import-slot", str(p), "--model", other_shape, "--build", BUILD)
    assert r.returncode == 2 and "another model" in r.stderr, r.stderr
    if os.path.isdir(store):
        st = _cli("--dir", store, "stats", "--json")
        assert json.loads(st.stdout)["stats"]["entries"] == 0
    # no build named: stored, under a build no server reports, so a real build never matches it
    r = _cli("--dir", store, "import-slot", str(p), "--model", models["llama"], "--json")
    assert r.returncode == 0 and "--build" in r.stderr, r.stderr
    assert json.loads(r.stdout)["snapshot_id"] is not None
    real = SlotStore(store, models["llama"], BUILD, drop_stale=False)
    try:
        sf = real.decode(good)
        real.open_for(sf)
        assert real.match(sf.tokens.tolist()) is None
    finally:
        real.close()


def test_other_model_or_build_never_matched(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(models["llama"], slots) as srv:
        data = _save_slot(srv, slots, "x.bin", h.text_of(30, 4))
    a = SlotStore(store, models["llama"], BUILD)
    sf = a.decode(data)
    assert a.import_bytes(data).save.snapshot_id is not None
    a.close()
    for model, build in ((models["llama2"], BUILD), (models["llama"], "other-build")):
        other = SlotStore(store, model, build)
        other.open_for(sf)
        assert other.match(sf.tokens.tolist()) is None
        other.close()
    again = SlotStore(store, models["llama"], BUILD)
    again.open_for(sf)
    assert again.match(sf.tokens.tolist()).n_tokens == sf.n_tokens
    again.close()


def test_corrupt_stored_chunk_never_restored_into_a_slot(models, tmp_path):
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(models["llama"], slots) as srv:
        data = _save_slot(srv, slots, "x.bin", h.text_of(30, 4))
    a = SlotStore(store, models["llama"], BUILD)
    sid = a.import_bytes(data).save.snapshot_id
    a.close()
    blobs = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(store, "blobs")) for f in fs]
    big = max(blobs, key=os.path.getsize)
    raw = bytearray(open(big, "rb").read())
    raw[-10] ^= 0xFF
    os.chmod(big, 0o600)
    open(big, "wb").write(bytes(raw))
    with pytest.raises(ss.SnapstoreError):
        export_snapshot(store, sid)
    r = _cli("--dir", store, "export-slot", str(sid), str(tmp_path / "out.bin"))
    assert r.returncode == 2 and not (tmp_path / "out.bin").exists()


def _run_restart(models, tmp_path, kind):
    """Turn 1 through the proxy, restart everything, a new chat with the same system prompt."""
    model = models[kind]
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(model, slots) as s1:
        bridge = LlamaBridge(s1.url, slots, model, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            first = _chat(url, "hello world")
        bridge.close()
        s1.post("/slots/0?action=save", {"filename": "plain.bin"})  # llama-server's own persistence
    with h.server_process(model, slots) as ref:  # an uninterrupted run of the new chat: no store at all
        want = _chat(ref.url, "the cache question")
    with h.server_process(model, slots) as plain:  # llama-server alone: restore its own slot file
        plain.post("/slots/0?action=restore", {"filename": "plain.bin"})
        plain_reuse = _chat(plain.url, "the cache question")[1]
    with h.server_process(model, slots) as s2:  # a new process: everything comes from the store
        bridge = LlamaBridge(s2.url, slots, model, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, metrics):
            got = _chat(url, "the cache question")
            turn2 = _chat(url, "more", prev=[{"role": "user", "content": "the cache question"},
                                             {"role": "assistant", "content": got[0]}])
            text = urllib.request.urlopen(url + "/metrics").read().decode()
        bridge.close()
    return first, want, got, plain_reuse, turn2, text


@pytest.mark.parametrize("kind", ["llama", "lfm2"])
def test_restart_restores_system_prompt_byte_identical(models, tmp_path, kind):
    first, want, got, plain_reuse, turn2, metrics = _run_restart(models, tmp_path, kind)
    assert got[0] == want[0]  # greedy output byte-identical to an uninterrupted run
    assert want[1] == 0
    system_end = 446
    assert got[1] >= system_end  # cache_n: the restored system prompt (hybrid: + the exact capture)
    assert turn2[1] >= got[2] - 1  # the next turn continues from its conversation's snapshot
    assert "snapstore_llama_hits_total" in metrics and "snapstore_llama_restore_seconds_bucket" in metrics
    assert "snapstore_llama_tokens_served_total" in metrics
    print(f"{kind}: proxy reuse {got[1]} of {got[2]} prompt tokens; llama-server's own slot restore reused "
          f"{plain_reuse}")


def test_eight_conversations_share_one_root(models, tmp_path):
    """8 chats sharing a 2K-token system prompt: store bytes vs the 8 slot files side by side."""
    model = models["llama"]
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    system = h.text_of(300, seed=11)
    files = 0
    with h.server_process(model, slots) as srv:
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            for i in range(8):
                _chat(url, h.text_of(10, seed=100 + i), system=system)
                srv.post("/slots/0?action=save", {"filename": f"conv{i}.bin"})
                files += os.path.getsize(os.path.join(slots, f"conv{i}.bin"))
        st = bridge.slots.store.stats()
        snaps = bridge.slots.store.snapshots()
        bridge.close()
    roots = [s for s in snaps if s.parent_id is None and s.n_tokens > 1]
    assert len(roots) == 1 and roots[0].n_tokens > 2000
    print(f"8 slot files: {files} bytes; store: {st.stored_bytes} bytes ({files / st.stored_bytes:.1f}x less)")
    assert st.stored_bytes < files / 4  # one shared root + 8 small deltas


def test_save_skipped_when_over_budget_request_still_served(models, tmp_path):
    model = models["llama"]
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(model, slots) as srv:
        bridge = LlamaBridge(srv.url, slots, model, store_dir=store, build=BUILD,
                             budget=ss.Budget(disk_bytes=64 * 1024, reserve_bytes=0))
        bridge.start()
        with h.proxy(bridge) as (url, _):
            out = _chat(url, "hello")
            assert out[2] > 400
            # an upstream error passes through untouched
            with pytest.raises(urllib.error.HTTPError) as e:
                h.post(url, "/v1/chat/completions", {"messages": "not a list"})
            assert e.value.code >= 400
            for _ in range(200):  # the save runs after the response was sent: wait for its decision
                text = urllib.request.urlopen(url + "/metrics").read().decode()
                if 'snapstore_llama_skipped_saves_total{reason="' in text:
                    break
                time.sleep(0.05)
        st = bridge.slots.store.stats()
        bridge.close()
    assert st.stored_bytes <= 64 * 1024
    assert 'snapstore_llama_skipped_saves_total{reason="' in text
    assert np.isfinite(out[1])

