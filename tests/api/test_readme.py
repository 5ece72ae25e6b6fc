"""The README's API example runs as written (in a temporary default store location)."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there


def test_readme_example_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("SNAPSTORE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("SNAPSTORE_RESERVE_MIB", "0")
    src = open(os.path.join(TESTS_DIR, "..", "README.md")).read()
    code = next(c for c in re.findall(r"```python\n(.*?)```", src, re.S) if "Store.open" in c)
    ns: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    assert ns["m"].n_tokens == 600 and ns["out"].n_tokens == 600
    assert os.path.isfile(tmp_path / "store" / "snapstore.db")
