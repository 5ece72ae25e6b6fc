"""Engine adapter: torch tensors on any device <-> snapstore, through a bounded staging buffer.

``TorchAdapter`` saves and restores named tensors of any layout (token axis anywhere, strided
views, bf16/fp8) on CPU or CUDA; ``snapstore.engine.hf`` integrates Hugging Face transformers
caches. See docs/engine.md. The core package never imports torch; this package does.
"""

from __future__ import annotations

from . import _deps  # noqa: F401  (first: without torch, an error that says what to install)

# isort: split
from ._adapter import TorchAdapter, layout_of, part_sink, part_source
from ._dtypes import canonical, dtype_name, fixed_spec, rows_spec, torch_dtype
from ._paged import TorchPagedRows
from ._staging import DEFAULT_STAGING_BYTES, Staging
from ._tensor_io import TensorSink, TensorSource

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Staging",
    "TensorSink",
    "TensorSource",
    "TorchAdapter",
    "TorchPagedRows",
    "canonical",
    "dtype_name",
    "fixed_spec",
    "layout_of",
    "part_sink",
    "part_source",
    "rows_spec",
    "torch_dtype",
]
