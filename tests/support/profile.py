"""Example counts sized by the Hypothesis profile this run loaded (the root conftest.py:
``HYPOTHESIS_PROFILE``, default ``ci``). The fast tier (``make test``, profile ``dev``) runs fewer
examples of the heaviest property tests and state machines; ``ci`` and ``long`` run them as before."""

from __future__ import annotations

import os
from typing import Any, TypeVar

from hypothesis import settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")  # the rule the root conftest.py loads by

C = TypeVar("C", bound=Any)


def examples(full: int, dev: int) -> int:
    """``dev`` under the dev profile, else ``full`` (a property test's fixed example count)."""
    return dev if PROFILE == "dev" else full


def lighter_in_dev(case: C, max_examples: int, steps: int) -> C:
    """A state machine's ``TestCase`` with fewer runs and steps under the dev profile; unchanged
    (the profile's counts) under any other."""
    if PROFILE == "dev":
        case.settings = settings(case.settings, max_examples=max_examples, stateful_step_count=steps)
    return case
