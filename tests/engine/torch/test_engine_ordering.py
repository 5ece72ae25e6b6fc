"""The adapter's device path under a late-execution stream model (and on a real GPU when present).

Every queued copy runs only when an event, a ``wait_stream`` or a synchronise forces it (see
tests/stream_model.py), so each ordering rule the device path must keep is tested here on CPU: a
rule broken serves wrong bytes or leaves a recorded hazard. The ``cuda`` variants run the same
tests against ``torch.cuda`` when a GPU is present (launched kernels are delayed by a spin).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stream_model import CudaHarness, LateCuda  # noqa: E402
from support import store_factory  # noqa: E402

import snapstore as ss  # noqa: E402
from snapstore.engine import Staging, TensorSink, TensorSource, TorchAdapter, canonical, layout_of  # noqa: E402

IDENT = ss.Identity(build="ordering-test", pack="sha256:00", kv="bf16")


def _harness(name: str) -> Any:
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return CudaHarness()
    return LateCuda(seed=7)


@pytest.fixture(params=["late", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request: Any) -> Any:
    """A device harness: the late-execution model, or the real GPU."""
    return _harness(request.param)


@pytest.fixture
def late() -> LateCuda:
    """The late-execution model only (fault injection, hazard records)."""
    return LateCuda(seed=11)


def _backend(h: Any) -> Any:
    return h if isinstance(h, LateCuda) else h.backend


def _rand(shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _canon(t: Any, td: int | None, rows: int | None = None) -> bytes:
    c = canonical(t.detach().cpu(), td)
    c = torch.empty(c.shape, dtype=c.dtype).copy_(c)  # fresh C-order strides (even for one element)
    if rows is not None:
        c = c[:rows]
    return bytes(c.reshape(-1).view(torch.uint8).numpy().tobytes())


def _flat(t: Any, td: int | None) -> Any:
    return canonical(t, td).contiguous().reshape(-1).view(torch.uint8).numpy()


# Raw chunks written buffered by default: the chunker then hashes and writes straight from the
# staging half a device source lends (with O_DIRECT it copies into its slot).
_open = store_factory(identity=IDENT, budget=ss.Budget(reserve_bytes=0, ram_bytes=0), staging_bytes=4 * 4096,
                      check_rows=False, direct_io=False)


def _adapter(store: ss.Store, h: Any, td: dict[str, int], nbytes: int = 2 * 4096) -> TorchAdapter:
    return TorchAdapter(store, token_dims=td, staging=Staging(nbytes, backend=_backend(h)))


def _kv_setup(h: Any, tmp_path: Any, T: int = 96, chunk: int = 4096, stage: int = 4 * 4096) -> Any:
    """A [B, H, T, D] bf16 arena (token axis 2: the strided path) and a float32 fixed state."""
    kv_cpu = _rand((2, 3, T, 10), torch.bfloat16, 1)
    rec_cpu = _rand((5, 7, 9), torch.float32, 2)
    layout = layout_of({"rec": rec_cpu}, {"kv": kv_cpu}, token_dims={"kv": 2})
    store = _open(tmp_path / "s", layout=layout, chunk_bytes=chunk, staging_bytes=stage)
    return kv_cpu, rec_cpu, layout, store


@pytest.mark.parametrize("nbytes,chunk", [(2 * 4096, 4096), (6 * 4096, 4096), (2 * 4096, 3 * 4096),
                                          (10 * 4096, 2 * 4096), (64 * 1024, 4096), (3 * 4096, 8192)])
def test_double_buffered_roundtrip_exact(dev: Any, tmp_path: Any, nbytes: int, chunk: int) -> None:
    """The normal path: a chain save and a restore through the staging halves are byte-exact."""
    kv_cpu, rec_cpu, layout, store = _kv_setup(dev, tmp_path, chunk=chunk, stage=max(4 * 4096, 2 * chunk))
    kv, rec = dev.to_device(kv_cpu), dev.to_device(rec_cpu)
    ad = _adapter(store, dev, {"kv": 2}, nbytes)
    toks = list(range(96))
    r1 = ad.save(toks[:40], {"kv": kv, "rec": rec}, rows=40)
    r2 = ad.save(toks, {"kv": kv, "rec": rec})
    assert r1.ok and r2.ok and r2.parent_id == r1.snapshot_id
    dk, dr = dev.empty(tuple(kv.shape), kv.dtype), dev.empty(tuple(rec.shape), rec.dtype)
    ad.restore(store.match(toks), {"kv": dk, "rec": dr})
    assert _canon(dev.host(dk), 2) == _canon(kv_cpu, 2) and _canon(dev.host(dr), None) == _canon(rec_cpu, None)
    assert not dev.hazards
    store.close()


# -- item 1: the speculative prefetch -------------------------------------------------------
def test_reused_source_never_serves_a_stale_prefetch(dev: Any, tmp_path: Any) -> None:
    """Same TensorSource, two Store.save calls: the second delta's first range is read after the
    engine wrote it, not served from a prefetch copied before."""
    kv_cpu, rec_cpu, layout, store = _kv_setup(dev, tmp_path, T=64)
    kv = dev.to_device(torch.zeros_like(kv_cpu))
    kv[:, :, :32].copy_(dev.to_device(kv_cpu[:, :, :32].contiguous()))
    staging = Staging(2 * 4096, backend=_backend(dev))
    src = TensorSource(kv, 2, staging)
    toks = list(range(64))
    r1 = store.save(toks[:32], {"kv": src, "rec": rec_cpu.numpy()}, rows=32)
    # the engine writes rows 32..63 with a kernel on its compute stream, then saves the delta
    new_rows = dev.to_device(kv_cpu[:, :, 32:].contiguous())
    dev.launch(lambda: kv[:, :, 32:].copy_(new_rows))
    r2 = store.save(toks, {"kv": src, "rec": rec_cpu.numpy()}, rows=64)
    assert r2.parent_id == r1.snapshot_id
    staging.synchronize()
    out = {"kv": torch.zeros_like(kv_cpu), "rec": torch.zeros_like(rec_cpu)}
    TorchAdapter(store, token_dims={"kv": 2}).restore(store.match(toks), out)
    assert _canon(out["kv"], 2) == _canon(kv_cpu, 2)
    store.close()


def test_prefetch_capped_at_saved_rows(late: LateCuda, tmp_path: Any) -> None:
    """A save moves each saved byte device->host once: no prefetch past a part's saved rows."""
    parts_cpu = {f"kv{i}": _rand((2, 96, 10), torch.bfloat16, 10 + i) for i in range(4)}
    td = {n: 1 for n in parts_cpu}
    layout = layout_of(rows=parts_cpu, token_dims=td)
    store = _open(tmp_path / "s", layout=layout)
    ad = _adapter(store, late, td)
    parts = {n: late.to_device(t) for n, t in parts_cpu.items()}
    res = ad.save(list(range(50)), parts, rows=50)
    assert res.ok
    assert late.d2h_bytes == res.logical_bytes == 4 * 50 * 2 * 10 * 2
    store.close()


