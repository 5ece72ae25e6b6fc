"""The vLLM connector's prefill rate from a known trace (no vLLM): only the forwards of steps that
prefilled enter it, timed on the worker; idle time between requests, the connector's own loads
and decode-only steps never do (issue 47 item 9). The rate read by a real vLLM is checked in
tests/engine/vllm/test_vllm_connector.py."""

from __future__ import annotations

import pytest

from snapstore.engine.vllm._rate import ForwardClock, StepRate, prefill_tokens

SPEED = 140_000.0  # tokens/s the traced engine's forward computes prompt tokens at


class Clock:
    """A clock the trace moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_prefill_tokens_counts_prompt_tokens_only() -> None:
    prompt = {"a": 1000, "b": 300, "c": 50}
    # a: its second chunk (512 of its 1000 prompt tokens done); b: decoding; c: its whole prompt; d: unknown
    assert prefill_tokens({"a": 512, "b": 1, "c": 50, "d": 7}, {"a": 512, "b": 310, "c": 0}, prompt) == 488 + 50
    # speculative decoding schedules several tokens of a request past its prompt: none are prefill
    assert prefill_tokens({"b": 4}, {"b": 300}, prompt) == 0


def test_a_trace_with_idle_gaps_loads_and_decode_steps_measures_the_forward_rate() -> None:
    """Prefill steps at SPEED with long idle gaps between requests, loads inside the window, and
    big decode-only batches: the rate is SPEED. The scheduler-side gap timing this replaces
    (issue 47: 5,013 tokens/s reported for an engine doing ~140,000) read the idle time as prefill."""
    clock = Clock()
    worker, scheduler = ForwardClock(clock=clock), StepRate()
    steps = [  # (prefill tokens, decode tokens, load seconds, idle seconds after the step)
        (4096, 0, 0.0, 3.0), (0, 256, 0.0, 0.0), (0, 256, 0.0, 4.5),
        (2048, 12, 0.05, 0.0), (0, 300, 0.0, 2.0), (8192, 0, 0.2, 0.8), (1, 0, 0.0, 1.0),
    ]
    for prefill, decode, load_s, idle in steps:
        worker.begin(prefill)
        clock.t += load_s  # the connector's loads: inside the window, not forward time
        worker.loaded(load_s)
        clock.t += (prefill + decode) / SPEED  # the forward
        worker.end()
        clock.t += idle
        for tokens, seconds in worker.take():
            scheduler.observe(tokens, seconds)
    rate = scheduler.tokens_per_s
    # mixed steps: their decode tokens ride along in the forward's time (slightly conservative)
    assert rate == pytest.approx(SPEED, rel=0.01)


def test_nothing_measured_before_a_prefilling_step() -> None:
    clock = Clock()
    worker, scheduler = ForwardClock(clock=clock), StepRate()
    for _ in range(3):  # decode-only steps
        worker.begin(0)
        clock.t += 0.01
        worker.end()
    assert worker.take() == [] and scheduler.tokens_per_s is None
