"""The torch adapter: any layout / dtype / device through the store, draft component, bounded memory."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support import store_factory  # noqa: E402

import snapstore as ss  # noqa: E402
from snapstore.engine import (  # noqa: E402
    Staging,
    TensorSink,
    TensorSource,
    TorchAdapter,
    canonical,
    dtype_name,
    layout_of,
    part_sink,
    part_source,
    torch_dtype,
)

IDENT = ss.Identity(build="engine-test", pack="sha256:00", kv="bf16")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name: str) -> Any:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(name)


def _rand(shape: tuple[int, ...], dtype: Any, seed: int, device: Any = "cpu") -> Any:
    g = torch.Generator().manual_seed(seed)
    size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape).to(device)


def _sha(t: Any, token_dim: int | None = None, rows: int | None = None) -> str:
    c = canonical(t, token_dim).contiguous()
    if rows is not None:
        c = c[:rows]
    return hashlib.sha256(c.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


_open = store_factory(identity=IDENT, staging_bytes=4 * 4096)


def test_dtype_names_roundtrip() -> None:
    for name in ("bfloat16", "float16", "float32", "int64", "uint8", "bool"):
        assert dtype_name(torch_dtype(name)) == name
    if hasattr(torch, "float8_e4m3fn"):
        assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
        assert dtype_name(torch.float8_e5m2) == "float8_e5m2"
    with pytest.raises(ss.LayoutError):
        torch_dtype("nope")


def test_zero_copy_for_canonical_cpu_tensors() -> None:
    t = _rand((6, 2, 4), torch.bfloat16, 1)
    src = part_source(t, 0)
    assert isinstance(src, np.ndarray) and src.dtype == np.uint8
    assert src.ctypes.data == t.data_ptr()  # a view, not a copy
    assert isinstance(part_source(t.permute(1, 0, 2), 1), np.ndarray)  # token axis moved back: contiguous
    assert isinstance(part_source(_rand((2, 6, 4), torch.float32, 2), 1), TensorSource)
    assert isinstance(part_sink(torch.empty(2, 6, 4), 1), TensorSink)


@pytest.mark.parametrize("device", DEVICES)
def test_any_layout_and_dtype_roundtrip_with_delta(tmp_path: Any, device: str) -> None:
    """Token axis 0/1/2/3, strided views, bf16/fp8/fp16/fp32/int64, fixed parts of any shape, a chain."""
    dev = _device(device)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int64]
    if hasattr(torch, "float8_e4m3fn"):
        dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
    T = 37
    rows: dict[str, Any] = {}
    td: dict[str, int] = {}
    for k, dt in enumerate(dtypes):
        rows[f"kv.t0.{k}"] = _rand((T, 3, 5), dt, 10 + k, dev)  # canonical
        rows[f"kv.t2.{k}"] = _rand((2, 3, T, 7), dt, 20 + k, dev)  # [B, H, T, D]
        td[f"kv.t2.{k}"] = 2
    rows["kv.t3"] = _rand((3, 5, T), torch.bfloat16, 30, dev)  # token axis innermost
    td["kv.t3"] = 2
    base = _rand((T, 9, 4), torch.float32, 31, dev)
    rows["kv.strided"] = base[:, ::3, 1:3]  # a non-contiguous view
    fixed = {"rec": _rand((2, 3, 4, 5), torch.float32, 40, dev), "conv": _rand((3, 6, 4), torch.bfloat16, 41, dev),
             "scalar": _rand((), torch.int64, 42, dev),
             "convT": _rand((6, 3, 4), torch.float16, 43, dev).transpose(0, 1)}
    layout = layout_of(fixed, rows, token_dims=td)
    store = _open(str(tmp_path / "s"), layout=layout)
    ad = TorchAdapter(store, token_dims=td, staging=Staging(64 * 1024))
    toks = list(range(100, 100 + T))
    r1 = ad.save(toks[:20], {**fixed, **rows})
    assert r1.ok
    r2 = ad.save(toks, {**fixed, **rows})
    assert r2.parent_id == r1.snapshot_id
    into = {n: torch.zeros_like(t) for n, t in fixed.items()}
    into.update({n: torch.zeros_like(t) for n, t in rows.items()})
    res = ad.restore(store.match(toks + [1, 2]), into)
    assert res.chain == [r1.snapshot_id, r2.snapshot_id]
    for n, t in {**fixed, **rows}.items():
        assert _sha(into[n], td.get(n, 0) if n in rows else None) == _sha(t, td.get(n, 0) if n in rows else None), n
    # the root restores only its 20 rows into larger destinations
    into2 = {n: torch.zeros_like(t) for n, t in {**fixed, **rows}.items()}
    res2 = ad.restore(store.match(toks[:25]), into2)
    assert res2.n_tokens == 20 and set(res2.rows.values()) == {20}
    for n, t in rows.items():
        assert _sha(into2[n], td.get(n, 0), 20) == _sha(t, td.get(n, 0), 20), n
    assert not ad.staging.allocated or dev.type == "cuda"  # CPU tensors never need the staging buffer
    store.close()


def test_validation_before_writing(tmp_path: Any) -> None:
    kv = _rand((2, 4, 10, 8), torch.bfloat16, 1)
    layout = layout_of(rows={"kv": kv}, token_dims={"kv": 2})
    store = _open(str(tmp_path / "s"), layout=layout)
    ad = TorchAdapter(store, token_dims={"kv": 2})
    with pytest.raises(ss.LayoutError):
        ad.save(list(range(10)), {"kv": kv.float()})  # wrong dtype
    with pytest.raises(ss.LayoutError):
        ad.save(list(range(10)), {"kv": kv}, token_dims={"kv": 1})  # wrong axis -> wrong row shape
    with pytest.raises(ss.LayoutError):
        ad.save(list(range(11)), {"kv": kv})  # not enough rows
    assert ad.save(list(range(10)), {"kv": kv}).ok
    m = store.match(list(range(12)))
    sentinel = torch.full((2, 4, 10, 8), 7.0, dtype=torch.float32)
    with pytest.raises(ss.DestinationError):
        ad.restore(m, {"kv": sentinel})
    assert bool((sentinel == 7.0).all())
    small = torch.full((2, 4, 9, 8), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ss.DestinationError):
        ad.restore(m, {"kv": small})  # 9 rows < 10
    assert bool((small == 7.0).all())
    store.close()


def test_sliding_window_padding_source(tmp_path: Any) -> None:
    """A fixed-capacity window that is not full yet: rows past the tensor read as zeros."""
    win = _rand((1, 2, 3, 4), torch.float32, 5)  # 3 valid rows of a 6-row window
    src = TensorSource(win, 2, pad_rows=6)
    buf = bytearray(src.nbytes)
    src.read_into(0, memoryview(buf))
    c = canonical(win, 2).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(buf[:len(c)]) == c and not any(buf[len(c):])
    part = bytearray(40)
    src.read_into(len(c) - 20, memoryview(part))
    assert bytes(part) == bytes(buf[len(c) - 20:len(c) + 20])


@pytest.mark.parametrize("saved_with_draft", [True, False])
@pytest.mark.parametrize("ask_draft", [True, False])
def test_draft_component_four_directions(tmp_path: Any, saved_with_draft: bool, ask_draft: bool) -> None:
    target = {"kv": _rand((2, 12, 4), torch.bfloat16, 1), "rec": _rand((3, 4), torch.float32, 2)}
    draft = {"mtp.kv": _rand((2, 12, 2), torch.bfloat16, 3), "mtp.state": _rand((5,), torch.float32, 4)}
    td = {"kv": 1, "mtp.kv": 1}
    layout = layout_of(fixed={"rec": target["rec"], "mtp.state": draft["mtp.state"]},
                       rows={"kv": target["kv"], "mtp.kv": draft["mtp.kv"]}, token_dims=td,
                       components={"mtp.kv": "draft", "mtp.state": "draft"})
    store = _open(str(tmp_path / "s"), layout=layout)
    ad = TorchAdapter(store, token_dims=td)
    toks = list(range(12))
    parts = {**target, **draft} if saved_with_draft else dict(target)
    assert ad.save(toks, parts).ok
    into = {n: torch.zeros_like(t) for n, t in {**target, **draft}.items()}
    if not ask_draft:
        into = {n: into[n] for n in target}
    res = ad.restore(store.match(toks), into, components=None if ask_draft else [])
    for n, t in target.items():
        assert torch.equal(into[n].view(torch.uint8), t.view(torch.uint8))
    if ask_draft and saved_with_draft:
        assert res.missing_components == frozenset()
        for n, t in draft.items():
            assert torch.equal(into[n].view(torch.uint8), t.view(torch.uint8))
    elif ask_draft:
        assert res.missing_components == {"draft"}
        assert not any(bool(into[n].view(torch.uint8).any()) for n in draft)  # left empty
    else:
        assert res.missing_components == frozenset() and set(res.rows) == {"kv"}
    store.close()


PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, tempfile
    import torch
    import snapstore as ss
    from snapstore.engine import TorchAdapter, layout_of
    T, B, H, D = 4096, 2, 8, 256          # 2 x 64 MiB of bf16 K/V, token axis 2 (strided path)
    k = torch.randn(B, H, T, D).to(torch.bfloat16); v = torch.randn(B, H, T, D).to(torch.bfloat16)
    rec = torch.randn(16, 256, 256)        # 4 MiB fixed
    dk, dv, drec = (torch.empty_like(x).fill_(1) for x in (k, v, rec))  # touched: pages count before
    layout = layout_of({"rec": rec}, {"k": k, "v": v}, token_dims={"k": 2, "v": 2})
    store = ss.Store.open(sys.argv[1], identity=ss.Identity(build="b", pack="p"), layout=layout,
                          budget=ss.Budget(reserve_bytes=0, ram_bytes=0), chunk_bytes=2 << 20,
                          staging_bytes=8 << 20)  # RAM tier off: it keeps chunks on purpose
    ad = TorchAdapter(store, token_dims={"k": 2, "v": 2}, staging=8 << 20)
    kb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base = kb()
    toks = list(range(T))
    assert ad.save(toks, {"k": k, "v": v, "rec": rec}).ok
    after_save = kb()
    ad.restore(store.match(toks), {"k": dk, "v": dv, "rec": drec})
    after_restore = kb()
    ok = torch.equal(dk.view(torch.int16), k.view(torch.int16)) and torch.equal(dv.view(torch.int16),
         v.view(torch.int16)) and torch.equal(drec, rec)
    print(json.dumps({"base": base, "save": after_save - base, "restore": after_restore - base, "ok": ok}))
""")