# -- item 2: wait for the engine's stream on every call -------------------------------------
def test_reused_source_waits_for_the_compute_stream_every_call(dev: Any, tmp_path: Any) -> None:
    """A fixed part's TensorSource reused for a second save sees the kernel that rewrote it."""
    kv_cpu, rec_cpu, layout, store = _kv_setup(dev, tmp_path, T=8)
    rec = dev.to_device(rec_cpu)
    staging = Staging(2 * 4096, backend=_backend(dev))
    src = TensorSource(rec, None, staging)
    assert store.save([1, 2], {"kv": _flat(kv_cpu, 2), "rec": src}, rows=2).ok
    staging.synchronize()
    rec2_cpu = _rand(tuple(rec_cpu.shape), torch.float32, 99)
    rec2 = dev.to_device(rec2_cpu)
    dev.launch(lambda: rec.copy_(rec2))  # the next forward updates the state in place
    res = store.save([1, 2, 3], {"kv": _flat(kv_cpu, 2), "rec": src}, rows=3, parent=None)
    staging.synchronize()
    out = {"kv": torch.zeros_like(kv_cpu), "rec": torch.zeros_like(rec_cpu)}
    TorchAdapter(store, token_dims={"kv": 2}).restore(res, out)
    assert _canon(out["rec"], None) == _canon(rec2_cpu, None)
    store.close()


