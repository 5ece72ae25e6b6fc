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

# The slow tier (tests/README.md), by folder: tests/reliability/ (crash, power-loss, corruption and
# concurrency campaigns) and tests/servers/ (real SeaweedFS, llama-server and mlx_lm.server processes).
# Elsewhere a slow module says so itself (`pytestmark = pytest.mark.slow`: model runtimes, many
# processes), and single expensive tests carry `@pytest.mark.slow`. `make test` deselects the tier;
# `./test.sh` and CI run everything.
SLOW_FOLDERS = ("reliability", "servers")
_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under a slow-tier folder ``slow``."""
    slow = tuple(os.path.join(_TESTS, f) + os.sep for f in SLOW_FOLDERS)
    for item in items:
        if str(item.path).startswith(slow):
            item.add_marker(pytest.mark.slow)
