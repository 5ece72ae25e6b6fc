"""``stream_generate`` and ``generate`` over the MLX PrefixCache: mlx_lm's own loops, over its generate_step.

mlx_lm's ``stream_generate`` calls its module's ``generate_step`` with no way to hand it a restored
cache and still give the logits processors the whole prompt, so the loop is repeated here as mlx_lm
writes it (tokenizing, detokenizing, the response fields), over :meth:`PrefixCache.generate_step`.
The token generator is closed when the loop ends, so the call's captures are committed then, not
whenever the garbage collector gets to it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ._deps import mlx_generate

__all__ = ["Steps", "generate", "stream_generate"]


class Steps(Protocol):
    """What the loops use of the MLX PrefixCache (typed here, so this module sits below it)."""

    model: Any

    def generate_step(self, *args: Any, **kwargs: Any) -> Iterator[Any]: ...

    def speculative_generate_step(self, *args: Any, **kwargs: Any) -> Iterator[Any]: ...


def stream_generate(pc: Steps, tokenizer: Any, prompt: Any, max_tokens: int = 256, draft_model: Any = None,
                    stream: Any = None, **kwargs: Any) -> Iterator[Any]:
    """mlx_lm's ``stream_generate`` loop over ``pc.generate_step`` (``pc.speculative_generate_step`` with a draft)."""
    stream = mlx_generate.generation_stream if stream is None else stream
    policy = {k: kwargs.pop(k) for k in ("cache_prefix", "session", "namespace") if k in kwargs}
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if not isinstance(prompt, mx.array):
        if isinstance(prompt, str):
            add_special_tokens = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
            prompt = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        prompt = mx.array(prompt)
    detokenizer = tokenizer.detokenizer
    kwargs["max_tokens"] = max_tokens
    gen: Any
    steps: Iterator[tuple[Any, Any, bool]]
    if draft_model is None:
        kwargs.pop("num_draft_tokens", None)
        gen = pc.generate_step(prompt, stream, **policy, **kwargs)
        steps = ((token, logprobs, False) for token, logprobs in gen)
    else:  # as mlx_lm: speculative decoding takes no kv size, progress callback or embeddings
        kwargs.pop("max_kv_size", None)
        kwargs.pop("prompt_progress_callback", None)
        if kwargs.pop("input_embeddings", None) is not None:
            raise ValueError("Speculative decoding does not support input embeddings.")
        gen = steps = pc.speculative_generate_step(prompt, draft_model, stream, **policy, **kwargs)
    try:
        with mlx_generate.wired_limit(pc.model, [stream]):
            tic = time.perf_counter()
            prompt_tps = 0.0
            n, token, logprobs, from_draft = 0, None, None, False
            for n, (token, logprobs, from_draft) in enumerate(steps):
                if n == 0:
                    prompt_time = time.perf_counter() - tic
                    prompt_tps = prompt.size / prompt_time
                    tic = time.perf_counter()
                if token in tokenizer.eos_token_ids:
                    break
                detokenizer.add_token(token)
                if (n + 1) == max_tokens:
                    break
                yield _response(detokenizer.last_segment, token, logprobs, from_draft, prompt.size, prompt_tps, n, tic,
                                None)
            detokenizer.finalize()
            reason = "stop" if token in tokenizer.eos_token_ids else "length"
            yield _response(detokenizer.last_segment, token, logprobs, from_draft, prompt.size, prompt_tps, n, tic,
                            reason)
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


def _response(text: str, token: Any, logprobs: Any, from_draft: bool, prompt_tokens: int, prompt_tps: float, n: int,
              tic: float, finish_reason: str | None) -> Any:
    return mlx_generate.GenerationResponse(
        text=text, token=token, logprobs=logprobs, from_draft=from_draft, prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tps, generation_tokens=n + 1, generation_tps=(n + 1) / (time.perf_counter() - tic),
        peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason)


def generate(pc: Steps, tokenizer: Any, prompt: Any, verbose: bool = False, **kwargs: Any) -> str:
    """mlx_lm's ``generate``: the text of ``stream_generate``'s responses (printed as they come with verbose)."""
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(pc, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if len(text) == 0 or response is None:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