def test_reused_sink_waits_for_a_queued_zero(dev: Any, tmp_path: Any) -> None:
    """A TensorSink reused for a second restore: the engine's queued zero_() runs before the copies."""
    kv_cpu, rec_cpu, layout, store = _kv_setup(dev, tmp_path, T=8)
    res = store.save(list(range(8)), {"kv": _flat(kv_cpu, 2), "rec": rec_cpu.numpy()})
    rec = dev.empty(tuple(rec_cpu.shape), torch.float32)
    staging = Staging(2 * 4096, backend=_backend(dev))
    sink = TensorSink(rec, None, staging)
    kvd = torch.zeros_like(kv_cpu)
    store.restore(res, {"kv": TensorSink(kvd, 2), "rec": sink})
    sink.finish()
    assert _canon(dev.host(rec), None) == _canon(rec_cpu, None)
    dev.launch(lambda: rec.zero_())  # the engine resets its state, then restores again
    store.restore(res, {"kv": TensorSink(kvd, 2), "rec": sink})
    sink.finish()
    assert _canon(dev.host(rec), None) == _canon(rec_cpu, None)
    store.close()


def test_stream_keyword_names_the_engines_stream(dev: Any, tmp_path: Any) -> None:
    """An engine whose forward runs on its own stream passes it: save waits for it, restore is
    ordered after its queued work and before its next kernels."""
    kv_cpu, rec_cpu, layout, store = _kv_setup(dev, tmp_path, T=48)
    ad = _adapter(store, dev, {"kv": 2})
    s = dev.new_engine_stream()
    kv, rec = dev.empty(tuple(kv_cpu.shape), kv_cpu.dtype), dev.empty(tuple(rec_cpu.shape), torch.float32)
    kv_src, rec_src = dev.to_device(kv_cpu), dev.to_device(rec_cpu)
    dev.launch(lambda: (kv.copy_(kv_src), rec.copy_(rec_src)), stream=s)  # the forward, on the engine's stream
    res = ad.save(list(range(48)), {"kv": kv, "rec": rec}, stream=s)  # called outside that stream's context
    assert res.ok
    dk, dr = dev.empty(tuple(kv.shape), kv.dtype), dev.empty(tuple(rec.shape), torch.float32)
    dev.launch(lambda: (dk.zero_(), dr.zero_()), stream=s)  # the engine reset its buffers on its stream
    ad.restore(res, {"kv": dk, "rec": dr}, stream=s)
    seen = dev.empty(tuple(dr.shape), torch.float32)
    dev.launch(lambda: seen.copy_(dr), stream=s)  # the next forward reads the restored state
    assert _canon(dev.host(dk), 2) == _canon(kv_cpu, 2)
    assert _canon(dev.host(seen), None) == _canon(rec_cpu, None)
    store.close()


# -- item 3 and 5: errors mid-transfer ------------------------------------------------------
def _two_snapshots(late: LateCuda, tmp_path: Any) -> Any:
    kv_a, rec_cpu, layout, store = _kv_setup(late, tmp_path, T=64)
    kv_b = _rand(tuple(kv_a.shape), torch.bfloat16, 77)
    ad = _adapter(store, late, {"kv": 2})
    ra = ad.save(list(range(64)), {"kv": late.to_device(kv_a), "rec": late.to_device(rec_cpu)})
    rb = ad.save(list(range(100, 164)), {"kv": late.to_device(kv_b), "rec": late.to_device(rec_cpu)})
    return kv_a, kv_b, rec_cpu, store, ad, ra, rb


