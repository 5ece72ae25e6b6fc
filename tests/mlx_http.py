"""A server process on loopback for the MLX server tests and benchmarks (started and stopped by pid)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


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

    def chat(self, system: str, user: str, max_tokens: int = 8) -> dict[str, Any]:
        """One chat completion (greedy, with log-probabilities)."""
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True}
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
