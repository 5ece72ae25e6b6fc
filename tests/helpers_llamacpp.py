"""Tiny random-weight GGUF models and an in-process llama-server.

Models: llama (attention only), LFM2 (short-conv + attention), granitehybrid and nemotron_h
(Mamba2 + attention, nemotron_h with MLP-only layers too), mamba2 (recurrent only), qwen35
and qwen3next (gated-delta-net + attention; qwen35 with M-RoPE cells, qwen3next with MoE), gemma3
and gpt-oss (iSWA: full-attention + sliding-window caches).

Written at test time with the ``gguf`` package and a small hand-made SPM vocabulary (256 byte
tokens + a few words): no downloads. The server is the real llama-server, run in process by
``xllamacpp`` on a free 127.0.0.1 port; ``LlamaServer`` stops it (and frees its port) on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

WORDS = ["hello", "world", "the", "a", "system", "user", "you", "are", "helpful", "assistant", "tool", "answer",
         "question", "cache", "prompt", "token", "state", "store", "snap", "chat", "model", "file"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _vocab() -> tuple[list[bytes], list[float], list[int]]:
    toks: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        toks.append(role.encode())
        types.append(4)  # USER_DEFINED: matched whole in text
    for b in range(256):
        toks.append(f"<0x{b:02X}>".encode())
        types.append(6)  # BYTE
    for w in WORDS:
        toks.append(("\u2581" + w).encode())
        types.append(1)
    scores = [0.0] * len(toks)
    for i in range(len(toks) - len(WORDS), len(toks)):
        scores[i] = -1.0
    return toks, scores, types


def _tokenizer(w: Any) -> int:
    toks, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return len(toks)


def _t(rng: np.random.Generator, *shape: int, scale: float = 0.2) -> np.ndarray:
    """A random f32 tensor; ``shape`` is numpy order (outermost first)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


class _Quantized:
    """A ``GGUFWriter`` whose 2-D weight matrices are stored as ``wtype`` (f16, q8_0, ...): the same
    weights as another quant of one model (norms and 1-D tensors stay f32)."""

    def __init__(self, w: Any, wtype: str) -> None:
        self.w, self.wtype = w, wtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self.w, name)

    def add_tensor(self, name: str, t: np.ndarray) -> None:
        import gguf

        if t.ndim != 2 or self.wtype == "f32":
            self.w.add_tensor(name, t)
        elif self.wtype == "f16":
            self.w.add_tensor(name, t.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType[self.wtype.upper()]
            q = gguf.quants.quantize(t, qt)
            self.w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)


_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}