def test_device_error_mid_restore_is_a_touched_restore_error(late: LateCuda, tmp_path: Any) -> None:
    """A device OOM after some copies were queued: RestoreError(touched=True), nothing left queued."""
    kv_a, kv_b, rec_cpu, store, ad, ra, rb = _two_snapshots(late, tmp_path)
    dk, dr = late.empty(tuple(kv_a.shape), kv_a.dtype), late.empty(tuple(rec_cpu.shape), torch.float32)
    late.fail_at = late.copies + 3  # mid-chunk: a chunk edge falls inside a row, so a chunk is several copies
    with pytest.raises(ss.RestoreError) as ei:
        ad.restore(ra, {"kv": dk, "rec": dr})
    assert ei.value.touched and isinstance(ei.value.__cause__, torch.OutOfMemoryError)
    assert "re-read the prompt" in str(ei.value)
    late.fail_at = None
    assert all(s.done == s.queued for s in late.streams if s is not late.compute)  # side streams drained
    store.close()


def test_orphaned_copies_do_not_land_on_a_later_restore(late: LateCuda, tmp_path: Any) -> None:
    """Copies queued before an error are drained before it propagates: a later, successful restore
    of another snapshot into the same tensors, through other sinks and staging, is exact."""
    kv_a, kv_b, rec_cpu, store, ad, ra, rb = _two_snapshots(late, tmp_path)
    dk, dr = late.empty(tuple(kv_a.shape), kv_a.dtype), late.empty(tuple(rec_cpu.shape), torch.float32)
    st1 = Staging(2 * 4096, backend=late)
    late.fail_at = late.copies + 3  # rec is one copy; then kv's first chunk: whole rows, then a partial row
    with pytest.raises(BaseException):  # noqa: B017 - the raw error on old code, RestoreError after
        store.restore(ra, {"kv": TensorSink(dk, 2, st1), "rec": TensorSink(dr, None, st1)})
    late.fail_at = None
    st2 = Staging(2 * 4096, backend=late)  # e.g. hf.restore(config, store, m): a new adapter and staging
    sinks = {"kv": TensorSink(dk, 2, st2), "rec": TensorSink(dr, None, st2)}
    store.restore(rb, sinks)
    for s in sinks.values():
        s.finish()
    assert _canon(late.host(dk), 2) == _canon(kv_b, 2)
    store.close()


def test_copies_queued_before_an_error_are_fenced(late: LateCuda, tmp_path: Any) -> None:
    """A TensorSink whose write raised mid-chunk: the next write into that half waits for the
    copies already queued from it (the event is recorded in a finally), no host/device race."""
    t = late.empty((40, 3, 10), torch.bfloat16)
    staging = Staging(2 * 4096, backend=late)
    sink = TensorSink(t.transpose(0, 1), 0, staging)  # strided: a write of 1000 bytes is two copies
    data = _rand((40, 3, 10), torch.bfloat16, 5)
    raw = memoryview(_flat(data.transpose(0, 1), 0))
    late.fail_at = late.copies + 2
    with pytest.raises(BaseException):  # noqa: B017
        sink.write_from(0, raw[:1000])
    late.fail_at = None
    for off in range(0, len(raw), 1000):
        sink.write_from(off, raw[off:off + 1000])
    sink.finish()
    assert not late.hazards
    assert _canon(late.host(t), 0) == _canon(data, 0)
    assert late.copies > 4


# -- item 4: close() during a save ------------------------------------------------------------
def test_close_during_save_waits_for_the_save(late: LateCuda, tmp_path: Any) -> None:
    """close() from another thread while a save is copying blocks until the save is done."""
    kv_cpu, rec_cpu, layout, store = _kv_setup(late, tmp_path, T=96)
    ad = _adapter(store, late, {"kv": 2})
    kv, rec = late.to_device(kv_cpu), late.to_device(rec_cpu)
    paused, go = threading.Event(), threading.Event()

    def hook(n: int) -> None:
        if n == 6 and threading.current_thread().name == "saver":
            paused.set()
            go.wait(10)

    late.on_copy = hook
    out: dict[str, Any] = {}
    saver = threading.Thread(target=lambda: out.update(res=ad.save(list(range(96)), {"kv": kv, "rec": rec})),
                             name="saver")
    saver.start()
    assert paused.wait(10)
    closer = threading.Thread(target=ad.close, name="closer")
    closer.start()
    time.sleep(0.2)
    closed_early = not closer.is_alive()
    go.set()
    saver.join(10)
    closer.join(10)
    late.on_copy = None
    assert not closed_early, "close() released the staging buffer under a running save"
    dk, dr = torch.zeros_like(kv_cpu), torch.zeros_like(rec_cpu)
    TorchAdapter(store, token_dims={"kv": 2}).restore(out["res"], {"kv": dk, "rec": dr})
    assert _canon(dk, 2) == _canon(kv_cpu, 2) and _canon(dr, None) == _canon(rec_cpu, None)
    store.close()


