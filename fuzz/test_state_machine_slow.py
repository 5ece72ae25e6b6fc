"""The slow tier's run of the store state machine (``snapstore.testing.StoreStateMachine``): the
two layouts of ``test_state_machine.py`` with enough examples and steps for the machine's pairs of
features to meet (names x TTL, override imports x export x dedup, lost chunk files x import,
names x a rebuilt engine's stale drop, write admission x everything). The fast tier runs the same
machines a few examples long.

Sized to a few minutes on two busy cores (docs/reliability.md): 100 runs of 50 steps of the raw
layout, 60 of the typed one; the ``long`` profile (``make test-long``) runs its own, larger counts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from hypothesis import settings

from snapstore.testing import NumpyEngine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_state_machine import RAW, TYPED, AccountedMachine  # noqa: E402

pytestmark = pytest.mark.slow


def _sized(case: Any, examples: int, steps: int) -> Any:
    """``case`` with at least ``examples`` runs of ``steps`` steps (more under a larger profile)."""
    base = settings()  # the profile the root conftest.py loaded (ci unless told)
    case.settings = settings(case.settings, max_examples=max(examples, base.max_examples or 0),
                             stateful_step_count=max(steps, base.stateful_step_count or 0))
    return case


TestRawLayoutLong = _sized(AccountedMachine.for_engine(NumpyEngine(RAW), codecs=("raw", "zstd")).TestCase, 100, 50)
TestTypedLayoutLong = _sized(
    AccountedMachine.for_engine(NumpyEngine(TYPED), codecs=("zstd-shuffle2", "raw")).TestCase, 60, 50)
