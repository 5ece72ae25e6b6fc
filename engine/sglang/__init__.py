"""SGLang HiCache storage backend: snapstore as the L3 tier behind SGLang's host memory (docs/engine.md).

Launch SGLang with ``--hicache-storage-backend dynamic`` and ``--hicache-storage-backend-extra-config
'{"backend_name": "snapstore", "module_path": "snapstore.engine.sglang", "class_name":
"SnapstoreHiCache", "interface_v1": 1, "path": "..."}'``. The backend is
:mod:`snapstore.engine.sglang._backend` (it needs sglang, ``pip install 'snapstore[sglang]'``), so it is
imported when its name is first asked for; the key mapping (``_keys``) works without sglang.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SnapstoreHiCache"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        importlib.import_module(f"{__name__}._deps")  # sglang missing: SglangMissingError says what to install
        backend = importlib.import_module(f"{__name__}._backend")  # imports sglang: only when it is wanted
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