# -- item 5: self-overlapping destinations ----------------------------------------------------
@pytest.mark.parametrize("where", ["cpu", "late"])
def test_self_overlapping_destination_refused_before_writing(where: str, tmp_path: Any) -> None:
    """expand()/stride-0 destinations: DestinationError, nothing written."""
    h = LateCuda() if where == "late" else None
    kv_cpu, rec_cpu, layout, store = _kv_setup(h, tmp_path, T=8)
    ad = TorchAdapter(store, token_dims={"kv": 2}, staging=Staging(2 * 4096, backend=h))
    res = ad.save(list(range(8)), {"kv": kv_cpu, "rec": rec_cpu})
    base = torch.full((5, 1, 9), 7.0)
    if h is not None:
        base = h.to_device(base)
    dr = base.expand(5, 7, 9)
    dk = torch.zeros_like(kv_cpu)
    with pytest.raises(ss.DestinationError) as ei:
        ad.restore(res, {"kv": dk, "rec": dr})
    assert not ei.value.touched
    assert bool((base == 7.0).all()) and not bool(dk.any())
    store.close()


# -- item 6: crashes on valid input -----------------------------------------------------------
@pytest.mark.parametrize("nbytes", [3 * 4096 + 2, 2 * 6145, 5 * 4096 + 1, 2 * 4096 + 6])
def test_staging_of_any_size(late: LateCuda, tmp_path: Any, nbytes: int) -> None:
    """Staging(int) halves are rounded to 4096, so strided copies into half 1 stay aligned."""
    st = Staging(nbytes, backend=late)
    assert st.half % 4096 == 0 and st.nbytes == 2 * st.half <= nbytes
    kv_cpu, rec_cpu, layout, store = _kv_setup(late, tmp_path, T=96)
    ad = TorchAdapter(store, token_dims={"kv": 2}, staging=st)
    res = ad.save(list(range(96)), {"kv": late.to_device(kv_cpu), "rec": late.to_device(rec_cpu)})
    dk, dr = late.empty(tuple(kv_cpu.shape), kv_cpu.dtype), late.empty(tuple(rec_cpu.shape), torch.float32)
    ad.restore(res, {"kv": dk, "rec": dr})
    assert _canon(late.host(dk), 2) == _canon(kv_cpu, 2) and _canon(late.host(dr), None) == _canon(rec_cpu, None)
    store.close()


@pytest.mark.parametrize("where", ["cpu", "late"])
def test_one_element_view_with_an_odd_last_stride(where: str, tmp_path: Any) -> None:
    """t.t()[3:4, 1:2]: one element, "contiguous", last stride 5: saved and restored exactly."""
    h = LateCuda() if where == "late" else None
    base = _rand((4, 5), torch.float32, 3)
    if h is not None:
        base = h.to_device(base)
    x = base.t()[3:4, 1:2]
    assert x.stride()[-1] != 1 and x.numel() == 1
    layout = layout_of({"one": x})
    store = _open(tmp_path / "s", layout=layout)
    ad = TorchAdapter(store, staging=Staging(2 * 4096, backend=h))
    res = ad.save([1], {"one": x})
    dst_base = torch.zeros(4, 5)
    if h is not None:
        dst_base = h.to_device(dst_base)
    dst = dst_base.t()[3:4, 1:2]
    ad.restore(res, {"one": dst})
    got = h.host(dst) if h is not None else dst
    assert _canon(got, None) == _canon(x, None)
    store.close()