def write_llama(path: str, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                n_ff: int = 128, n_ctx: int = 8192, seed: int = 0, wtype: str = "f32") -> str:
    """A random-weight llama GGUF at ``path``; ``wtype``: the weight matrices' type (the same
    weights for one ``seed``: another quant of the same model)."""
    import gguf

    rng = np.random.default_rng(seed)
    w: Any = gguf.GGUFWriter(path, "llama")
    if wtype != "f32":
        w = _Quantized(w, wtype)
    w.add_name(f"tiny-llama-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(_FILE_TYPES[wtype])
    n_vocab = _tokenizer(w)
    hd = n_embd // n_head
    w.add_tensor("token_embd.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", _t(rng, n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", _t(rng, n_head_kv * hd, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", _t(rng, n_head_kv * hd, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", _t(rng, n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", _t(rng, n_embd, n_ff))
    _finish(w)
    return path


def write_lfm2(path: str, *, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
               l_cache: int = 3, layers: str = "rara", n_ctx: int = 8192, seed: int = 1) -> str:
    """A random-weight LFM2 hybrid GGUF: ``layers`` is r (short-conv, recurrent) / a (attention) per block."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "lfm2")
    w.add_name(f"tiny-lfm2-{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(len(layers))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([n_head_kv if c == "a" else 0 for c in layers])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_uint32("lfm2.shortconv.l_cache", l_cache)
    w.add_file_type(0)
    n_vocab = _tokenizer(w)
    hd = n_embd // n_head
    w.add_tensor("token_embd.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    w.add_tensor("token_embd_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    for i, kind in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", _t(rng, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", _t(rng, n_embd, n_ff))
        if kind == "a":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(f"blk.{i}.attn_q.weight", _t(rng, n_embd, n_embd))
            w.add_tensor(f"blk.{i}.attn_k.weight", _t(rng, n_head_kv * hd, n_embd))
            w.add_tensor(f"blk.{i}.attn_v.weight", _t(rng, n_head_kv * hd, n_embd))
            w.add_tensor(f"blk.{i}.attn_output.weight", _t(rng, n_embd, n_embd))
        else:
            w.add_tensor(f"blk.{i}.shortconv.conv.weight", _t(rng, n_embd, l_cache))
            w.add_tensor(f"blk.{i}.shortconv.in_proj.weight", _t(rng, 3 * n_embd, n_embd))
            w.add_tensor(f"blk.{i}.shortconv.out_proj.weight", _t(rng, n_embd, n_embd))
    _finish(w)
    return path


def write_lora(path: str, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
               rank: int = 4, seed: int = 3) -> str:
    """A random LoRA adapter GGUF for ``write_llama``'s model: low-rank deltas on every layer's K and V."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    kv = n_head_kv * (n_embd // n_head)
    for i in range(n_layer):
        for t in ("attn_k", "attn_v"):
            w.add_tensor(f"blk.{i}.{t}.weight.lora_a", _t(rng, rank, n_embd))
            w.add_tensor(f"blk.{i}.{t}.weight.lora_b", _t(rng, kv, rank))
    _finish(w)
    return path


def _finish(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -- hybrid, recurrent and sliding-window models (issue 27) -------------------------------------

def _head(w: Any, rng: np.random.Generator, n_vocab: int, n_embd: int, tied: bool = False) -> None:
    w.add_tensor("token_embd.weight", _t(rng, n_vocab, n_embd, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    if not tied:
        w.add_tensor("output.weight", _t(rng, n_vocab, n_embd, scale=1.0))


def _attn(w: Any, rng: np.random.Generator, i: int, n_embd: int, n_head: int, n_kv: int, hd: int, *,
          q_gate: bool = False, norms: bool = False) -> None:
    w.add_tensor(f"blk.{i}.attn_q.weight", _t(rng, n_head * hd * (2 if q_gate else 1), n_embd))
    w.add_tensor(f"blk.{i}.attn_k.weight", _t(rng, n_kv * hd, n_embd))
    w.add_tensor(f"blk.{i}.attn_v.weight", _t(rng, n_kv * hd, n_embd))
    w.add_tensor(f"blk.{i}.attn_output.weight", _t(rng, n_embd, n_head * hd))
    if norms:
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, np.float32))


def _ffn(w: Any, rng: np.random.Generator, i: int, n_embd: int, n_ff: int, *, gate: bool = True) -> None:
    if gate:
        w.add_tensor(f"blk.{i}.ffn_gate.weight", _t(rng, n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_up.weight", _t(rng, n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_down.weight", _t(rng, n_embd, n_ff))


# Mamba2 sizes of the tiny models: inner 128, state 16, 1 group, 8 heads, conv kernel 4
_M2 = {"inner": 128, "state": 16, "groups": 1, "heads": 8, "conv": 4}


def _ssm_keys(w: Any, arch: str) -> None:
    w.add_uint32(f"{arch}.ssm.conv_kernel", _M2["conv"])
    w.add_uint32(f"{arch}.ssm.inner_size", _M2["inner"])
    w.add_uint32(f"{arch}.ssm.state_size", _M2["state"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", _M2["heads"])
    w.add_uint32(f"{arch}.ssm.group_count", _M2["groups"])


def _mamba2_layer(w: Any, rng: np.random.Generator, i: int, n_embd: int) -> None:
    inner, state, groups, heads, conv = (_M2[k] for k in ("inner", "state", "groups", "heads", "conv"))
    conv_dim = inner + 2 * groups * state
    w.add_tensor(f"blk.{i}.ssm_in.weight", _t(rng, 2 * inner + 2 * groups * state + heads, n_embd))
    w.add_tensor(f"blk.{i}.ssm_conv1d.weight", _t(rng, conv_dim, conv))
    w.add_tensor(f"blk.{i}.ssm_conv1d.bias", _t(rng, conv_dim))
    w.add_tensor(f"blk.{i}.ssm_dt.bias", _t(rng, heads))
    w.add_tensor(f"blk.{i}.ssm_a", -np.abs(_t(rng, heads, 1, scale=1.0)))
    w.add_tensor(f"blk.{i}.ssm_d", _t(rng, heads, 1))
    w.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones((groups, inner // groups), np.float32))
    w.add_tensor(f"blk.{i}.ssm_out.weight", _t(rng, n_embd, inner))


def _start(path: str, arch: str, n_layer: int, n_embd: int, seed: int) -> tuple[Any, int, np.random.Generator]:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}-{seed}")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    return w, _tokenizer(w), np.random.default_rng(seed)


def write_granitehybrid(path: str, *, layers: str = "mama", n_embd: int = 64, seed: int = 11) -> str:
    """A granitehybrid GGUF: ``layers`` is m (Mamba2) / a (attention) per block, each with a dense FFN."""
    w, n_vocab, rng = _start(path, "granitehybrid", len(layers), n_embd, seed)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv([2 if c == "a" else 0 for c in layers])
    w.add_rope_dimension_count(16)
    _ssm_keys(w, "granitehybrid")
    _head(w, rng, n_vocab, n_embd)
    for i, c in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        if c == "a":
            _attn(w, rng, i, n_embd, 4, 2, 16)
        else:
            _mamba2_layer(w, rng, i, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        _ffn(w, rng, i, n_embd, 128)
    _finish(w)
    return path


def write_nemotron_h(path: str, *, layers: str = "m-a-m-", n_embd: int = 64, seed: int = 12) -> str:
    """A nemotron_h GGUF: ``layers`` is m (Mamba2) / a (attention) / - (MLP only, no cache) per block."""
    w, n_vocab, rng = _start(path, "nemotron_h", len(layers), n_embd, seed)
    w.add_layer_norm_eps(1e-5)
    w.add_feed_forward_length([128 if c == "-" else 0 for c in layers])
    w.add_head_count(4)
    w.add_head_count_kv([2 if c == "a" else 0 for c in layers])
    w.add_key_length(16)
    w.add_value_length(16)
    _ssm_keys(w, "nemotron_h")
    _head(w, rng, n_vocab, n_embd)
    for i, c in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        if c == "m":
            _mamba2_layer(w, rng, i, n_embd)
        elif c == "a":
            _attn(w, rng, i, n_embd, 4, 2, 16)
        else:
            _ffn(w, rng, i, n_embd, 128, gate=False)
    _finish(w)
    return path


def write_mamba2(path: str, *, n_layer: int = 2, n_embd: int = 64, seed: int = 13) -> str:
    """A Mamba2 GGUF (recurrent state only, no K/V cache)."""
    w, n_vocab, rng = _start(path, "mamba2", n_layer, n_embd, seed)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_head_count_kv(0)
    _ssm_keys(w, "mamba2")
    _head(w, rng, n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        _mamba2_layer(w, rng, i, n_embd)
    _finish(w)
    return path


def write_qwen35(path: str, *, layers: str = "rrra", n_embd: int = 64, seed: int = 14) -> str:
    """A qwen35 GGUF: ``layers`` is r (gated delta net) / a (gated attention) per block; the attention
    layers are every ``layers.index('a') + 1``-th (full_attention_interval). M-RoPE: its K/V cells
    carry a per-cell extension."""
    n_head, hd, conv, hk, nk, nvh, hv = 4, 16, 4, 16, 2, 4, 16
    key_dim, val_dim = hk * nk, hv * nvh
    w, n_vocab, rng = _start(path, "qwen35", len(layers), n_embd, seed)
    w.add_feed_forward_length(128)
    w.add_head_count(n_head)
    w.add_head_count_kv(2)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_uint32("qwen35.ssm.conv_kernel", conv)
    w.add_uint32("qwen35.ssm.state_size", hk)
    w.add_uint32("qwen35.ssm.group_count", nk)
    w.add_uint32("qwen35.ssm.time_step_rank", nvh)
    w.add_uint32("qwen35.ssm.inner_size", val_dim)
    w.add_uint32("qwen35.full_attention_interval", layers.index("a") + 1)
    w.add_array("qwen35.rope.dimension_sections", [4, 2, 2, 0])
    _head(w, rng, n_vocab, n_embd)
    for i, c in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", np.ones(n_embd, np.float32))
        if c == "a":
            _attn(w, rng, i, n_embd, n_head, 2, hd, q_gate=True, norms=True)
        else:
            conv_dim = 2 * key_dim + val_dim
            w.add_tensor(f"blk.{i}.attn_qkv.weight", _t(rng, conv_dim, n_embd))
            w.add_tensor(f"blk.{i}.attn_gate.weight", _t(rng, val_dim, n_embd))
            w.add_tensor(f"blk.{i}.ssm_beta.weight", _t(rng, nvh, n_embd))
            w.add_tensor(f"blk.{i}.ssm_alpha.weight", _t(rng, nvh, n_embd))
            w.add_tensor(f"blk.{i}.ssm_conv1d.weight", _t(rng, conv_dim, conv))
            w.add_tensor(f"blk.{i}.ssm_dt.bias", _t(rng, nvh))
            w.add_tensor(f"blk.{i}.ssm_a", -np.abs(_t(rng, nvh, scale=1.0)))
            w.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones(hv, np.float32))
            w.add_tensor(f"blk.{i}.ssm_out.weight", _t(rng, n_embd, val_dim))
        _ffn(w, rng, i, n_embd, 128)
    _finish(w)
    return path


def write_gemma3(path: str, *, n_layer: int = 8, window: int = 32, n_embd: int = 64, seed: int = 15) -> str:
    """A gemma3 GGUF with a ``window``-token sliding window: llama.cpp makes every 6th layer full
    attention and the rest sliding-window (its iSWA cache: two K/V caches per slot)."""
    w, n_vocab, rng = _start(path, "gemma3", n_layer, n_embd, seed)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_sliding_window(window)
    _head(w, rng, n_vocab, n_embd, tied=True)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        _attn(w, rng, i, n_embd, 4, 2, 16, norms=True)
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.post_ffw_norm.weight", np.ones(n_embd, np.float32))
        _ffn(w, rng, i, n_embd, 128)
    _finish(w)
    return path


def _moe(w: Any, rng: np.random.Generator, i: int, n_embd: int, n_exp: int, n_ff: int, *, bias: bool) -> None:
    w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", _t(rng, n_exp, n_embd))
    if bias:
        w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", _t(rng, n_exp))
    for t, shape in (("ffn_gate_exps", (n_exp, n_ff, n_embd)), ("ffn_up_exps", (n_exp, n_ff, n_embd)),
                     ("ffn_down_exps", (n_exp, n_embd, n_ff))):
        w.add_tensor(f"blk.{i}.{t}.weight", _t(rng, *shape))
        if bias:
            w.add_tensor(f"blk.{i}.{t}.bias", _t(rng, shape[0], shape[1]))


def write_qwen3next(path: str, *, layers: str = "rrra", n_embd: int = 64, seed: int = 16) -> str:
    """A qwen3next GGUF: gated delta net (fused qkvz / ba projections) + gated attention, MoE with a
    shared expert; the attention layers are every ``layers.index('a') + 1``-th."""
    n_head, hd, conv, hk, nk, nvh, hv, n_exp, n_ff = 4, 16, 4, 16, 2, 4, 16, 4, 64
    key_dim, val_dim = hk * nk, hv * nvh
    w, n_vocab, rng = _start(path, "qwen3next", len(layers), n_embd, seed)
    w.add_feed_forward_length(128)
    w.add_head_count(n_head)
    w.add_head_count_kv(2)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_uint32("qwen3next.ssm.conv_kernel", conv)
    w.add_uint32("qwen3next.ssm.state_size", hk)
    w.add_uint32("qwen3next.ssm.group_count", nk)
    w.add_uint32("qwen3next.ssm.time_step_rank", nvh)
    w.add_uint32("qwen3next.ssm.inner_size", val_dim)
    w.add_uint32("qwen3next.full_attention_interval", layers.index("a") + 1)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(n_ff)
    w.add_expert_shared_feed_forward_length(n_ff)
    _head(w, rng, n_vocab, n_embd)
    for i, c in enumerate(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", np.ones(n_embd, np.float32))
        if c == "a":
            _attn(w, rng, i, n_embd, n_head, 2, hd, q_gate=True, norms=True)
        else:
            w.add_tensor(f"blk.{i}.ssm_in.weight", _t(rng, 2 * key_dim + 2 * val_dim, n_embd))
            w.add_tensor(f"blk.{i}.ssm_ba.weight", _t(rng, 2 * nvh, n_embd))
            w.add_tensor(f"blk.{i}.ssm_conv1d.weight", _t(rng, 2 * key_dim + val_dim, conv))
            w.add_tensor(f"blk.{i}.ssm_dt.bias", _t(rng, nvh))
            w.add_tensor(f"blk.{i}.ssm_a", -np.abs(_t(rng, nvh, scale=1.0)))
            w.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones(hv, np.float32))
            w.add_tensor(f"blk.{i}.ssm_out.weight", _t(rng, n_embd, val_dim))
        _moe(w, rng, i, n_embd, n_exp, n_ff, bias=False)
        w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", _t(rng, 1, n_embd))
        for t, shape in (("ffn_gate_shexp", (n_ff, n_embd)), ("ffn_up_shexp", (n_ff, n_embd)),
                         ("ffn_down_shexp", (n_embd, n_ff))):
            w.add_tensor(f"blk.{i}.{t}.weight", _t(rng, *shape))
    _finish(w)
    return path


def write_gptoss(path: str, *, n_layer: int = 4, window: int = 32, n_embd: int = 64, seed: int = 17) -> str:
    """A gpt-oss GGUF (MoE, attention sinks, biases) with a ``window``-token sliding window: llama.cpp
    alternates sliding-window and full layers (its iSWA cache)."""
    n_head, n_kv, hd, n_exp, n_ff = 4, 2, 16, 4, 64
    w, n_vocab, rng = _start(path, "gpt-oss", n_layer, n_embd, seed)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_sliding_window(window)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(n_ff)
    _head(w, rng, n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", np.ones(n_embd, np.float32))
        _attn(w, rng, i, n_embd, n_head, n_kv, hd)
        for t, d in (("attn_q", n_head * hd), ("attn_k", n_kv * hd), ("attn_v", n_kv * hd), ("attn_output", n_embd)):
            w.add_tensor(f"blk.{i}.{t}.bias", _t(rng, d))
        w.add_tensor(f"blk.{i}.attn_sinks.weight", _t(rng, n_head))
        _moe(w, rng, i, n_embd, n_exp, n_ff, bias=True)
    _finish(w)
    return path


WRITERS: dict[str, Callable[..., str]] = {
    "llama": write_llama, "lfm2": write_lfm2, "granitehybrid": write_granitehybrid, "nemotron_h": write_nemotron_h,
    "mamba2": write_mamba2, "qwen35": write_qwen35, "qwen3next": write_qwen3next, "gemma3": write_gemma3,
    "gpt-oss": write_gptoss,
}


def text_of(n_words: int, seed: int = 0) -> str:
    """Deterministic text of known vocabulary words (about one token per word)."""
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n_words))


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """The real llama-server (xllamacpp, in process) on 127.0.0.1, with slot save/restore enabled."""

    def __init__(self, model: str, slot_dir: str, *, n_ctx: int = 8192, n_parallel: int = 1,
                 n_ubatch: int = 512, tweak: Callable[[Any], None] | None = None, port: int | None = None,
                 params: dict[str, Any] | None = None, loras: list[tuple[str, float]] | None = None) -> None:
        import xllamacpp as xlc

        p = xlc.CommonParams()
        p.model.path = model
        p.n_ctx = n_ctx * n_parallel
        p.n_parallel = n_parallel
        p.n_batch = 2048
        p.n_ubatch = n_ubatch
        p.cpuparams.n_threads = 1
        p.cpuparams_batch.n_threads = 1
        p.n_gpu_layers = 0
        p.warmup = False
        p.sampling.seed = 1
        p.sampling.temp = 0.0
        p.endpoint_slots = True
        p.endpoint_metrics = True
        p.slot_save_path = os.path.join(slot_dir, "")  # llama-server joins with no separator
        p.kv_unified = False
        p.cache_ram_mib = 0  # no host-RAM prompt cache: a restart really is a restart
        p.verbosity = -1
        adapters = []
        for path, scale in loras or []:  # LoRA adapters (--lora), each at its scale
            a = xlc.CommonAdapterLoraInfo()
            a.path, a.scale = path, scale
            adapters.append(a)
        p.lora_adapters = adapters
        for k, v in (params or {}).items():  # settings by name (JSON-able, so a ServerProcess takes them too)
            setattr(p, k, v)
        if tweak is not None:
            tweak(p)  # a test's own settings (flash attention, K/V types, ...)
        self.port = port or free_port()
        p.port = self.port
        p.hostnames = ["127.0.0.1"]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: Any = xlc.Server(p)
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError("llama-server did not become healthy")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON and return the decoded reply (raises on HTTP errors)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def close(self) -> None:
        """Stop the server (releases its port and threads)."""
        srv, self._server = self._server, None
        if srv is not None:
            del srv
            import gc
            gc.collect()


@contextlib.contextmanager
def llama_server(model: str, slot_dir: str, **kw: Any) -> Iterator[LlamaServer]:
    """A running llama-server, stopped on exit."""
    os.makedirs(slot_dir, exist_ok=True)
    s = LlamaServer(model, slot_dir, **kw)
    try:
        yield s
    finally:
        s.close()


class ServerProcess:
    """llama-server in its own process (a restart is a new process): ``python helpers_llamacpp.py``."""

    def __init__(self, model: str, slot_dir: str, **kw: Any) -> None:
        import subprocess
        import sys

        os.makedirs(slot_dir, exist_ok=True)
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = subprocess.Popen([sys.executable, os.path.join(here, "helpers_llamacpp.py"), model, slot_dir,
                                      json.dumps(kw)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("http://"):
            self.close()
            raise RuntimeError(f"llama-server process did not start: {line!r}")
        self.url = line.strip()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON and return the decoded reply (raises on HTTP errors)."""
        return post(self.url, path, body)

    def close(self) -> None:
        """Stop the process (closing its stdin ends it; killed if it lingers)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST JSON to ``url + path``; the decoded reply."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@contextlib.contextmanager
def server_process(model: str, slot_dir: str, **kw: Any) -> Iterator[ServerProcess]:
    """A llama-server process, stopped on exit."""
    s = ServerProcess(model, slot_dir, **kw)
    try:
        yield s
    finally:
        s.close()


@contextlib.contextmanager
def proxy(bridge: Any) -> Iterator[tuple[str, Any]]:
    """``snapstore llama-proxy``'s app for ``bridge`` on a free 127.0.0.1 port, in a thread; (url, metrics)."""
    import asyncio
    import threading

    from aiohttp import web

    from snapstore.engine.llamacpp._metrics import BridgeMetrics
    from snapstore.engine.llamacpp._proxy import make_app

    metrics = BridgeMetrics()
    bridge.events = metrics.events()
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(make_app(bridge, metrics), access_log=None, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()
        if hasattr(bridge, "settle"):
            bridge.settle()  # the background saves of every request answered


if __name__ == "__main__":  # the body of ServerProcess: serve until stdin closes
    import sys

    _srv = LlamaServer(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3]))
    print(_srv.url, flush=True)
    sys.stdin.read()
    _srv.close()
