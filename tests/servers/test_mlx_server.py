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

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm", reason="needs the mlx extra (mlx[cpu], mlx-lm)")

import mlx_models  # noqa: E402
from mlx_http import Server  # noqa: E402

pytestmark = pytest.mark.slow

SYSTEM = " ".join(f"w{i}" for i in range(10, 40))  # 30 words: the system prompt every chat starts with


def _answer(doc: dict[str, Any]) -> tuple[str, list[tuple[int, float]]]:
    ch = doc["choices"][0]
    return ch["message"]["content"], [(t["id"], t["logprob"]) for t in ch["logprobs"]["content"]]


def test_a_restarted_server_restores_the_system_prompt(tmp_path: Path) -> None:
    model_dir, store = tmp_path / "model", tmp_path / "store"
    mlx_models.write_model_dir("llama", model_dir, with_tokenizer=True)
    ours = [sys.executable, "-m", "snapstore", "--dir", str(store), "mlx-server", "--model", str(model_dir)]

    s1 = Server(ours, tmp_path / "s1.log")
    try:
        first = s1.chat(SYSTEM, "w50 w51 w52")
    finally:
        s1.stop()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    s2 = Server(ours, tmp_path / "s2.log")  # a restart: mlx_lm's in-memory cache is empty
    try:
        second = s2.chat(SYSTEM, "w70 w71 w72")
    finally:
        s2.stop()
    log = (tmp_path / "s2.log").read_text(errors="replace")
    restored = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the system prompt's segment ends where the chat template's user turn starts: w2 SYSTEM w3 w2 (33 tokens)
    assert restored == 33 and "snapstore: restored 33 of" in log

    plain = Server([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)], tmp_path / "plain.log")
    try:
        want = plain.chat(SYSTEM, "w70 w71 w72")
    finally:
        plain.stop()
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _answer(second) == _answer(want)
    assert second["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