@pytest.mark.parametrize("where", ["cpu", "late"])
def test_conjugate_views_refused_clearly(where: str, tmp_path: Any) -> None:
    """A lazy conjugate view (is_conj()): LayoutError / DestinationError naming resolve_conj()."""
    h = LateCuda() if where == "late" else None
    z = _rand((6, 4), torch.complex64, 4)
    if h is not None:
        z = h.to_device(z)
    layout = layout_of({"z": z})
    store = _open(tmp_path / "s", layout=layout)
    ad = TorchAdapter(store, staging=Staging(2 * 4096, backend=h))
    with pytest.raises(ss.LayoutError, match="resolve_conj"):
        ad.save([1], {"z": z.conj()})
    res = ad.save([1], {"z": z})
    dst = torch.zeros_like(z)
    with pytest.raises(ss.DestinationError, match="resolve_conj") as ei:
        ad.restore(res, {"z": dst.conj()})
    assert not ei.value.touched and not bool(dst.view(torch.uint8).any())
    store.close()


# -- item 7: one shared staging for staging=None ------------------------------------------------
def test_staging_none_shares_one_pinned_buffer(late: LateCuda, tmp_path: Any) -> None:
    """Device parts without a staging share one (pinned) buffer, not one per part."""
    from snapstore.engine.torch._device_staging import shared_staging
    parts_cpu = {f"kv{i}": _rand((24, 3, 10), torch.bfloat16, 30 + i) for i in range(8)}
    layout = layout_of(rows=parts_cpu)
    store = _open(tmp_path / "s", layout=layout)
    srcs = {n: TensorSource(late.to_device(t), 0, backend=late) for n, t in parts_cpu.items()}
    assert len({id(s.staging) for s in srcs.values()}) == 1 and srcs["kv0"].staging is shared_staging(late)
    res = store.save(list(range(24)), srcs)
    assert res.ok and late.pinned_allocs == 1
    dst = {n: late.empty(tuple(t.shape), t.dtype) for n, t in parts_cpu.items()}
    sinks = {n: TensorSink(t, 0, backend=late) for n, t in dst.items()}
    store.restore(res, sinks)
    for s in sinks.values():
        s.finish()
    assert late.pinned_allocs == 1
    for n, t in parts_cpu.items():
        assert _canon(late.host(dst[n]), 0) == _canon(t, 0)
    store.close()


