"""Former home of the adapter's tensor code, kept so that ``snapstore.engine._torch`` imports keep working.

The code now lives in modules with one job each: ``_dtypes`` (dtype names, the canonical view,
part specs), ``_copy`` (bit-exact byte-range copies and the refusals that guard them),
``_staging`` (the staging buffer and the ordering of device copies) and ``_tensor_io``
(``TensorSource`` / ``TensorSink``). Import from those, or from ``snapstore.engine``; the old
private names (``_xfer``, ``_bits``, ``_host_u8``, ``_sync_copy``) are aliases of the new ones.
"""

from __future__ import annotations

from ._copy import Copy, flat_bytes, overlaps_itself, refuse_lazy, refuse_overlap
from ._copy import copy_range as _xfer
from ._copy import host_u8 as _host_u8
from ._copy import same_width as _bits
from ._copy import sync_copy as _sync_copy
from ._dtypes import canonical, dtype_name, fixed_spec, rows_spec, torch_dtype
from ._staging import ALIGN, DEFAULT_STAGING_BYTES, MIB, Staging, shared_staging
from ._tensor_io import TensorSink, TensorSource

__all__ = [
    "ALIGN",
    "Copy",
    "DEFAULT_STAGING_BYTES",
    "MIB",
    "Staging",
    "TensorSink",
    "TensorSource",
    "_bits",
    "_host_u8",
    "_sync_copy",
    "_xfer",
    "canonical",
    "dtype_name",
    "fixed_spec",
    "flat_bytes",
    "overlaps_itself",
    "refuse_lazy",
    "refuse_overlap",
    "rows_spec",
    "shared_staging",
    "torch_dtype",
]
