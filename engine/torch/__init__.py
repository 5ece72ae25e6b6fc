"""The torch engine adapter: torch tensors on any device <-> snapstore, through a bounded staging buffer.

``TorchAdapter`` saves and restores named tensors of any layout (token axis anywhere, strided
views, bf16/fp8) on CPU or CUDA (docs/engine.md). Its names are loaded on first use (PEP 562), so
importing this package, or ``snapstore.engine``, imports no torch; without torch, using one of them
raises :class:`TorchMissingError` saying what to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from snapstore.engine._lazy import lazy_names

if TYPE_CHECKING:
    from ._adapter import TorchAdapter, layout_of, part_sink, part_source
    from ._device_staging import DEFAULT_STAGING_BYTES, Staging, shared_staging
    from ._dtypes import canonical, dtype_name, fixed_spec, rows_spec, torch_dtype
    from ._tensor_hash import tensors_sha256
    from ._tensor_io import TensorSink, TensorSource
    from ._torch_paged import TorchPagedRows
    from ._types import TokenIds

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Staging",
    "TensorSink",
    "TensorSource",
    "TokenIds",
    "TorchAdapter",
    "TorchPagedRows",
    "canonical",
    "dtype_name",
    "fixed_spec",
    "layout_of",
    "part_sink",
    "part_source",
    "rows_spec",
    "shared_staging",
    "tensors_sha256",
    "torch_dtype",
]

_WHERE = {
    "TorchAdapter": "._adapter", "layout_of": "._adapter", "part_sink": "._adapter", "part_source": "._adapter",
    "canonical": "._dtypes", "dtype_name": "._dtypes", "fixed_spec": "._dtypes", "rows_spec": "._dtypes",
    "torch_dtype": "._dtypes", "TorchPagedRows": "._torch_paged", "DEFAULT_STAGING_BYTES": "._device_staging",
    "Staging": "._device_staging", "TensorSink": "._tensor_io", "TensorSource": "._tensor_io",
    # for the other integrations that hold torch tensors (transformers): the process's shared staging
    # buffer, the token-ids type, and the bounded-memory hash of named tensors
    "shared_staging": "._device_staging", "TokenIds": "._types", "tensors_sha256": "._tensor_hash",
}

__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__, check="._deps")
