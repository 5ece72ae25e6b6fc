#!/usr/bin/env python3
"""Check the import contracts on the package as it is installed: pyproject's ``[tool.importlinter]``
(lint-imports), and the rules import-linter cannot state, read from each module's source (AST).

The package is installed for real: the checkout's package files (pyproject's package-dir sources,
``engine/`` included) are copied to a temporary directory and installed from there with
``pip install --no-deps --no-build-isolation --target``, so both checks read the tree a user gets
(``engine/`` as ``snapstore.engine``), and a package missing from pyproject's ``packages`` list is
missing here too. Nothing in the checkout is written. The rules checked here (docs/design.md, "Layers"):

- **R1** an integration (``snapstore.engine`` and below, its ``cli`` modules included) uses the core only
  through its public names — ``from snapstore import X`` or ``snapstore.X`` with X in ``snapstore.__all__`` —
  and another integration only through the names in that package's ``__all__``; an integration's command
  module (``snapstore.engine.<x>.cli``) may also use ``snapstore.console``, what every command runs on;
- **R2** a private module or name ``P._x`` is imported only from P's own package (P itself if P is a
  package, else the package holding P) or below it: no package reaches into a sibling's private parts;
- **R3** the CLI (``snapstore.cli``) imports from the integrations only their ``cli`` modules: it dispatches.

Imports inside functions and under ``TYPE_CHECKING`` count. Exit status: non-zero when a rule or a
contract is broken. ``--ast-only``: the AST rules on the checkout's sources alone (no install, no lint-imports).
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: mypy's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TOP = "snapstore"
ENGINE = f"{TOP}.engine"
CLI = f"{TOP}.cli"
CONSOLE = f"{TOP}.console"  # the command runtime the CLI and the integrations' cli modules share


# -- the module tree -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Module:
    """One module of the package: its dotted name, its file, and whether it is a package (``__init__``)."""

    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package this module's relative imports start from (itself, for a package)."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def modules_under(directory: Path, package: str) -> dict[str, Module]:
    """Every ``.py`` module below ``directory``, which holds package ``package``."""
    out: dict[str, Module] = {}
    for path in sorted(directory.rglob("*.py")):
        rel = path.relative_to(directory).with_suffix("")
        if "__pycache__" in rel.parts:
            continue
        parts = [*package.split("."), *rel.parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = Module(".".join(parts), path, is_package)
    return out


def package_dirs(checkout: Path = ROOT) -> dict[str, Path]:
    """pyproject's ``[tool.setuptools.package-dir]``: each mapped package and its source directory."""
    with open(checkout / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: checkout / folder for name, folder in mapping.items()}


def source_modules(checkout: Path = ROOT) -> dict[str, Module]:
    """The package's modules as the checkout holds them (``engine/`` read as ``snapstore.engine``)."""
    out: dict[str, Module] = {}
    for name, folder in package_dirs(checkout).items():
        out.update(modules_under(folder, name))
    return out


# -- imports -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    """One imported thing: a module (``name`` None), or a name taken from module ``target``."""

    line: int
    target: str
    name: str | None = None

    @property
    def dotted(self) -> str:
        return self.target if self.name is None else f"{self.target}.{self.name}"


def imports_of(mod: Module, modules: Mapping[str, Module], tree: ast.AST) -> Iterator[Import]:
    """Every import in ``mod`` (relative ones resolved; ``from m import x`` is module ``m.x`` when there is one)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                yield Import(node.lineno, full) if full in modules else Import(node.lineno, target, alias.name)


def _private(segment: str) -> bool:
    return segment.startswith("_") and not segment.startswith("__")


@functools.cache
def public_names(mod: Module | None) -> frozenset[str]:
    """The literal ``__all__`` of a module (empty when it has none, or not a literal list)."""
    if mod is None:
        return frozenset()
    for node in ast.parse(mod.path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return frozenset(str(n) for n in ast.literal_eval(node.value))
            except ValueError:
                return frozenset()
    return frozenset()


def _inside(package: str, owner: str) -> bool:
    return package == owner or package.startswith(owner + ".")


def _integration(name: str, modules: Mapping[str, Module]) -> str | None:
    """The integration ``name`` belongs to (``snapstore.engine.<x>``); None for the engine package's own modules."""
    parts = name.split(".")
    if len(parts) < 3 or ".".join(parts[:2]) != ENGINE:
        return None
    pkg = ".".join(parts[:3])
    found = modules.get(pkg)
    return pkg if found is not None and found.is_package else None


