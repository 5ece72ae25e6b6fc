"""Test tiers for tests/ and fuzz/ (tests/README.md): Hypothesis profiles and the slow-tier marker."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("dev", max_examples=5, stateful_step_count=20, **_COMMON)
settings.register_profile("ci", max_examples=30, stateful_step_count=30, **_COMMON)
settings.register_profile("long", max_examples=1000, stateful_step_count=50, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The slow tier (tests/README.md): the reliability campaigns, and the integration modules that
# start servers, model runtimes or many processes. `make test` deselects it; `./test.sh` and CI
# run everything. Single expensive tests elsewhere carry `@pytest.mark.slow` themselves.
SLOW_MODULES = frozenset({
    # reliability campaigns: crash kills, power-loss replay, corruption trials, multi-process concurrency
    "test_crash.py", "test_power_loss.py", "test_concurrency.py", "test_corruption.py",
    # servers: SeaweedFS (s3_fixtures.py), a real llama-server (xllamacpp), real vLLM processes (own
    # venv, ~20-90 s each); the slot-file codec tests (test_llamacpp_slotfile.py, a few seconds,
    # no server) stay fast
    "test_remote_fleet.py", "test_remote_stream.py", "test_remote_tee.py", "test_remote_tee_faults.py",
    "test_remote_granularity.py", "test_remote_scan.py", "test_fleet.py", "test_llamacpp_bridge.py",
    "test_llamacpp_identity.py",
    "test_llamacpp_passthrough.py", "test_llamacpp_load.py", "test_vllm_connector.py",
    # the real sglang package (imports take seconds) and its storage backend in writer processes
    "test_sglang_hicache.py",
    # model runtimes: transformers models built at test time
    "test_engine_hf.py", "test_engine_hf_device.py", "test_prefix_cache.py", "test_prefix_cache_keys.py",
    # mlx_lm models built at test time, in two processes (a restart)
    "test_mlx_restart.py",
    # many processes: the CLI as a subprocess per command, owners in other PID/UTS namespaces,
    # repair beside a resaving process, the GPU benchmark's child
    "test_cli.py", "test_owners.py", "test_repair.py", "test_bench_gpu.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a slow-tier module ``slow``."""
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
