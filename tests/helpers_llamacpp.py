"""Tiny random-weight GGUF models (a llama and an LFM2 hybrid) and an in-process llama-server.

Written at test time with the ``gguf`` package and a small hand-made SPM vocabulary (256 byte
tokens + a few words): no downloads. The server is the real llama-server, run in process by
``xllamacpp`` on a free 127.0.0.1 port; ``LlamaServer`` stops it (and frees its port) on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

WORDS = ["hello", "world", "the", "a", "system", "user", "you", "are", "helpful", "assistant", "tool", "answer",
         "question", "cache", "prompt", "token", "state", "store", "snap", "chat", "model", "file"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _vocab() -> tuple[list[bytes], list[float], list[int]]:
    toks: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        toks.append(role.encode())
        types.append(4)  # USER_DEFINED: matched whole in text
    for b in range(256):
        toks.append(f"<0x{b:02X}>".encode())
        types.append(6)  # BYTE
    for w in WORDS:
        toks.append(("\u2581" + w).encode())
        types.append(1)
    scores = [0.0] * len(toks)
    for i in range(len(toks) - len(WORDS), len(toks)):
        scores[i] = -1.0
    return toks, scores, types


def _tokenizer(w: Any) -> int:
    toks, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return len(toks)


def _t(rng: np.random.Generator, *shape: int, scale: float = 0.2) -> np.ndarray:
    """A random f32 tensor; ``shape`` is numpy order (outermost first)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def write_llama(path: str, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                n_ff: int = 128, n_ctx: int = 8192, seed: int = 0) -> str:
    """A random-weight llama GGUF (f32 weights) at ``path``."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"tiny-llama-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(0)
    n_vocab = _tokenizer(w)
    hd = n_embd // n_head
    w.add_tensor("token_embd.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", _t(rng, n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", _t(rng, n_head_kv * hd, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", _t(rng, n_head_kv * hd, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", _t(rng, n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", _t(rng, n_embd, n_ff))
    _finish(w)
    return path


def write_lfm2(path: str, *, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
               l_cache: int = 3, layers: str = "rara", n_ctx: int = 8192, seed: int = 1) -> str:
    """A random-weight LFM2 hybrid GGUF: ``layers`` is r (short-conv, recurrent) / a (attention) per block."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "lfm2")
    w.add_name(f"tiny-lfm2-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(len(layers))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([n_head_kv if c == "a" else 0 for c in layers])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_uint32("lfm2.shortconv.l_cache", l_cache)
    w.add_file_type(0)
    n_vocab = _tokenizer(w)
    hd = n_embd // n_head
    w.add_tensor("token_embd.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    w.add_tensor("token_embd_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    for i, kind in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", _t(rng, n_embd, n_ff))
        if kind == "a":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(f"blk.{i}.attn_q.weight", _t(rng, n_embd, n_embd))
            w.add_tensor(f"blk.{i}.attn_k.weight", _t(rng, n_head_kv * hd, n_embd))
            w.add_tensor(f"blk.{i}.attn_v.weight", _t(rng, n_head_kv * hd, n_embd))
            w.add_tensor(f"blk.{i}.attn_output.weight", _t(rng, n_embd, n_embd))
        else:
            w.add_tensor(f"blk.{i}.shortconv.conv.weight", _t(rng, n_embd, l_cache))
            w.add_tensor(f"blk.{i}.shortconv.in_proj.weight", _t(rng, 3 * n_embd, n_embd))
            w.add_tensor(f"blk.{i}.shortconv.out_proj.weight", _t(rng, n_embd, n_embd))
    _finish(w)
    return path


def write_lora(path: str, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
               rank: int = 4, seed: int = 3) -> str:
    """A random LoRA adapter GGUF for ``write_llama``'s model: low-rank deltas on every layer's K and V."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    kv = n_head_kv * (n_embd // n_head)
    for i in range(n_layer):
        for t in ("attn_k", "attn_v"):
            w.add_tensor(f"blk.{i}.{t}.weight.lora_a", _t(rng, rank, n_embd))
            w.add_tensor(f"blk.{i}.{t}.weight.lora_b", _t(rng, kv, rank))
    _finish(w)
    return path


def _finish(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def text_of(n_words: int, seed: int = 0) -> str:
    """Deterministic text of known vocabulary words (about one token per word)."""
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n_words))


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """The real llama-server (xllamacpp, in process) on 127.0.0.1, with slot save/restore enabled."""

    def __init__(self, model: str, slot_dir: str, *, n_ctx: int = 8192, n_parallel: int = 1,
                 n_ubatch: int = 512, tweak: Callable[[Any], None] | None = None, port: int | None = None,
                 params: dict[str, Any] | None = None, loras: list[tuple[str, float]] | None = None) -> None:
        import xllamacpp as xlc

        p = xlc.CommonParams()
        p.model.path = model
        p.n_ctx = n_ctx * n_parallel
        p.n_parallel = n_parallel
        p.n_batch = 2048
        p.n_ubatch = n_ubatch
        p.cpuparams.n_threads = 1
        p.cpuparams_batch.n_threads = 1
        p.n_gpu_layers = 0
        p.warmup = False
        p.sampling.seed = 1
        p.sampling.temp = 0.0
        p.endpoint_slots = True
        p.endpoint_metrics = True
        p.slot_save_path = os.path.join(slot_dir, "")  # llama-server joins with no separator
        p.kv_unified = False
        p.cache_ram_mib = 0  # no host-RAM prompt cache: a restart really is a restart
        p.verbosity = -1
        adapters = []
        for path, scale in loras or []:  # LoRA adapters (--lora), each at its scale
            a = xlc.CommonAdapterLoraInfo()
            a.path, a.scale = path, scale
            adapters.append(a)
        p.lora_adapters = adapters
        for k, v in (params or {}).items():  # settings by name (JSON-able, so a ServerProcess takes them too)
            setattr(p, k, v)
        if tweak is not None:
            tweak(p)  # a test's own settings (flash attention, K/V types, ...)
        self.port = port or free_port()
        p.port = self.port
        p.hostnames = ["127.0.0.1"]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: Any = xlc.Server(p)
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError("llama-server did not become healthy")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON and return the decoded reply (raises on HTTP errors)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def close(self) -> None:
        """Stop the server (releases its port and threads)."""
        srv, self._server = self._server, None
        if srv is not None:
            del srv
            import gc
            gc.collect()


@contextlib.contextmanager
def llama_server(model: str, slot_dir: str, **kw: Any) -> Iterator[LlamaServer]:
    """A running llama-server, stopped on exit."""
    os.makedirs(slot_dir, exist_ok=True)
    s = LlamaServer(model, slot_dir, **kw)
    try:
        yield s
    finally:
        s.close()


class ServerProcess:
    """llama-server in its own process (a restart is a new process): ``python helpers_llamacpp.py``."""

    def __init__(self, model: str, slot_dir: str, **kw: Any) -> None:
        import subprocess
        import sys

        os.makedirs(slot_dir, exist_ok=True)
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = subprocess.Popen([sys.executable, os.path.join(here, "helpers_llamacpp.py"), model, slot_dir,
                                      json.dumps(kw)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("http://"):
            self.close()
            raise RuntimeError(f"llama-server process did not start: {line!r}")
        self.url = line.strip()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON and return the decoded reply (raises on HTTP errors)."""
        return post(self.url, path, body)

    def close(self) -> None:
        """Stop the process (closing its stdin ends it; killed if it lingers)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST JSON to ``url + path``; the decoded reply."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@contextlib.contextmanager
def server_process(model: str, slot_dir: str, **kw: Any) -> Iterator[ServerProcess]:
    """A llama-server process, stopped on exit."""
    s = ServerProcess(model, slot_dir, **kw)
    try:
        yield s
    finally:
        s.close()


@contextlib.contextmanager
def proxy(bridge: Any) -> Iterator[tuple[str, Any]]:
    """``snapstore llama-proxy``'s app for ``bridge`` on a free 127.0.0.1 port, in a thread; (url, metrics)."""
    import asyncio
    import threading

    from aiohttp import web

    from snapstore.llamacpp._metrics import BridgeMetrics
    from snapstore.llamacpp._proxy import make_app

    metrics = BridgeMetrics()
    bridge.events = metrics.events()
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(make_app(bridge, metrics), access_log=None, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()
        if hasattr(bridge, "settle"):
            bridge.settle()  # the background saves of every request answered


if __name__ == "__main__":  # the body of ServerProcess: serve until stdin closes
    import sys

    _srv = LlamaServer(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3]))
    print(_srv.url, flush=True)
    sys.stdin.read()
    _srv.close()