@pytest.mark.slow  # a child process moves 132 MiB
def test_peak_memory_bounded_by_staging(tmp_path: Any) -> None:
    """132 MiB through the strided path with 8 MiB of staging: peak RSS grows by staging + a constant."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"]
    assert r["save"] < 40 * 1024 and r["restore"] < 40 * 1024, r  # KiB; the state is 132 MiB


def test_uint8_parts_roundtrip(tmp_path: Any) -> None:
    """Quantized (uint8) K/V and state pass through the adapter's flat byte views."""
    fixed = {"q.state": _rand((4, 16), torch.uint8, 1)}
    rows = {"q.kv": _rand((50, 8), torch.uint8, 2)}
    layout = layout_of(fixed=fixed, rows=rows)
    with _open(str(tmp_path / "s"), layout=layout) as store:
        ad = TorchAdapter(store)
        r = ad.save(list(range(50)), {**fixed, **rows})
        assert r.ok
        dst = {"q.state": torch.zeros(4, 16, dtype=torch.uint8), "q.kv": torch.zeros(50, 8, dtype=torch.uint8)}
        ad.restore(store.match(list(range(50))), dst)
        assert torch.equal(dst["q.state"], fixed["q.state"]) and torch.equal(dst["q.kv"], rows["q.kv"])
