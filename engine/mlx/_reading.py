"""How the MLX PrefixCache drives mlx_lm: the cache settings of a call, what it passes through, reading in pieces.

mlx_lm's ``generate_step`` reads all but the last prompt token in chunks of ``prefill_step_size``
(quantizing the KV cache after each chunk once it reaches ``quantized_kv_start``) and then steps
the last token to get the first logits. :func:`read` does exactly that for one piece of the prompt
between two stops, so a prompt read as pieces [0, c1), [c1, c2), ... [ck, n-1) and then stepped
at its last token is computed as mlx_lm computes it when called with a cache already holding
[0, ck) — the "same split". :func:`bypass_reason` names the calls the store cannot serve.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

from ._deps import mlx_generate
from ._identify import CacheSettings

__all__ = ["DEFAULTS", "bypass_reason", "quantizer", "read", "settings_of", "wrap_processors", "wrap_progress"]

def _signature(fn: Any) -> tuple[dict[str, Any], frozenset[str]]:
    sig = inspect.signature(fn)
    return ({k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty},
            frozenset(k for k, p in sig.parameters.items() if p.kind == inspect.Parameter.KEYWORD_ONLY))


# mlx_lm's defaults and keyword arguments: generate_step's, and speculative decoding's (another prefill step)
DEFAULTS, _KNOWN = _signature(mlx_generate.generate_step)
SPEC_DEFAULTS, _SPEC_KNOWN = _signature(mlx_generate.speculative_generate_step)


def bypass_reason(kw: Mapping[str, Any], speculative: bool = False) -> str | None:
    """Why a call goes to mlx_lm unchanged (nothing restored or saved), or None."""
    fn, known = ("speculative_generate_step", _SPEC_KNOWN) if speculative else ("generate_step", _KNOWN)
    unknown = sorted(set(kw) - known)
    if unknown:
        return f"{fn} does not take {unknown[0]}= (mlx_lm raises)"
    if kw.get("prompt_cache") is not None:
        return "prompt_cache=: the caller's own cache"
    if kw.get("input_embeddings") is not None:
        return "input_embeddings=: snapshots are keyed by token ids only"
    return None


def settings_of(model: Any, kw: Mapping[str, Any], speculative: bool = False) -> CacheSettings:
    """The call's settings that change the bytes of a prompt's state (mlx_lm's defaults filled in)."""
    defaults = SPEC_DEFAULTS if speculative else DEFAULTS

    def get(k: str) -> Any:
        return kw.get(k, defaults.get(k))

    bits = get("kv_bits")
    # the model's own cache ignores max_kv_size; speculative decoding makes its caches without it
    max_kv = get("max_kv_size") if not hasattr(model, "make_cache") and not speculative else None
    return CacheSettings(prefill_step_size=int(get("prefill_step_size")), kv_bits=bits,
                         kv_group_size=get("kv_group_size") if bits is not None else None,
                         quantized_kv_start=get("quantized_kv_start") if bits is not None else None,
                         max_kv_size=max_kv)


def quantizer(s: CacheSettings) -> Callable[[list[Any]], None]:
    """mlx_lm's per-chunk KV quantization for these settings (a no-op without kv_bits)."""
    return functools.partial(mlx_generate.maybe_quantize_kv_cache, quantized_kv_start=s.quantized_kv_start,
                             kv_group_size=s.kv_group_size, kv_bits=s.kv_bits)


def read(model: Any, cache: list[Any], piece: mx.array, s: CacheSettings,
         progress: Callable[[int], None] | None = None) -> float:
    """Read ``piece`` into ``cache`` as generate_step's prefill loop reads it: chunks of
    ``prefill_step_size``, quantizing and evaluating the cache after each. Returns the seconds the
    chunks' computation took (the caller's progress callback left out): a prefill rate's time."""
    quantize = quantizer(s)
    spent = 0.0
    while piece.size > 0:
        t = time.perf_counter()
        k = min(s.prefill_step_size, piece.size)
        model(piece[:k][None], cache=cache)
        quantize(cache)
        mx.eval([c.state for c in cache])
        piece = piece[k:]
        mx.clear_cache()
        spent += time.perf_counter() - t
        if progress is not None:
            progress(k)
    return spent


def wrap_processors(processors: list[Any] | None, prefix: mx.array) -> list[Any] | None:
    """Logits processors that see the whole prompt: mlx_lm hands them the tokens it read, and here it
    reads only the last prompt token, so the restored and read-ahead tokens (``prefix``) go in front."""
    if not processors or prefix.size == 0:
        return processors

    def wrap(p: Callable[[mx.array, mx.array], mx.array]) -> Callable[[mx.array, mx.array], mx.array]:
        return lambda tokens, logits: p(mx.concatenate([prefix, tokens]), logits)

    return [wrap(p) for p in processors]


def wrap_progress(cb: Callable[[int, int], None] | None, done: int, total: int) -> Callable[[int, int], None] | None:
    """A prompt_progress_callback for mlx_lm's call over the last ``total - done`` tokens, in whole-prompt terms."""
    if cb is None:
        return None
    return lambda k, _n: cb(done + k, total)