# -- the rules -----------------------------------------------------------------------------------
def check(modules: Mapping[str, Module]) -> list[str]:
    """Every broken rule (R1, R2, R3 of the module docstring), one line each: ``module:line: rule: what``."""
    core_public = public_names(modules.get(TOP))
    problems: list[str] = []
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"), str(mod.path))
        found = list(imports_of(mod, modules, tree))
        where = mod.name
        for imp in found:
            if not imp.dotted.startswith(TOP + ".") and imp.dotted != TOP:
                continue
            private = _r2(mod, imp, modules)
            problems += [f"{where}:{imp.line}: {p}" for p in private]
            if _inside(mod.name, ENGINE) and not private:
                problems += [f"{where}:{imp.line}: {p}" for p in _r1(mod, imp, modules, core_public)]
            if _inside(mod.name, CLI):
                problems += [f"{where}:{imp.line}: {p}" for p in _r3(imp, modules)]
        if _inside(mod.name, ENGINE):
            problems += [f"{where}:{line}: {p}" for line, p in _r1_attributes(tree, core_public)]
    return list(dict.fromkeys(problems))  # a name used twice on one line: reported once


def _r2(mod: Module, imp: Import, modules: Mapping[str, Module]) -> list[str]:
    """R2: a private module or name only from inside its own package."""
    segs = imp.dotted.split(".")
    first = next((i for i, s in enumerate(segs) if _private(s)), None)
    if first is None:
        return []
    holder = ".".join(segs[:first])
    found = modules.get(holder)
    owner = holder if found is None or found.is_package else holder.rpartition(".")[0]
    if _inside(mod.package, owner):
        return []
    return [f"R2: imports {imp.dotted}, a private part of {owner}: use that package's public names "
            f"(or move what is shared into {owner}'s parent)"]


def _r1(mod: Module, imp: Import, modules: Mapping[str, Module], core_public: frozenset[str]) -> list[str]:
    """R1: an integration uses the core's public names, another integration's public names, its own package."""
    if imp.target == TOP:
        if imp.name is None or imp.name in core_public:
            return []
        return [f"R1: imports {imp.name} from snapstore, which is not in snapstore.__all__ (not public API)"]
    if _inside(imp.target, CONSOLE) and mod.name.rpartition(".")[2] == "cli":
        return []  # a command module: the command runtime (its privacy is R2's)
    if not _inside(imp.target, ENGINE):
        return [f"R1: imports {imp.dotted}, the core's internals: an integration uses only `from snapstore import "
                f"...` (names in snapstore.__all__; add what it needs to the public API)"]
    theirs, mine = _integration(imp.target, modules), _integration(mod.name, modules)
    if theirs is None or theirs == mine:
        return []  # the engine package's own modules (R2 guards their privacy), or its own integration
    if imp.target == theirs and (imp.name is None or imp.name in public_names(modules.get(theirs))):
        return []
    return [f"R1: imports {imp.dotted}: another integration is used only through the names in {theirs}.__all__"]


def _r1_attributes(tree: ast.AST, core_public: frozenset[str]) -> Iterator[tuple[int, str]]:
    """R1 for ``import snapstore [as ss]``: every ``ss.X`` names a public X (or a submodule imported by name)."""
    aliases = set()
    allowed = set(core_public)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == TOP:
                    aliases.add(a.asname or TOP)
                elif a.name.startswith(TOP + ".") and a.asname is None:
                    aliases.add(TOP)
                    allowed.add(a.name.split(".")[1])  # the submodule's own import is checked as an import
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr not in allowed):
            yield node.lineno, f"R1: uses {node.value.id}.{node.attr}, not in snapstore.__all__ (not public API)"


def _r3(imp: Import, modules: Mapping[str, Module]) -> list[str]:
    """R3: the CLI imports only the integrations' ``cli`` modules."""
    if not _inside(imp.target, ENGINE):
        return []
    theirs = _integration(imp.target, modules)
    if theirs is not None and imp.target == f"{theirs}.cli":
        return []
    return [f"R3: imports {imp.dotted}: the CLI dispatches to an integration's cli module "
            "(snapstore.engine.<x>.cli) and imports nothing else of it"]


# -- the installed package -----------------------------------------------------------------------
def install(into: Path, checkout: Path = ROOT) -> Path:
    """Install the checkout's package into ``into/site`` (a copy of its package files, built and
    installed by pip, no dependencies, nothing fetched); the site directory."""
    src = into / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (checkout / name).is_file():
            shutil.copy2(checkout / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in {p.relative_to(checkout).parts[0] for p in package_dirs(checkout).values()}:
        shutil.copytree(checkout / folder, src / folder, ignore=skip, symlinks=True)
    site = into / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--no-compile", "--disable-pip-version-check", "--target", str(site),
                    str(src)], check=True)
    return site


def main(argv: list[str]) -> int:
    if "--ast-only" in argv:
        problems = check(source_modules())
        print("\n".join(problems) or "import rules R1-R3: kept")
        return 1 if problems else 0
    with tempfile.TemporaryDirectory(prefix="snapstore-imports-") as tmp:
        site = install(Path(tmp))
        problems = check(modules_under(site / TOP, TOP))
        print("\n".join(problems) or "import rules R1-R3 (scripts/lint_imports.py): kept")
        path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        exe = Path(sys.executable).with_name("lint-imports")
        code = subprocess.call([str(exe), str(ROOT / "pyproject.toml"), "--no-cache"],
                               env={**os.environ, "PYTHONPATH": path}, cwd=tmp)
    return 1 if problems else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
