"""SGLang page keys as snapstore tokens: each chained page hash becomes 16 synthetic tokens.

SGLang never hands a storage backend tokens, only page hashes chained from the sequence start
(``prefix_keys`` + ``keys``). Each key is mapped to 16 tokens of 16 bits (its SHA-256), so a chain
of keys is a token sequence and snapstore's prefix model applies: one row per page
(``tokens_per_row=16``), a hit is the longest stored chain, a chain stored once is stored once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

TOKENS_PER_PAGE = 16  # 16 x 16 bits = the key's whole SHA-256: no two keys share tokens


def key_tokens(key: str) -> np.ndarray:
    """The 16 tokens (uint16 values as int64) that stand for one page key."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return np.frombuffer(digest, dtype="<u2").astype(np.int64)


def chain_tokens(keys: Sequence[str]) -> np.ndarray:
    """The token sequence of a chain of page keys (``len(keys) * 16`` tokens)."""
    if not keys:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([key_tokens(k) for k in keys])
