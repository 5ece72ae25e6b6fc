"""The SGLang backend's dependency, checked first: without sglang, an error that says what to install
instead of a bare ModuleNotFoundError from deep inside the backend's module."""

from __future__ import annotations

from snapstore import ConfigError

__all__ = ["SglangMissingError"]


class SglangMissingError(ConfigError, ModuleNotFoundError):
    """``snapstore.engine.sglang.SnapstoreHiCache`` asked for where sglang (or torch) is not installed.
    Also an ImportError, so SGLang's factory and ``except ImportError`` keep working."""


try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] not in ("sglang", "torch"):
        raise
    missing = SglangMissingError(f"snapstore.engine.sglang needs {e.name}, which is not installed: "
                                 "pip install 'snapstore[sglang]' (docs/engine.md, 'SGLang')")
    missing.name = e.name
    raise missing from None
