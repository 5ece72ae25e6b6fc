"""The cache shape of a GGUF model (:class:`ModelShape`), read from the GGUF's own metadata.

No list of architectures: what each layer keeps in a llama-server slot follows from the tensors
the layer has and the hyperparameters the file declares, which is what llama.cpp builds its
memory from.

- A layer keeps **recurrent state** when it has a state-bearing tensor: a convolution over past
  tokens (``ssm_conv1d``: Mamba, Mamba2 and gated-delta-net layers; ``shortconv.conv``: LFM2) or
  RWKV's ``time_mix_*``.
- A layer keeps **attention K/V** when it has a key projection (``attn_k``, MLA's ``attn_k_b`` /
  ``attn_kv_a_mqa``, or a fused ``attn_qkv`` on a layer that is not recurrent — gated-delta-net
  layers call their fused projection that too) and its ``head_count_kv`` entry is not 0.
- ``attention.sliding_window`` > 0 declares a sliding window: the slot may then carry llama.cpp's
  iSWA layout (a full-attention and a sliding-window cache, split as each file says).
- Row widths, where the hyperparameters give them, are checked against every file: K/V as
  ``head_count_kv × key_length`` / ``value_length``; a Mamba-style state as
  ``(conv_kernel − 1) × (inner_size + 2 × group_count × state_size)`` conv elements and
  ``state_size × inner_size`` SSM elements (gated-delta-net included); LFM2's as
  ``(l_cache − 1) × embedding_length``. Others are taken as each file writes them (its identity
  pins them).
"""

from __future__ import annotations

import re
from typing import Any

from snapstore import InvalidInputError

from ._slotmodel import ModelShape

__all__ = ["shape_of"]

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_STATE_TENSORS = ("ssm_conv1d", "shortconv.conv", "time_mix_")
_KEY_TENSORS = ("attn_k.", "attn_k_b.", "attn_kv_a_mqa.")


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _int(reader: Any, key: str) -> int:
    v = _field(reader, key)
    return int(v) if isinstance(v, int) else 0


def shape_of(reader: Any, path: str) -> ModelShape:
    """The cache shape of the GGUF ``reader`` (a ``gguf.GGUFReader`` of ``path``)."""
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise InvalidInputError(f"{path}: GGUF without general.architecture")
    n_layer = _field(reader, f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer <= 0:
        raise InvalidInputError(f"{path}: GGUF without {arch}.block_count")
    names: dict[int, list[str]] = {}
    for t in reader.tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) < n_layer:
            names.setdefault(int(m.group(1)), []).append(m.group(2))
    kvh = _field(reader, f"{arch}.attention.head_count_kv")
    if kvh is None:
        kvh = _field(reader, f"{arch}.attention.head_count")
    per_layer = list(kvh) if isinstance(kvh, list) else [kvh or 0] * n_layer
    if len(per_layer) != n_layer:
        raise InvalidInputError(f"{path}: head_count_kv has {len(per_layer)} entries for {n_layer} layers")
    rec = tuple(i for i in range(n_layer) if any(n.startswith(_STATE_TENSORS) for n in names.get(i, ())))
    attn = tuple(i for i in range(n_layer) if per_layer[i] != 0 and any(
        n.startswith(_KEY_TENSORS) or (n.startswith("attn_qkv.") and i not in rec) for n in names.get(i, ())))
    n_embd = _int(reader, f"{arch}.embedding_length")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head = int(n_head[0] if isinstance(n_head, list) else n_head or 0)
    hd_k = _int(reader, f"{arch}.attention.key_length") or (n_embd // n_head if n_embd and n_head else 0)
    hd_v = _int(reader, f"{arch}.attention.value_length") or hd_k
    if _field(reader, f"{arch}.attention.kv_lora_rank") is not None:
        hd_k = hd_v = 0  # MLA caches a compressed latent: taken as the file writes it
    widths = tuple((int(per_layer[i]) * hd_k, int(per_layer[i]) * hd_v) for i in attn)
    rec_w = (0, 0)
    if rec:
        d_conv = _int(reader, f"{arch}.ssm.conv_kernel")
        l_cache = _int(reader, f"{arch}.shortconv.l_cache")
        if d_conv:
            inner, state = _int(reader, f"{arch}.ssm.inner_size"), _int(reader, f"{arch}.ssm.state_size")
            groups = _int(reader, f"{arch}.ssm.group_count")
            rec_w = ((d_conv - 1) * (inner + 2 * groups * state), state * inner)
        elif l_cache:
            rec_w = ((l_cache - 1) * n_embd, 0)
    n_swa = _int(reader, f"{arch}.attention.sliding_window")
    return ModelShape(arch, n_layer, attn, rec, widths, rec_w, n_swa if attn else 0)
