"""What llama-proxy reads of a response as it streams past (``_proxy._SlotSniffer``), fed a known trace.

The prefill rate (issue 47 item 9, the llama-proxy part) is llama-server's own timing of the prompt
it read — ``timings.prompt_n`` over ``timings.prompt_ms`` — never the request's wall time (which
holds generation, queueing and the client's pace); ``cache_n`` is a save's proof of provenance
(``LlamaBridge._copy_out``). Both must come out right however the body is cut into chunks.
"""

from __future__ import annotations

import json

import pytest

from snapstore.engine.llamacpp._proxy import _SlotSniffer
from snapstore.plan.restore_or_recompute import PrefillRate


def _sse_trace() -> bytes:
    """A streamed chat reply as llama-server sends it with ``timings_per_token``: every chunk carries
    timings, the last the final ones (the prompt's time does not move while it generates)."""
    events = []
    for i in range(5):
        ev = {"choices": [{"delta": {"content": f'w{i} "prompt_ms":9,'}}], "id_slot": 3,
              "timings": {"cache_n": 120, "prompt_n": 380, "prompt_ms": 47.5, "predicted_n": i + 1,
                          "predicted_ms": 12.25 * (i + 1)}}
        events.append(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


@pytest.mark.parametrize("cut", [1, 7, 13, 40, 41, 1 << 20])
def test_the_prefill_rate_is_the_servers_prompt_timing_however_the_body_is_cut(cut: int) -> None:
    body = _sse_trace()
    sniff = _SlotSniffer()
    for i in range(0, len(body), cut):
        sniff.feed(body[i:i + cut])
    rate = PrefillRate()
    sniff.timed(rate)
    assert (sniff.prompt_n, sniff.prompt_ms, sniff.cache_n, sniff.slot) == (380, 47.5, 120, 3)
    assert rate.tokens_per_s == pytest.approx(380 / 0.0475)  # not predicted_ms, not the content's text


def test_a_reply_without_timings_gives_no_rate_and_no_proof() -> None:
    sniff = _SlotSniffer()
    sniff.feed(b'{"content":"\\"cache_n\\":0 \\"prompt_n\\":5","id_slot":0}')
    rate = PrefillRate()
    sniff.timed(rate)
    assert sniff.cache_n is None and sniff.prompt_n is None
    assert rate.tokens_per_s is None
