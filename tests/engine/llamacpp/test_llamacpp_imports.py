"""The llama.cpp integration's modules import each other without a cycle — counting imports made
inside functions, which would only hide one (issue 27: ``_slotfile`` <-> ``_slotparts`` shared
``_slotmodel`` instead)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[3] / "engine" / "llamacpp"


def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in PKG.glob("*.py")}
    out: dict[str, set[str]] = {m: set() for m in mods}
    for p in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1:  # from ._x import ... / from . import _x
                names = [node.module] if node.module else [a.name for a in node.names]
            elif node.module == "snapstore.engine.llamacpp":  # from snapstore.engine.llamacpp import _x
                names = [a.name for a in node.names]
            elif node.module and node.module.startswith("snapstore.engine.llamacpp."):  # ... llamacpp._x import
                names = [node.module[len("snapstore.engine.llamacpp."):]]
            else:
                continue
            out[p.stem].update(n.split(".")[0] for n in names if n and n.split(".")[0] in mods)
    return out


def test_no_import_cycle_in_llamacpp() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_slot_codec_and_parts_share_a_lower_module() -> None:
    graph = _graph()
    assert "_slotfile" not in graph["_slotparts"] and "_slotmodel" in graph["_slotparts"]
    assert graph["_slotmodel"] == set()
