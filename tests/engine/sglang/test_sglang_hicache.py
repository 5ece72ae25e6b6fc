"""snapstore as SGLang HiCache's storage tier, through the real sglang package (CPU).

The backend is built by SGLang's own ``StorageBackendFactory`` from the documented extra config and
driven through SGLang's storage interface (``HiCacheStorageConfig``, ``HiCacheStorageExtraInfo``,
``PoolTransfer``, ``PoolHitPolicy``). SGLang's host pool classes need torchvision to import (via
``sglang.srt.configs``) and there is no torchvision build for the CPU torch these machines carry,
so the host pools here are ``HostPages``: our own implementation of the page-call contract the
backend relies on (``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page`` over a
``layer_first`` or ``page_first`` buffer, with the shapes sglang 0.5.23's ``MHATokenToKVPoolHost``
documents) and a Mamba-style state pool. On a GPU machine ``scripts/gpu_check.sh`` runs SGLang's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
sglang = pytest.importorskip("sglang")
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import snapstore  # noqa: E402

pytestmark = pytest.mark.slow  # the real sglang package (imports take seconds), writers in processes: the slow tier

HERE = Path(__file__).resolve()
PAGE = 4  # tokens per page


class HostPages:
    """A host K/V pool with the page calls SGLang's backends use (the MHA layouts of sglang 0.5.23), on a CPU buffer."""

    def __init__(self, n_pages: int, *, layer_num: int = 2, head_num: int = 2, head_dim: int = 16,
                 dtype: Any = None, layout: str = "layer_first", page_size: int = PAGE) -> None:
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.dtype = dtype or torch.bfloat16
        self.layout, self.page_size, self.device, self.pin_memory = layout, page_size, "cpu", False
        self.size = n_pages * page_size
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        else:
            dims = (2, self.size, layer_num, head_num, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index: index + self.page_size, :, :]
        else:
            data_page = self.kv_buffer[:, index: index + self.page_size, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index: index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index: index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)


