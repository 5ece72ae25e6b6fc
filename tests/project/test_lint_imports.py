"""The import rules scripts/lint_imports.py checks beside import-linter (issue 51): the checkout keeps
them, and each catches a violation planted in a temporary package tree (R1 an integration uses only
the core's public names and another integration's public names; R2 no package imports a sibling's
private module or name; R3 the CLI imports only the integrations' cli modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _lint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lint_imports", REPO / "scripts" / "lint_imports.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


LINT = _lint()

# a small package shaped like snapstore: a core with public names, two integrations, a CLI, the console
TREE = {
    "snapstore/__init__.py": '__all__ = ["Store", "Budget"]\nfrom snapstore._config import Budget\n'
                             "from snapstore.store.store import Store\n",
    "snapstore/_config.py": "class Budget: ...\n",
    "snapstore/store/__init__.py": "",
    "snapstore/store/store.py": "from snapstore._config import Budget\nclass Store: ...\n",
    "snapstore/save/__init__.py": "",
    "snapstore/save/run.py": "def _hook(): ...\ndef run(): ...\n",
    "snapstore/save/_stages.py": "",
    "snapstore/console/__init__.py": "",
    "snapstore/console/context.py": "class CliContext: ...\n",
    "snapstore/cli/__init__.py": "",
    "snapstore/cli/parser.py": "from snapstore.engine.llm.cli import add_commands\n"
                               "from snapstore.console.context import CliContext\n",
    "snapstore/engine/__init__.py": "",
    "snapstore/engine/_shared.py": "from snapstore import Budget\n",
    "snapstore/engine/torch/__init__.py": '__all__ = ["Adapter"]\nfrom ._adapter import Adapter\n',
    "snapstore/engine/torch/_adapter.py": "from snapstore import Store\nclass Adapter: ...\n",
    "snapstore/engine/llm/__init__.py": '__all__ = ["Cache"]\nfrom ._cache import Cache\n',
    "snapstore/engine/llm/_cache.py": "import snapstore as ss\nfrom snapstore import Budget, Store\n"
                                      "from .. import _shared\nfrom ..torch import Adapter\nfrom . import _more\n"
                                      "class Cache:\n    b = ss.Budget\n",
    "snapstore/engine/llm/_more.py": "",
    "snapstore/engine/llm/cli.py": "from snapstore.console.context import CliContext\nfrom ._cache import Cache\n",
}


def _tree(tmp: Path, extra: dict[str, str] | None = None) -> dict[str, object]:
    for rel, text in {**TREE, **(extra or {})}.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return LINT.modules_under(tmp / "snapstore", "snapstore")


def _broken(tmp: Path, module: str, text: str) -> list[str]:
    got: list[str] = LINT.check(_tree(tmp, {module: text}))
    return got


def test_the_checkout_keeps_the_rules() -> None:
    modules = LINT.source_modules(REPO)
    assert "snapstore.engine.llamacpp.cli" in modules and "snapstore.store.store" in modules  # engine/ mapped
    assert LINT.check(modules) == []


def test_the_planted_tree_is_clean_as_written(tmp_path: Path) -> None:
    assert LINT.check(_tree(tmp_path)) == []


ENGINE_BAD, CORE_BAD, CLI_BAD = "snapstore/engine/llm/_bad.py", "snapstore/store/bad.py", "snapstore/cli/bad.py"


@pytest.mark.parametrize("where, text, rule, what", [
    # R1: an integration takes from the core only names in snapstore.__all__, from another its __all__
    (ENGINE_BAD, "from snapstore._config import Budget\n", "R1", "snapstore._config.Budget"),
    (ENGINE_BAD, "from snapstore.store.store import Store\n", "R1", "snapstore.store.store.Store"),
    (ENGINE_BAD, "from snapstore import Hidden\n", "R1", "Hidden from snapstore"),
    (ENGINE_BAD, "import snapstore\nx = snapstore.Hidden\n", "R1", "snapstore.Hidden"),
    (ENGINE_BAD, "from snapstore.console.context import CliContext\n", "R1", "snapstore.console"),  # cli modules only
    (ENGINE_BAD, "from ..torch import Hidden\n", "R1", "snapstore.engine.torch.Hidden"),
    # R2: a private module or name only from inside its own package
    (ENGINE_BAD, "from ..torch._adapter import Adapter\n", "R2", "snapstore.engine.torch._adapter"),
    (ENGINE_BAD, "from snapstore.engine.torch import _adapter\n", "R2", "snapstore.engine.torch._adapter"),
    (ENGINE_BAD, "def f():\n    from snapstore.save import _stages\n", "R2", "snapstore.save._stages"),  # in a function
    (CORE_BAD, "from snapstore.save._stages import x\n", "R2", "snapstore.save._stages"),
    (CORE_BAD, "from snapstore.save.run import _hook\n", "R2", "snapstore.save.run._hook"),
    (CORE_BAD, "import snapstore.engine.llm._cache\n", "R2", "snapstore.engine.llm._cache"),
    # R3: the CLI imports of the integrations only their cli modules
    (CLI_BAD, "from snapstore.engine.llm import Cache\n", "R3", "snapstore.engine.llm.Cache"),
    (CLI_BAD, "from snapstore.engine.llm._more import x\n", "R3", "snapstore.engine.llm._more"),
    (CLI_BAD, "import snapstore.engine\n", "R3", "snapstore.engine"),
])
def test_a_planted_violation_is_caught(tmp_path: Path, where: str, text: str, rule: str, what: str) -> None:
    got = _broken(tmp_path, where, text)
    module = where[:-len(".py")].replace("/", ".")
    assert got and all(g.startswith(module + ":") for g in got), got  # nothing else of the tree
    assert any(f"{rule}:" in g and what in g for g in got), got


def test_private_parts_of_the_own_package_or_an_ancestor_are_allowed(tmp_path: Path) -> None:
    assert _broken(tmp_path, "snapstore/save/ok.py", "from snapstore.save import _stages\n"
                                                      "from snapstore.save.run import _hook\n"
                                                      "from snapstore._config import Budget\n") == []