# -- item 7: the core reads / writes the pinned half in place -----------------------------------
def _disk_bytes(store: ss.Store) -> int:
    return sum(os.stat(p).st_size for _, p in store._repo.blob_files())


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_one_host_memcpy_per_chunk_each_way(late: LateCuda, tmp_path: Any, codec: str) -> None:
    """Save hashes/writes each chunk straight from the pinned half its device->host copy landed in;
    restore reads/decompresses each chunk straight into a pinned half: no staging<->core memcpy
    (2 host memcpys per chunk -> 1: only the core's own file write/read), bytes exact, no hazard."""
    kv_cpu, rec_cpu, _, _ = _kv_setup(None, tmp_path / "unused", T=96)
    layout = layout_of({"rec": rec_cpu}, {"kv": kv_cpu}, token_dims={"kv": 2})
    store = ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=layout,
                          budget=ss.Budget(reserve_bytes=0, ram_bytes=0), chunk_bytes=4096,
                          staging_bytes=4 * 4096, check_rows=False, direct_io=False, codec=codec)
    ad = _adapter(store, late, {"kv": 2})  # halves of 4096 bytes: every chunk fits one
    res = ad.save(list(range(96)), {"kv": late.to_device(kv_cpu), "rec": late.to_device(rec_cpu)})
    n_chunks = -(-kv_cpu.numel() * 2 // 4096) + -(-rec_cpu.numel() * 4 // 4096)
    assert res.ok and len(list(store._repo.blob_files())) == n_chunks
    # per chunk: the core's file write, plus (old code) one memcpy pinned half -> core slot
    assert (late.host_copies + n_chunks) / n_chunks == 1, late.host_copies
    assert late.lent_reads == n_chunks
    late.host_copies = 0
    dk, dr = late.empty(tuple(kv_cpu.shape), kv_cpu.dtype), late.empty(tuple(rec_cpu.shape), torch.float32)
    ad.restore(res, {"kv": dk, "rec": dr})
    # per chunk: the core's file read, plus (old code) one memcpy core slot -> pinned half
    assert (late.host_copies + n_chunks) / n_chunks == 1, late.host_copies
    assert late.lent_fills == n_chunks
    assert _canon(late.host(dk), 2) == _canon(kv_cpu, 2) and _canon(late.host(dr), None) == _canon(rec_cpu, None)
    assert not late.hazards
    store.close()


def test_direct_io_saves_still_copy_into_the_aligned_slot(late: LateCuda, tmp_path: Any) -> None:
    """With O_DIRECT a raw chunk is DMAed from the core's aligned slot: the one host memcpy is
    pinned half -> slot (a buffered write from the half would cost the same memcpy), bytes exact."""
    kv_cpu, rec_cpu, layout, _ = _kv_setup(None, tmp_path / "unused", T=96)
    store = _open(tmp_path / "s", layout=layout, direct_io=True)
    ad = _adapter(store, late, {"kv": 2})
    res = ad.save(list(range(96)), {"kv": late.to_device(kv_cpu), "rec": late.to_device(rec_cpu)})
    assert res.ok and late.lent_reads == 0 and late.host_copies == len(list(store._repo.blob_files()))
    dk, dr = torch.zeros_like(kv_cpu), torch.zeros_like(rec_cpu)
    TorchAdapter(store, token_dims={"kv": 2}).restore(res, {"kv": dk, "rec": dr})
    assert _canon(dk, 2) == _canon(kv_cpu, 2) and _canon(dr, None) == _canon(rec_cpu, None)
    assert not late.hazards
    store.close()


# -- save-side device errors --------------------------------------------------------------------
@pytest.mark.parametrize("via", ["adapter", "store"])
@pytest.mark.parametrize("direct_io", [False, True])
def test_device_error_on_save_is_a_source_error(late: LateCuda, tmp_path: Any, via: str, direct_io: bool) -> None:
    """An injected OOM on a device->host copy mid-save: SourceError (a SnapstoreError) saying nothing
    was saved; no snapshot, no orphan file, stored bytes = bytes on disk; the next save works."""
    kv_a, rec_cpu, layout, _ = _kv_setup(None, tmp_path / "unused", T=96)
    store = _open(tmp_path / "s", layout=layout, direct_io=direct_io)
    staging = Staging(2 * 4096, backend=late)
    ad = TorchAdapter(store, token_dims={"kv": 2}, staging=staging)

    def save(kv: Any, toks: list[int]) -> Any:
        parts = {"kv": late.to_device(kv), "rec": late.to_device(rec_cpu)}
        if via == "adapter":
            return ad.save(toks, parts)
        return store.save(toks, {"kv": TensorSource(parts["kv"], 2, staging),
                                 "rec": TensorSource(parts["rec"], None, staging)})

    before = late.copies
    ra = save(kv_a, list(range(96)))
    per_save = late.copies - before
    kv_b = _rand(tuple(kv_a.shape), torch.bfloat16, 55)
    late.fail_at = late.copies + per_save - 1  # late in the save: earlier chunks are published by then
    with pytest.raises(ss.SourceError) as ei:
        save(kv_b, list(range(200, 296)))
    late.fail_at = None
    assert isinstance(ei.value, ss.SnapstoreError) and isinstance(ei.value.__cause__, torch.OutOfMemoryError)
    assert "nothing was saved" in str(ei.value)
    assert [s.snapshot_id for s in store.snapshots()] == [ra.snapshot_id]
    rep = store.verify(deep=True)
    assert rep.ok and not rep.orphan_files, rep.orphan_files
    assert store.stats().stored_bytes == _disk_bytes(store)
    assert all(s.done == s.queued for s in late.streams if s is not late.compute)  # nothing left queued
    rb = save(kv_b, list(range(200, 296)))
    dk, dr = torch.zeros_like(kv_a), torch.zeros_like(rec_cpu)
    TorchAdapter(store, token_dims={"kv": 2}).restore(rb, {"kv": dk, "rec": dr})
    assert _canon(dk, 2) == _canon(kv_b, 2) and _canon(dr, None) == _canon(rec_cpu, None)
    assert not late.hazards
    store.close()
