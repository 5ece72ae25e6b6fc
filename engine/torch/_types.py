"""Named types of the engine adapter's public signatures, instead of ``Any``.

They name what the core already accepts (docs/api.md): a part is a tensor or anything the core
takes (a buffer-protocol object or a ``PartReader`` / ``PartWriter``); a snapshot is named by its
id or by the result that reported it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch

from snapstore import Match, PartReader, PartWriter, SaveResult

__all__ = ["HostBuffer", "RowCounts", "SnapshotRef", "TensorPart", "TensorDest", "TokenIds"]

HostBuffer = Union[np.ndarray, memoryview, bytearray]
"""A host buffer the core reads or writes in place (buffer protocol)."""

TensorPart = Union[torch.Tensor, HostBuffer, bytes, PartReader]
"""One part to save: a tensor (any device, any layout), or anything ``Store.save`` takes."""

TensorDest = Union[torch.Tensor, HostBuffer, PartWriter]
"""One part to restore into: a preallocated tensor, or anything ``Store.restore`` writes into."""

TokenIds = Union[Sequence[int], np.ndarray, torch.Tensor]
"""A prompt's token ids (non-negative ints), as ``Store.save`` / ``Store.match`` take them."""

RowCounts = Union[int, Mapping[str, int], None]
"""Valid rows per row stream: one count for all, per stream, or None (the token count)."""

SnapshotRef = Union[int, np.integer[Any], Match, SaveResult]
"""A snapshot: its id, or the ``Match`` / ``SaveResult`` that named it."""
