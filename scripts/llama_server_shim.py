"""A ``llama-server`` command line over xllamacpp, alone or behind ``snapstore llama-proxy``.

Runs llama.cpp's own server test suite (``tools/server/tests``, from the llama.cpp inside the
xllamacpp sdist) against the real llama-server that xllamacpp bundles, once directly and once
through the proxy (docs/benchmarks.md, "llama.cpp's server tests through llama-proxy"):

    # LS: an executable sh wrapper, `exec REPO/.venv/bin/python REPO/scripts/llama_server_shim.py "$@"`
    # with PYTHONPATH=REPO (the suite runs LLAMA_SERVER_BIN_PATH with llama-server's options)
    cd tools/server/tests && LLAMA_SERVER_BIN_PATH=LS SHIM_MODE=direct|proxy SHIM_MODEL=tiny.gguf \\
        PYTHONPATH=<openai 2.14, wget, filelock> python -m pytest --basetemp=... unit

It takes the options the suite's ``utils.py`` passes (others are ignored) and serves the tiny GGUF
``$SHIM_MODEL`` in place of every model the suite would download (no network here). In proxy mode
llama-server listens on a free port with ``--slots`` and a slot directory of its own (the proxy
needs both) and the proxy listens where the test expects the server, with the test's API key.
Not part of the test tiers: the suite needs its own packages (openai, wget, filelock).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import tempfile
import threading
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    for name in ("--port", "--host", "--temp", "--seed", "--model", "--model-url", "--hf-repo", "--hf-file",
                 "--batch-size", "--ubatch-size", "--threads", "--n-gpu-layers", "--pooling", "--alias", "--ctx-size",
                 "--parallel", "-ctk", "-ctv", "-fa", "--n-predict", "--slot-save-path", "--grp-attn-n",
                 "--grp-attn-w", "--api-key", "--reasoning-format", "--reasoning", "--chat-template",
                 "--chat-template-file", "--cache-ram", "--sleep-idle-seconds", "--media-path", "--tags"):
        p.add_argument(name)
    p.add_argument("--lora", action="append", default=[])
    for flag in ("--offline", "--cont-batching", "--embedding", "--reranking", "--metrics", "--kv-unified",
                 "--swa-full", "--slots", "--no-slots", "--context-shift", "--no-ui", "--jinja", "--no-jinja",
                 "--no-cache-idle-slots", "--verbose"):
        p.add_argument(flag, action="store_true")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def params(a: argparse.Namespace, model: str, port: int) -> Any:
    """CommonParams for the parsed options (the defaults llama-server's own parser would leave)."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = a.model if a.model and os.path.isfile(a.model) else model
    p.port, p.hostnames = port, [h.strip() for h in (a.host or "127.0.0.1").split(",")]
    p.n_gpu_layers, p.warmup, p.verbosity = 0, False, -1
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(a.threads or 2)
    if a.temp is not None:
        p.sampling.temp = float(a.temp)
    if a.seed is not None:
        p.sampling.seed = int(a.seed)
    for opt, field in (("batch_size", "n_batch"), ("ubatch_size", "n_ubatch"), ("ctx_size", "n_ctx"),
                       ("parallel", "n_parallel"), ("n_predict", "n_predict"), ("grp_attn_n", "grp_attn_n"),
                       ("grp_attn_w", "grp_attn_w"), ("cache_ram", "cache_ram_mib"),
                       ("sleep_idle_seconds", "sleep_idle_seconds")):
        if getattr(a, opt) is not None:
            setattr(p, field, int(getattr(a, opt)))
    if a.alias:
        p.model_alias = {a.alias}
    p.cont_batching = True
    p.embedding = bool(a.embedding or a.reranking)
    if a.reranking:
        p.pooling_type = xlc.llama_pooling_type.LLAMA_POOLING_TYPE_RANK
    elif a.pooling:
        p.pooling_type = getattr(xlc.llama_pooling_type, f"LLAMA_POOLING_TYPE_{a.pooling.upper()}")
    p.endpoint_metrics = bool(a.metrics)
    p.endpoint_slots = not a.no_slots
    p.kv_unified, p.swa_full, p.ctx_shift = bool(a.kv_unified), bool(a.swa_full), bool(a.context_shift)
    for opt, field in (("ctk", "cache_type_k"), ("ctv", "cache_type_v")):
        if getattr(a, opt):
            setattr(p, field, getattr(xlc.ggml_type, f"GGML_TYPE_{getattr(a, opt).upper()}"))
    if a.fa:
        p.flash_attn_type = {"on": xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                             "off": xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED}.get(
            a.fa, xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_AUTO)
    if a.slot_save_path:
        p.slot_save_path = os.path.join(a.slot_save_path, "")
    if a.api_key:
        p.api_keys = [a.api_key]
    p.ui = not a.no_ui
    p.use_jinja = not a.no_jinja
    if a.reasoning_format:
        p.reasoning_format = getattr(xlc.common_reasoning_format,
                                     f"COMMON_REASONING_FORMAT_{a.reasoning_format.upper()}")
    if a.chat_template_file:
        with open(a.chat_template_file, encoding="utf-8") as f:
            p.chat_template = f.read()
    elif a.chat_template:
        p.chat_template = a.chat_template
    if a.no_cache_idle_slots:
        p.cache_idle_slots = False
    if a.media_path:
        p.media_path = a.media_path
    adapters = []
    for path in a.lora:
        ad = xlc.CommonAdapterLoraInfo()
        ad.path, ad.scale = path, 1.0
        adapters.append(ad)
    p.lora_adapters = adapters
    return p


def main() -> None:
    import xllamacpp as xlc

    a, _ = _parser().parse_known_args()
    model = os.environ["SHIM_MODEL"]
    port = int(a.port or 8080)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if os.environ.get("SHIM_MODE", "direct") == "direct":
        srv = xlc.Server(params(a, model, port))
        stop.wait()
        del srv
        os._exit(0)
    # proxy mode: the server where only the proxy talks to it, with what the proxy needs
    from snapstore.engine.llamacpp._bridge import LlamaBridge
    from snapstore.engine.llamacpp._proxy import run_proxy

    work = tempfile.mkdtemp(prefix="shim-")
    if not a.slot_save_path:
        a.slot_save_path = os.path.join(work, "slots")
        os.makedirs(a.slot_save_path)
    a.no_slots = False
    inner = _free_port()
    p = params(a, model, inner)
    p.hostnames = ["127.0.0.1"]
    srv = xlc.Server(p)
    bridge = LlamaBridge(f"http://127.0.0.1:{inner}", a.slot_save_path, None, store_dir=os.path.join(work, "store"),
                         build="upstream-suite", api_key=a.api_key)
    bridge.start()
    try:
        run_proxy(bridge, [h.strip() for h in (a.host or "127.0.0.1").split(",")], port)  # type: ignore[arg-type]
    finally:
        bridge.close()
        del srv
        os._exit(0)


if __name__ == "__main__":
    main()
