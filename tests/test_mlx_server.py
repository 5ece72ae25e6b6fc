"""``snapstore mlx-server`` over HTTP: after a restart, a new chat with a known system prompt restores it.

A tiny llama (random weights, a word-level tokenizer and a chat template, written to a directory
here) is served by ``snapstore mlx-server`` (mlx_lm.server with the store-backed prompt cache) on
loopback. Server 1 answers a chat and stops. Server 2, a new process on the same store, answers a
new chat with the same system prompt: the response's ``cached_tokens`` says the system prompt was
restored, not read (mlx_lm's own server starts with an empty cache), and its text and every token's
log-probability equal plain ``mlx_lm.server``'s answer to the same chat. Each process is started and
stopped by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm", reason="needs the mlx extra (mlx[cpu], mlx-lm)")

import mlx_models  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = " ".join(f"w{i}" for i in range(10, 40))  # 30 words: the system prompt every chat starts with


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process on loopback, started from ``argv`` (``--host``/``--port`` appended), stopped by pid."""

    def __init__(self, argv: list[str], log: Path):
        self.port = _port()
        self._log = open(log, "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(self.port)], cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 300  # a loaded machine imports mlx_lm slowly
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not start: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)

    def chat(self, user: str) -> dict[str, Any]:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                "max_tokens": 8, "temperature": 0.0, "logprobs": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def _answer(doc: dict[str, Any]) -> tuple[str, list[tuple[int, float]]]:
    ch = doc["choices"][0]
    return ch["message"]["content"], [(t["id"], t["logprob"]) for t in ch["logprobs"]["content"]]


def test_a_restarted_server_restores_the_system_prompt(tmp_path: Path) -> None:
    model_dir, store = tmp_path / "model", tmp_path / "store"
    mlx_models.write_model_dir("llama", model_dir, with_tokenizer=True)
    ours = [sys.executable, "-m", "snapstore", "--dir", str(store), "mlx-server", "--model", str(model_dir)]

    s1 = Server(ours, tmp_path / "s1.log")
    try:
        first = s1.chat("w50 w51 w52")
    finally:
        s1.stop()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    s2 = Server(ours, tmp_path / "s2.log")  # a restart: mlx_lm's in-memory cache is empty
    try:
        second = s2.chat("w70 w71 w72")
    finally:
        s2.stop()
    log = (tmp_path / "s2.log").read_text(errors="replace")
    restored = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the system prompt's segment ends where the chat template's user turn starts: w2 SYSTEM w3 w2 (33 tokens)
    assert restored == 33 and "snapstore: restored 33 of" in log

    plain = Server([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)], tmp_path / "plain.log")
    try:
        want = plain.chat("w70 w71 w72")
    finally:
        plain.stop()
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _answer(second) == _answer(want)
    assert second["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
