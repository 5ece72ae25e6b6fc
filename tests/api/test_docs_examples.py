"""The ```python examples of docs/api.md run as written, so the guide cannot rot.

The blocks of the page form one session: they run in order in one namespace (later examples
reuse names from earlier ones), in a fresh ``$SNAPSTORE_DIR``, with the working directory in a
temp dir. ``SNAPSTORE_RESERVE_MIB=0`` keeps a nearly full CI disk from turning saves into
``disk_full`` skips; ``SNAPSTORE_CHECK_ROWS=1`` makes the store check that every delta the
examples save really extends its parent's rows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```\s*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = python_blocks(DOC.read_text(encoding="utf-8"))


@pytest.fixture
def doc_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Path:
    store_dir = tmp_path / "store"
    monkeypatch.setenv("SNAPSTORE_DIR", str(store_dir))
    monkeypatch.setenv("SNAPSTORE_RESERVE_MIB", "0")
    monkeypatch.setenv("SNAPSTORE_CHECK_ROWS", "1")  # the examples keep the rows they vouch for
    monkeypatch.chdir(tmp_path)
    return store_dir


def test_the_guide_has_examples() -> None:
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("line,src", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_block_compiles(line: int, src: str) -> None:
    compile(src, f"{DOC.name}:{line}", "exec")


def test_examples_run_in_order(doc_env: Path) -> None:
    ns: dict[str, Any] = {"__name__": "docs_api_examples"}
    try:
        for line, src in BLOCKS:
            try:
                # leading newlines make traceback line numbers those of docs/api.md
                exec(compile("\n" * line + src, str(DOC), "exec"), ns)  # noqa: S102 - our own docs
            except Exception as e:
                raise AssertionError(f"docs/api.md example at line {line} failed: {type(e).__name__}: {e}") from e
    finally:
        for value in list(ns.values()):  # close any store an example left open
            close = getattr(value, "close", None)
            if type(value).__name__ == "Store" and callable(close):
                close()
    assert doc_env.joinpath("snapstore.db").is_file()
