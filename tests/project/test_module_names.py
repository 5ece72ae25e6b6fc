"""One role, one file name (issue 51): no two modules of the package share a name unless they are
parallel implementations of one interface — each integration's own version of the same job."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name -> the one interface the modules of that name implement, each for its own integration
PARALLEL = {
    "__init__.py": "a package",
    "_deps.py": "an integration's runtime check: without its runtime, an error that says what to install",
    "_identify.py": "an integration's identity of what its runtime serves (weights, settings)",
    "_watch.py": "an integration's cheap per-call look at whether its identity's inputs changed",
    "_prefix_cache.py": "an integration's PrefixCache (transformers, mlx_lm)",
    "cli.py": "an integration's commands, registered by the snapstore CLI (add_commands)",
}


def _modules() -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = defaultdict(list)
    for top in ("snapstore", "engine"):
        for p in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in p.parts:
                by_name[p.name].append(str(p.relative_to(ROOT)))
    return by_name


def test_no_two_modules_share_a_name_unless_parallel() -> None:
    shared = {n: sorted(ps) for n, ps in _modules().items() if len(ps) > 1 and n not in PARALLEL}
    assert shared == {}, f"one role, one file name: rename, or list in PARALLEL with the interface: {shared}"


def test_parallel_names_live_only_in_the_integrations() -> None:
    """A parallel name is each integration's own module (engine/<runtime>/), never a second core module."""
    for name, paths in _modules().items():
        if name in PARALLEL and name != "__init__.py" and len(paths) > 1:
            assert all(p.startswith("engine/") for p in paths), (name, paths)
