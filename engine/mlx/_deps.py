"""The MLX integration's dependencies, checked first: without mlx or mlx_lm, an error that says what
to install instead of a bare ModuleNotFoundError from deep inside a module. Never imports torch."""

from __future__ import annotations

from snapstore import ConfigError

__all__ = ["MlxMissingError"]


class MlxMissingError(ConfigError, ModuleNotFoundError):
    """``snapstore.engine.mlx`` imported where mlx or mlx_lm is not installed. Also an ImportError, so
    the ``try: import ... except ImportError`` of an optional integration keeps working."""


try:
    import mlx.core  # noqa: F401
    import mlx_lm  # noqa: F401
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] not in ("mlx", "mlx_lm"):
        raise
    missing = MlxMissingError(f"snapstore.engine.mlx needs {e.name}, which is not installed: "
                              "pip install 'snapstore[mlx]' (mlx[cpu] on Linux, mlx on macOS, and mlx-lm)")
    missing.name = e.name
    raise missing from None

import importlib  # noqa: E402  (after the check above)

mlx_generate = importlib.import_module("mlx_lm.generate")
"""mlx_lm's generate module (``mlx_lm.generate`` the attribute is the function of that name)."""
