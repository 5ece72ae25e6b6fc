"""The adapter's one dependency, checked first: ``import snapstore.engine`` without torch says what
to install instead of a bare ModuleNotFoundError from deep inside a module."""

from __future__ import annotations

from snapstore import ConfigError

__all__ = ["TorchMissingError"]


class TorchMissingError(ConfigError, ModuleNotFoundError):
    """``snapstore.engine`` imported where torch is not installed. Also an ImportError, so the
    ``try: import ... except ImportError`` of an optional integration keeps working."""


try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    missing = TorchMissingError("snapstore.engine (the torch adapter) needs torch, which is not installed: "
                                "pip install 'snapstore[torch]' (or 'snapstore[hf]' for the transformers "
                                "integration). The core package (import snapstore) needs no torch.")
    missing.name = "torch"
    raise missing from None
