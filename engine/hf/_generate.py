"""How PrefixCache drives transformers' ``generate``: what a call may ask, and reading a prompt in pieces.

:func:`check_call` refuses, before anything is read or stored, what one cached sequence cannot
serve (a batch, beams, padding); :func:`bypass_reason` names a call whose arguments are not all
known to give ``model.generate``'s numbers through the store (hidden states, attentions, a static
or caller's cache, chunked prefill, assisted decoding, ...): such a call goes to ``model.generate``.
:func:`prefill` reads a prompt up to its last cut, one piece per cut, each piece through
``model.generate`` itself, and :func:`generate_rest` lets ``model.generate`` read the last piece
and decode: every forward gets exactly the inputs generate's own prefill gives it, so a snapshot
taken at a cut holds the bytes a later call computes for that piece (docs/engine.md, section 9).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Union, cast

import torch

from snapstore import InvalidInputError

from .._prefix_policy import CachePrefix, positions
from ..torch import TokenIds

if TYPE_CHECKING:
    from transformers import DynamicCache, GenerationConfig, PreTrainedModel
    from transformers.generation.utils import GenerateOutput

__all__ = [
    "BatchNotSupportedError",
    "CachePrefix",
    "ForwardTimer",
    "Generated",
    "PromptEnd",
    "bypass_reason",
    "check_call",
    "generate_rest",
    "positions",
    "prefill",
]

Generated = Union["GenerateOutput", torch.LongTensor]
"""What ``model.generate`` returns: the ids, or an output object (``return_dict_in_generate=True``)."""

# What a call may ask and still be served through the store: an allow-list of what is known to leave
# generate's numbers equal to model.generate's (docs/engine.md section 9); anything else is passed to
# model.generate unchanged (see bypass_reason).

# generate()'s own arguments that see only the ids and scores both runs share: any value
_SERVED_ARGS = frozenset({"generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                          "streamer", "tokenizer", "trust_remote_code"})
# generate()'s own arguments that change how the prompt is read or decoded: served only when absent
_ABSENT_ARGS = {
    "assistant_model": "assisted decoding rolls the cache back",
    "assistant_tokenizer": "assisted decoding rolls the cache back",
    "custom_generate": "a custom decoding loop may read the cache its own way",
    "negative_prompt_ids": "classifier-free guidance reads a second prompt",
    "negative_prompt_attention_mask": "classifier-free guidance reads a second prompt",
    "synced_gpus": "synchronised multi-GPU decoding",
}
# what goes on to the model's forward: only the (all-ones, checked) attention mask
_MODEL_KWARGS = frozenset({"attention_mask", "output_attentions", "output_hidden_states"})
# generation-config fields that only steer decoding (the next token, when to stop, what is returned
# of the decoded steps) or apply to modes refused elsewhere: any value
_DECODE_FIELDS = frozenset({
    "_from_model_config", "transformers_version", "max_length", "max_new_tokens", "min_length", "min_new_tokens",
    "early_stopping", "max_time", "stop_strings", "do_sample", "temperature", "top_k", "top_p", "min_p", "top_h",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "renormalize_logits",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "pad_token_id", "bos_token_id", "eos_token_id",
    "decoder_start_token_id", "output_scores", "output_logits", "return_dict_in_generate", "num_beam_groups",
    "diversity_penalty", "low_memory", "compile_config", "disable_compile", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "max_matching_ngram_size", "assistant_ensemble_weight",
})
# generation-config fields that change how the prompt is read, what is returned about it, or the
# decoding mode: served only at these values (the first is transformers' default)
_NEUTRAL_FIELDS: dict[str, tuple[object, ...]] = {
    "output_attentions": (False, None), "output_hidden_states": (False, None), "use_cache": (True, None),
    "cache_implementation": (None,), "cache_config": (None,), "max_cache_len": (None,), "prefill_chunk_size": (None,),
    "num_beams": (1, None), "num_return_sequences": (1, None), "constraints": (None,), "force_words_ids": (None,),
    "penalty_alpha": (None, 0), "dola_layers": (None,), "guidance_scale": (None, 1), "watermarking_config": (None,),
    "token_healing": (None, False), "use_mtp": (None, False), "assistant_early_exit": (None,),
    "prompt_lookup_num_tokens": (None,), "continuous_batching_config": (None,), "speculation_type": (None,),
    "is_assistant": (None, False),
}
_WHY_FIELD = {
    "output_attentions": "attentions of the restored tokens are not recomputed",
    "output_hidden_states": "hidden states of the restored tokens are not recomputed",
    "use_cache": "generate(use_cache=False) reads no cache",
    "cache_implementation": "PrefixCache restores into a DynamicCache",
    "cache_config": "PrefixCache restores into a DynamicCache",
    "max_cache_len": "PrefixCache restores into a DynamicCache",
    "prefill_chunk_size": "chunked prefill reads the prompt in other pieces than the snapshots were taken at",
}


class BatchNotSupportedError(InvalidInputError, NotImplementedError):
    """PrefixCache serves one sequence per call (batch size 1, one beam, one return sequence)."""


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


def bypass_reason(model: PreTrainedModel, kw: Mapping[str, Any]) -> str | None:
    """Why a call must go to ``model.generate`` unchanged (nothing restored or saved); None: it can be served.

    Served only when every argument is on the allow-list above and the call's effective generation
    config (``kw``, ``generation_config``, ``model.generation_config``, transformers' defaults, merged
    as ``generate`` merges them) holds only decode-only fields or neutral values. A field this
    module does not know (a newer transformers) is served only at its default value.
    """
    for key, why in _ABSENT_ARGS.items():
        if kw.get(key) not in (None, False):
            return f"generate({key}=...): {why}"
    rest = {k: v for k, v in kw.items() if k not in _SERVED_ARGS}
    try:
        gc, model_kwargs = _generator(model)._prepare_generation_config(kw.get("generation_config"), **rest)
    except (ValueError, TypeError) as e:  # model.generate raises the same, in the caller's terms
        return f"transformers does not accept the arguments ({e})"
    forwarded = sorted(set(model_kwargs) - _MODEL_KWARGS)
    if forwarded:
        return f"generate({forwarded[0]}=...) goes to the model's forward; PrefixCache keys prompts by token ids"
    fields = gc.to_dict()
    defaults: dict[str, Any] | None = None
    for name, value in fields.items():
        if name in _DECODE_FIELDS:
            continue
        if name in _NEUTRAL_FIELDS:
            if any(value is v or (v is not None and value == v) for v in _NEUTRAL_FIELDS[name]):
                continue
            why = _WHY_FIELD.get(name, "it changes how the prompt is read or the decoding mode")
            return f"generate({name}={value!r}): {why}"
        if defaults is None:
            from transformers import GenerationConfig

            defaults = GenerationConfig().to_dict()  # type: ignore[no-untyped-call]
        if value != defaults.get(name):
            return f"generate({name}={value!r}) is not known to leave the prompt's state alone"
    return None


class ForwardTimer:
    """The wall time of ``model``'s forwards (hooks on the model: from its first pre-hook to its last
    hook) until :meth:`stop`: what a prompt's read costs the model, without generate's set-up, the
    caller's logits processors and streamer, or captures at cuts. On CUDA each timed forward waits
    for its kernels (the rate is of the computation, not of its launch)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.seconds = 0.0
        self._t0: float | None = None
        self._on = True
        self._cuda = device.type == "cuda"
        self._device = device
        self._handles = [model.register_forward_pre_hook(self._pre, prepend=True),
                         model.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        if self._on:
            self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        if self._on and self._t0 is not None:
            if self._cuda:
                torch.cuda.synchronize(self._device)
            self.seconds += time.perf_counter() - self._t0
        self._t0 = None

    def stop(self) -> float:
        """Stop timing (the prompt is read); the seconds its forwards took."""
        self._on = False
        return self.seconds

    def close(self) -> None:
        """Remove the hooks."""
        self._on = False
        for h in self._handles:
            h.remove()
        self._handles = []


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
                            pad_token_id=0 if pad is None else pad, eos_token_id=None, use_cache=True,
                            output_attentions=False, output_hidden_states=False, output_scores=False,
                            output_logits=False, return_dict_in_generate=False)


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

    def _prepare_generation_config(self, generation_config: GenerationConfig | None,
                                   **kwargs: Any) -> tuple[GenerationConfig, dict[str, Any]]: ...


def _generator(model: PreTrainedModel) -> _Generates:
    """The model as the ``GenerationMixin`` its class mixes in (every ``*ForCausalLM`` does); a model
    without ``generate`` fails at the call, as ``model.generate`` itself would."""
    return cast(_Generates, model)
