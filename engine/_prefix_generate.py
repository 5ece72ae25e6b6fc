"""How PrefixCache drives transformers' ``generate``: what a call may ask, and reading a prompt in pieces.

:func:`check_call` refuses, before anything is read or stored, what one cached sequence cannot
serve (a batch, beams, a cache of the caller's, embeddings, rollback decoding, padding).
:func:`prefill` reads a prompt up to its last cut, one piece per cut, each piece through
``model.generate`` itself, and :func:`generate_rest` lets ``model.generate`` read the last piece
and decode: every forward gets exactly the inputs generate's own prefill gives it, so a snapshot
taken at a cut holds the bytes a later call computes for that piece (docs/engine.md, section 9).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex, TypeGuard, Union, cast

import torch

from snapstore import InvalidInputError

from ._types import TokenIds

if TYPE_CHECKING:
    from transformers import DynamicCache, GenerationConfig, PreTrainedModel
    from transformers.generation.utils import GenerateOutput

__all__ = [
    "BatchNotSupportedError",
    "CachePrefix",
    "Generated",
    "PromptEnd",
    "check_call",
    "generate_rest",
    "positions",
    "prefill",
]

CachePrefix = Union[int, Iterable[int], None]
"""Positions a call snapshots exactly at: one, several, or none."""

Generated = Union["GenerateOutput", torch.LongTensor]
"""What ``model.generate`` returns: the ids, or an output object (``return_dict_in_generate=True``)."""

# generate() arguments PrefixCache owns or cannot serve: the cache is ours, the batch is one sequence
_REFUSED = {
    "past_key_values": "PrefixCache builds and restores the cache itself",
    "inputs_embeds": "PrefixCache keys snapshots by token ids; pass input_ids",
    "assistant_model": "assisted generation rolls the cache back; use model.generate",
    "prompt_lookup_num_tokens": "prompt-lookup decoding rolls the cache back; use model.generate",
}


class BatchNotSupportedError(InvalidInputError, NotImplementedError):
    """PrefixCache serves one sequence per call (batch size 1, one beam, one return sequence)."""


def positions(cache_prefix: CachePrefix) -> list[int]:
    """cache_prefix as a list of positive ints (None, an int, or an iterable of ints)."""
    if cache_prefix is None:
        return []
    vals: object = [cache_prefix] if _is_int(cache_prefix) else cache_prefix
    if isinstance(vals, (str, bytes)) or not isinstance(vals, Iterable):
        raise InvalidInputError(f"cache_prefix must be an int or a list of ints, got {cache_prefix!r}")
    out = []
    for v in vals:
        if not _is_int(v) or operator.index(v) < 1:
            raise InvalidInputError(f"cache_prefix positions must be ints >= 1, got {v!r}")
        out.append(operator.index(v))
    return out


def _is_int(v: object) -> TypeGuard[SupportsIndex]:
    """An integer (numpy and 0-d integer tensors too), not a bool."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)  # type: ignore[arg-type]  # the probe: anything without __index__ raises
    except TypeError:
        return False
    return True


def check_call(model: PreTrainedModel, device: torch.device, input_ids: TokenIds,
               kw: Mapping[str, Any]) -> torch.Tensor:
    """input_ids as a (1, n) long tensor on ``device``; refuse what the cache cannot serve."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        raise InvalidInputError(f"input_ids must be (1, n) token ids, got shape {tuple(ids.shape)} {ids.dtype}")
    if ids.shape[0] != 1:
        raise BatchNotSupportedError(f"a batch of {ids.shape[0]} sequences: PrefixCache serves one sequence "
                                     "per call; call generate once per prompt (batching is not done yet)")
    if ids.shape[1] == 0:
        raise InvalidInputError("input_ids is empty: generate needs at least one prompt token")
    for key, why in _REFUSED.items():
        if kw.get(key) is not None:
            raise InvalidInputError(f"generate({key}=...) is not supported: {why}")
    if kw.get("use_cache") is False:
        raise InvalidInputError("generate(use_cache=False) reads no cache; call model.generate directly")
    gc = kw.get("generation_config") or model.generation_config
    for key in ("num_beams", "num_return_sequences"):
        value = kw.get(key, getattr(gc, key, 1))
        if value not in (None, 1):
            raise BatchNotSupportedError(f"generate({key}={value}) expands the cache to a batch; PrefixCache "
                                         "serves one sequence (batching is not done yet)")
    mask = kw.get("attention_mask")
    if mask is not None and (tuple(mask.shape) != tuple(ids.shape) or not bool(torch.all(mask == 1))):
        raise InvalidInputError("attention_mask must be all ones for the one (unpadded) sequence")
    return ids.to(device=device, dtype=torch.long)


class PromptEnd:
    """A stopping criterion that never stops: its first call (the cache holds exactly the prompt) captures it."""

    def __init__(self, capture: Callable[[], None]):
        self.capture = capture
        self.called = False

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if not self.called:
            self.called = True
            self.capture()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def prefill(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache, start: int, cuts: list[int],
            at_cut: Callable[[int], None] | None) -> None:
    """Read the prompt from ``start`` to its last cut, one piece per cut, calling ``at_cut`` at each.

    Each piece is read by ``model.generate`` itself (one new token, discarded): the forward
    gets exactly the inputs generate's own prefill gives the last piece (position ids, mask,
    logits_to_keep, model-specific preparation), so a snapshot taken at the prompt's end and
    one taken at a cut hold the same bytes a later call computes for that piece.
    """
    pos = start
    for c in cuts:
        if c <= pos:
            continue
        _generator(model).generate(ids[:, :c], attention_mask=torch.ones_like(ids[:, :c]), past_key_values=cache,
                       generation_config=_piece_config(model))
        pos = c
        if at_cut is not None:
            at_cut(c)


def _piece_config(model: PreTrainedModel) -> GenerationConfig:
    """A generation config for reading one piece: greedy, one new token, nothing returned but the ids."""
    from transformers import GenerationConfig

    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return GenerationConfig(max_new_tokens=1, min_new_tokens=0, do_sample=False, num_beams=1,  # type: ignore[no-untyped-call]
                            pad_token_id=0 if pad is None else pad, eos_token_id=None)


def generate_rest(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache, kw: Mapping[str, Any],
                  hook: PromptEnd | None) -> Generated:
    """``model.generate`` over the prefilled cache; it reads the last piece and decodes."""
    from transformers import StoppingCriteriaList

    kw = dict(kw)
    kw["attention_mask"] = torch.ones_like(ids)  # one unpadded sequence: a pad id in the prompt is a token
    if hook is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([hook, *(kw.get("stopping_criteria") or [])])
    out: Generated = _generator(model).generate(ids, past_key_values=cache, **kw)
    return out


class _Generates(Protocol):
    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


def _generator(model: PreTrainedModel) -> _Generates:
    """The model as the ``GenerationMixin`` its class mixes in (every ``*ForCausalLM`` does); a model
    without ``generate`` fails at the call, as ``model.generate`` itself would."""
    return cast(_Generates, model)
