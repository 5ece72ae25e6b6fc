"""Test tiers for tests/ and fuzz/ (tests/README.md): Hypothesis profiles and the slow-tier marker."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("dev", max_examples=10, stateful_step_count=20, **_COMMON)
settings.register_profile("ci", max_examples=30, stateful_step_count=30, **_COMMON)
settings.register_profile("long", max_examples=1000, stateful_step_count=50, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The slow tier: the reliability campaigns (crash kills, power-loss replay, corruption trials,
# multi-process concurrency) and the real vLLM connector tests (own venv, ~90 s per vLLM process).
# `make test` deselects it; `./test.sh` and CI run everything.
SLOW_MODULES = frozenset({"test_crash.py", "test_power_loss.py", "test_concurrency.py", "test_corruption.py",
                          "test_vllm_connector.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a slow-tier module ``slow``."""
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