class MambaPages:
    """A Mamba state pool's page calls (MambaPoolHost: one slot per page, conv + temporal state)."""

    page_size = 1
    layout = "layer_first"
    storage_format_tag = "mamba-conv-ssm"

    def __init__(self, n_slots: int) -> None:
        self.dtype = torch.float32
        self.state = torch.zeros((n_slots, 3, 8, 8), dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        return self.state[index].flatten() if flat else self.state[index]

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((3, 8, 8), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self.state[index] = data_page.reshape(3, 8, 8)


def config(path: str, *, model: str = "Qwen/Qwen3-0.6B", tp_rank: int = 0, tp_size: int = 1,
           **extra: Any) -> HiCacheStorageConfig:
    """A HiCacheStorageConfig as SGLang's cache controller builds it, with the documented extra config."""
    ec = {"backend_name": "snapstore", "module_path": "snapstore.engine.sglang", "class_name": "SnapstoreHiCache",
          "interface_v1": 1, "path": path, **extra}
    if "model_revision" not in extra and "model_digest" not in extra:
        ec["model_revision"] = "r0"  # a hub id's weights are known only by the revision the operator gives
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model, extra_config=ec)


def backend(path: str, pool: Any, **kw: Any) -> Any:
    """The backend as SGLang attaches it: the factory, then the host pool registration."""
    b = StorageBackendFactory.create_backend("dynamic", config(path, **kw), pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def keys_of(name: str, n: int, start: int = 0) -> list[str]:
    """A chain of page hashes as SGLang makes them (each hashes the one before)."""
    out, last = [], name
    for i in range(n):
        last = hashlib.sha256(f"{last}/{i}".encode()).hexdigest()
        out.append(last)
    return out[start:]


def fill(pool: HostPages, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def slots(first_page: int, n: int) -> Any:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def page_hash(pool: Any, index: int) -> str:
    return hashlib.sha256(pool.get_data_page(index).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_factory_builds_the_documented_backend(tmp_path: Path) -> None:
    pool = HostPages(8)
    b = backend(str(tmp_path), pool)
    assert isinstance(b, HiCacheStorage) and type(b).__name__ == "SnapstoreHiCache"
    b.close()
    with pytest.raises(snapstore.ConfigError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", config(str(tmp_path), interface_v1=0), pool)
    with pytest.raises(snapstore.ConfigError, match="unknown extra-config keys"):
        StorageBackendFactory.create_backend("dynamic", config(str(tmp_path), disk_gb=1), pool)
    # SGLang's own keys in the same extra config are not the backend's to refuse
    StorageBackendFactory.create_backend("dynamic", config(str(tmp_path), prefetch_threshold=256,
                                                           hicache_storage_pass_prefix_keys=True), pool).close()


def test_the_weights_are_known_or_the_backend_refuses_to_start(tmp_path: Path) -> None:
    """A hub id with no revision or digest: the backend cannot tell new weights under that name from
    these, so it refuses to start (one clear error) rather than serve their pages; a local model
    directory keys its weights by their files, so weights replaced in place miss."""
    pool = HostPages(4)
    fill(pool, 2)
    with pytest.raises(snapstore.ConfigError, match="cannot tell which weights"):
        StorageBackendFactory.create_backend("dynamic", config(str(tmp_path / "s"), model_revision=None), pool)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"w" * 64)
    keys = keys_of("w", 4)
    b = backend(str(tmp_path / "s"), pool, model=str(model), model_revision=None)
    assert b.batch_set_v1(keys, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    b.close()
    b = backend(str(tmp_path / "s"), HostPages(4), model=str(model), model_revision=None)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 4  # the same weights: a hit
    b.close()
    st = weights.stat()
    weights.write_bytes(b"v" * 64)  # new weights in place, same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    b = backend(str(tmp_path / "s"), HostPages(4), model=str(model), model_revision=None)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    b.close()


def test_without_prefix_keys_each_call_is_a_chain_of_its_own(tmp_path: Path, caplog: Any) -> None:
    pool = HostPages(6)
    fill(pool, 9)
    b = backend(str(tmp_path), pool)
    keys = keys_of("np", 4)
    with caplog.at_level("WARNING", logger="snapstore.engine.sglang"):
        assert b.batch_set_v1(keys, slots(0, 4)) == [True] * 4
    assert "hicache_storage_pass_prefix_keys" in caplog.text and b.counters["calls_without_prefix_keys"] == 1
    assert b.batch_exists(keys) == 4 and b.batch_exists(keys[:2] + ["e" * 64]) == 2
    assert b.batch_exists(keys[2:]) == 0  # split elsewhere: the chain is rooted at keys[0]
    assert b.batch_exists(keys[2:], HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == 2
    b.close()


def test_without_sglang_the_error_says_what_to_install(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['sglang'] = None\n"  # sglang not importable in this child
            "import snapstore\n"
            "try:\n    from snapstore.engine.sglang import SnapstoreHiCache\n"
            "except snapstore.ConfigError as e:\n    assert isinstance(e, ImportError); print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parents[3])
    assert out.returncode == 0 and "pip install 'snapstore[sglang]'" in out.stdout, out.stdout + out.stderr


def _writer(path: str, seed: int, n: int, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Any]:
    """Write a chain of ``n`` pages (in two batches, the second after its prefix) and report page hashes."""
    pool = HostPages(n)
    fill(pool, seed)
    b = backend(path, pool, tp_rank=tp_rank, tp_size=tp_size)
    keys = keys_of("doc", n)
    half = n // 2
    first = b.batch_set_v1(keys[:half], slots(0, half), HiCacheStorageExtraInfo(prefix_keys=[]))
    second = b.batch_set_v1(keys[half:], slots(half, n - half), HiCacheStorageExtraInfo(prefix_keys=keys[:half]))
    b.close()
    return {"ok": first + second, "pages": [page_hash(pool, i * PAGE) for i in range(n)]}


def run_child(*args: Any) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(HERE), *map(str, args)], capture_output=True, text=True,
                         timeout=600, cwd=HERE.parents[3])
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_pages_set_in_one_process_read_byte_exact_in_another(tmp_path: Path) -> None:
    wrote = run_child("write", tmp_path, 7, 6)
    assert wrote["ok"] == [True] * 6
    pool = HostPages(10)
    b = backend(str(tmp_path), pool)
    keys = keys_of("doc", 6)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 6
    # a prefetch of the last four pages after the first two (SGLang passes those as prefix_keys)
    got = b.batch_get_v1(keys[2:], slots(3, 4), HiCacheStorageExtraInfo(prefix_keys=keys[:2]))
    assert got == [True] * 4
    assert [page_hash(pool, (3 + i) * PAGE) for i in range(4)] == wrote["pages"][2:]
    assert b.counters["get_pages"] == 4
    # the chain is stored once: writing it again stores nothing new
    again = HostPages(6)
    fill(again, 7)
    before = b.store_stats()["kv"].stored_bytes
    assert b.batch_set_v1(keys, slots(0, 6), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 6
    assert b.counters["set_pages_deduplicated"] == 6 and b.store_stats()["kv"].stored_bytes == before
    b.close()


def test_gaps_stop_batch_exists_and_branches_share_their_stem(tmp_path: Path) -> None:
    pool = HostPages(12)
    fill(pool, 1)
    b = backend(str(tmp_path), pool)
    keys = keys_of("a", 5)
    assert b.batch_set_v1(keys, slots(0, 5), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 5
    gap = keys[:2] + ["f" * 64] + keys[3:]
    assert b.batch_exists(gap, HiCacheStorageExtraInfo(prefix_keys=[])) == 2
    assert b.batch_exists(keys[3:], HiCacheStorageExtraInfo(prefix_keys=keys[:3])) == 2
    assert b.batch_exists(keys[3:], HiCacheStorageExtraInfo(prefix_keys=["0" * 64] + keys[1:3])) == 0
    # pages whose prefix is not stored are not written (nothing to chain them onto)
    assert b.batch_set_v1(keys_of("z", 2), slots(5, 2), HiCacheStorageExtraInfo(prefix_keys=["9" * 64])) == [False] * 2
    # a branch after page 2 stores only its own pages and reads back through the shared stem
    branch = keys_of("b", 2)
    assert b.batch_set_v1(branch, slots(5, 2), HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [True] * 2
    stored = b.store_stats()["kv"]
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    assert stored.snapshots == 7 and stored.chunks == 7 and stored.stored_bytes < 8 * page_bytes  # not 9 pages
    b.close()
    dst = HostPages(12)
    b2 = backend(str(tmp_path), dst)
    assert b2.batch_get_v1(keys[:2] + branch, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    assert [page_hash(dst, i * PAGE) for i in range(4)] == [page_hash(pool, i * PAGE) for i in (0, 1, 5, 6)]
    b2.close()


@pytest.mark.parametrize("change", ["model", "dtype", "layout", "revision", "page_size"])
def test_another_identity_hits_nothing(tmp_path: Path, change: str) -> None:
    pool = HostPages(4)
    fill(pool, 2)
    b = backend(str(tmp_path), pool, model_revision="r1")
    keys = keys_of("c", 4)
    assert b.batch_set_v1(keys, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    b.close()
    kw: dict[str, Any] = {"model_revision": "r1"}
    other = HostPages(4)
    if change == "model":
        kw["model"] = "Qwen/Qwen3-1.7B"
    elif change == "dtype":
        other = HostPages(4, dtype=torch.float16)
    elif change == "layout":
        other = HostPages(4, layout="page_first")
    elif change == "revision":
        kw["model_revision"] = "r2"
    else:
        other = HostPages(2, page_size=8)
    b2 = backend(str(tmp_path), other, **kw)
    assert b2.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    n = other.page_size
    assert b2.batch_get_v1(keys[:1], torch.arange(0, n), HiCacheStorageExtraInfo(prefix_keys=[])) == [False]
    assert not other.kv_buffer.any()
    b2.close()


def test_a_flipped_byte_is_a_miss_never_junk(tmp_path: Path) -> None:
    pool = HostPages(4)
    fill(pool, 3)
    b = backend(str(tmp_path), pool)
    keys = keys_of("d", 4)
    assert b.batch_set_v1(keys, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    b.close()
    blobs = sorted((p for p in (tmp_path / "blobs").rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert len(blobs) == 4  # one chunk per page
    victim = blobs[-1]  # the last page's chunk
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.chmod(0o600)
    victim.write_bytes(bytes(data))
    dst = HostPages(4)
    b2 = backend(str(tmp_path), dst)
    got = b2.batch_get_v1(keys, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[]))
    assert got == [True, True, True, False]
    assert [page_hash(dst, i * PAGE) for i in range(3)] == [page_hash(pool, i * PAGE) for i in range(3)]
    assert not dst.kv_buffer[:, :, 3 * PAGE:].any()  # the damaged page never reached the pool
    assert b2.counters["get_errors"] == 1
    # the damage is quarantined: the chain is offered only up to it
    assert b2.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 3
    b2.close()


def test_budgets_evict_least_recently_used_tail_pages(tmp_path: Path) -> None:
    pool = HostPages(40, layer_num=4, head_num=4, head_dim=128)  # 32 KiB pages: 40 of them > 1 MiB
    fill(pool, 4)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    b = backend(str(tmp_path), pool, disk_mib=1)
    chains = [keys_of(f"e{j}", 5) for j in range(8)]
    for j, ks in enumerate(chains):
        assert b.batch_set_v1(ks, slots(5 * j, 5), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 5
    stats = b.store_stats()["kv"]
    assert stats.stored_bytes <= 1 << 20 and stats.evictions > 0
    assert 40 * page_bytes > 1 << 20
    first = b.batch_exists(chains[0], HiCacheStorageExtraInfo(prefix_keys=[]))
    last = b.batch_exists(chains[-1], HiCacheStorageExtraInfo(prefix_keys=[]))
    assert first < 5 and last == 5
    b.close()


def test_two_tp_ranks_share_one_directory(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, str(HERE), "write", str(tmp_path), str(10 + r), "6", str(r), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parents[3])
             for r in range(2)]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=600)
        assert p.returncode == 0, se[-3000:]
        outs.append(json.loads(so.strip().splitlines()[-1]))
    keys = keys_of("doc", 6)
    for r in range(2):
        assert outs[r]["ok"] == [True] * 6
        dst = HostPages(6)
        b = backend(str(tmp_path), dst, tp_rank=r, tp_size=2)
        assert b.batch_get_v1(keys, slots(0, 6), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 6
        assert [page_hash(dst, i * PAGE) for i in range(6)] == outs[r]["pages"]  # its own shard
        b.close()
    assert outs[0]["pages"] != outs[1]["pages"]
    report = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(tmp_path), "verify", "--deep"],
                            capture_output=True, text=True, cwd=HERE.parents[3])
    assert report.returncode == 0, report.stdout + report.stderr
    shown = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(tmp_path), "inspect", "--json"],
                           capture_output=True, text=True, cwd=HERE.parents[3])
    idents = [i["fields"] for i in json.loads(shown.stdout)["identities"]]
    assert sorted(i["extra"]["tp"] for i in idents if i["extra"]["engine"] == "sglang") == ["0/2", "1/2"]
    assert {i["kv"] for i in idents} == {"bfloat16"}
    assert {i["build"] for i in idents} == {f"sglang-{sglang.__version__}"}


def test_v2_mamba_pool_beside_kv(tmp_path: Path) -> None:
    kv, mamba = HostPages(8), MambaPages(8)
    fill(kv, 5)
    mamba.state.copy_(torch.randn(mamba.state.shape, generator=torch.Generator().manual_seed(6)))
    b = StorageBackendFactory.create_backend("dynamic", config(str(tmp_path)), kv)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, "kv")
    b.register_mem_host_pool_v2(mamba, "mamba")
    b.on_host_pools_registered()
    keys = keys_of("h", 6)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    # Mamba state only at node ends: after page 3 and after page 6
    res = b.batch_set_v2([PoolTransfer(name="kv", host_indices=slots(0, 6), keys=keys),
                          PoolTransfer(name="mamba", host_indices=torch.tensor([2, 5]), keys=[keys[2], keys[5]],
                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert res == {"kv": [True] * 6, "mamba": [True, True]}
    b.close()

    kv2, mamba2 = HostPages(8), MambaPages(8)
    b2 = StorageBackendFactory.create_backend("dynamic", config(str(tmp_path)), kv2)
    b2.register_mem_pool_host(kv2)
    b2.register_mem_host_pool_v2(kv2, "kv")
    b2.register_mem_host_pool_v2(mamba2, "mamba")
    b2.on_host_pools_registered()
    hit = b2.batch_exists_v2(keys, [PoolTransfer(name="mamba", keys=[keys[-1]],
                                                 hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert hit.kv_hit_pages == 6 and hit.restorable_prefix_pages == [3, 6]
    got = b2.batch_get_v2([PoolTransfer(name="kv", host_indices=slots(0, 6), keys=keys),
                           PoolTransfer(name="mamba", host_indices=torch.tensor([1]), keys=[keys[5]])], info)
    assert got == {"kv": [True] * 6, "mamba": [True]}
    assert torch.equal(kv2.kv_buffer[:, :, :24], kv.kv_buffer[:, :, :24])
    assert torch.equal(mamba2.state[1], mamba.state[5])
    # a prefix without its Mamba state is not restorable
    assert b2.batch_exists_v2(keys[:5], [PoolTransfer(name="mamba", keys=[keys[4]],
                                                      hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                              info).restorable_prefix_pages == [3]
    b2.close()


class FailingPages(HostPages):
    """A host pool whose pages from ``bad`` on cannot be read (a device error, say)."""

    bad = 2 * PAGE

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if index >= self.bad:
            raise RuntimeError(f"page at {index} unreadable")
        return super().get_data_page(index, flat)


def test_a_store_error_is_a_false_never_raised_into_sglang(tmp_path: Path) -> None:
    pool = FailingPages(4)
    fill(pool, 11)
    b = backend(str(tmp_path), pool)
    keys = keys_of("f", 4)
    assert b.batch_set_v1(keys, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True, True, False, False]
    assert b.counters["set_errors"] == 1
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 2
    b.close()
    report = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(tmp_path), "verify"],
                            capture_output=True, text=True, cwd=HERE.parents[3])
    assert report.returncode == 0, report.stdout + report.stderr  # the refused save left nothing behind


def test_by_key_calls_and_clear(tmp_path: Path) -> None:
    pool = HostPages(4)
    fill(pool, 8)
    b = backend(str(tmp_path), pool)
    page = pool.get_data_page(0).clone()
    assert not b.exists("k1") and b.get("k1", pool.get_dummy_flat_data_page()) is None
    assert b.set("k1", page) and b.exists("k1")
    assert torch.equal(b.get("k1", pool.get_dummy_flat_data_page()), page)
    assert b.batch_set(["k2", "k3"], [page, page]) and b.batch_get(["k2", "k4"], None)[1] is None
    assert b.clear() and not b.exists("k1")
    b.close()


if __name__ == "__main__":  # the child processes of the tests above
    role, path, *nums = sys.argv[1:]
    print(json.dumps(_writer(path, *map(int, nums))))
