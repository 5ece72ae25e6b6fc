"""hf helpers on the device path: weights_sha256 through a bounded buffer, hf.restore with a per-layer device map."""

from __future__ import annotations

import hashlib
import tracemalloc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import snapstore as ss  # noqa: E402
from snapstore.engine import hf  # noqa: E402

pytestmark = pytest.mark.slow  # transformers models built at test time: the slow tier


def _reference_sha(model: Any) -> str:
    """The weights hash as defined: name|dtype|shape| then the C-order bytes, parameter by parameter."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        c = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu())
        h.update(bytes(c.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(512, 1024)  # 2 MiB of float32 weights
        self.register_buffer("strided", torch.randn(64, 256).t())  # a non-contiguous buffer
        self.register_buffer("one", torch.arange(20, dtype=torch.float32).view(4, 5).t()[3:4, 1:2])
        self.register_buffer("bf16", torch.randn(33, 7).to(torch.bfloat16))


def test_weights_sha256_streams_through_a_bounded_buffer() -> None:
    """The hash is the defined one, and no chunk-sized host copy is made per chunk (no .tobytes())."""
    model = _Tiny()
    want = _reference_sha(model)
    chunk = 256 << 10
    tracemalloc.start()
    try:
        got = hf.weights_sha256(model, chunk=chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == want
    assert peak < chunk // 2, f"{peak} bytes of Python/numpy allocations for a {chunk}-byte chunk"


@pytest.fixture(scope="module")
def llama() -> Any:
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      vocab_size=128, num_hidden_layers=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@torch.no_grad()
def test_restore_with_a_per_layer_device_map(llama: Any, tmp_path: Any) -> None:
    """device={layer: device} puts each layer's state on its own device (a model split across
    devices); a map missing a layer is refused before anything is written."""
    ad = hf.open_store(llama, str(tmp_path / "s"), budget=ss.Budget(reserve_bytes=0))
    toks = list(range(5, 17))
    cache = llama(torch.tensor([toks]), use_cache=True).past_key_values
    res = hf.save(ad, cache, toks)
    assert res.ok
    m = ad.store.match(toks + [3])
    with pytest.raises(ss.DestinationError, match="layer"):
        hf.restore(llama.config, ad, m, device={0: "cpu"})
    # "meta" stands in for a second device here: it allocates nothing and takes any copy
    c2, _ = hf.restore(llama.config, ad, m, device={0: "cpu", 1: "meta"})
    assert c2.layers[0].keys.device.type == "cpu" and c2.layers[1].keys.device.type == "meta"
    c3, _ = hf.restore(llama.config, ad, m, device=["cpu", "cpu"])
    for a, b in zip(cache.layers, c3.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    ad.store.close()


@pytest.mark.gpu
@torch.no_grad()
def test_restore_per_layer_map_on_cuda(llama: Any, tmp_path: Any) -> None:
    """On a GPU: a layer on cuda and a layer on the CPU restore exactly."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ad = hf.open_store(llama, str(tmp_path / "s"), budget=ss.Budget(reserve_bytes=0))
    toks = list(range(5, 17))
    cache = llama(torch.tensor([toks]), use_cache=True).past_key_values
    hf.save(ad, cache, toks)
    c2, _ = hf.restore(llama.config, ad, ad.store.match(toks), device={0: "cuda", 1: "cpu"})
    assert c2.layers[0].keys.device.type == "cuda"
    for a, b in zip(cache.layers, c2.layers):
        assert torch.equal(a.keys, b.keys.cpu()) and torch.equal(a.values, b.values.cpu())
    ad.store.close()
