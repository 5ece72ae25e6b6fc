"""Names of a package loaded on first use (PEP 562): importing an integration's package imports no
runtime; the first use of one of its names imports the module that holds it, after the package's
own dependency check. One copy of the loader for every integration that has one."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, where: dict[str, str], names: list[str], check: str | None = None
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``where[name]`` is the module holding ``name``,
    relative to the package (``._x``) or absolute; ``check`` (e.g. ``._deps``) is imported first."""

    missing: list[ImportError] = []  # the check's error once raised (the runtime is not installed)

    def getattr_(name: str) -> Any:
        home = where.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if check is not None:
            if not missing:
                try:
                    importlib.import_module(check, package)
                except ImportError as e:
                    missing.append(e)
            if missing:  # one error class every time (a failed import would define a new one), and
                error = missing[0]  # that class itself importable without the runtime, to catch it
                if type(error).__name__ == name:
                    return type(error)
                again = type(error)(*error.args)
                again.name = error.name
                raise again from None
        value = getattr(importlib.import_module(home, package), name)
        vars(importlib.import_module(package))[name] = value  # looked up once
        return value

    def dir_() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *names})

    return getattr_, dir_
