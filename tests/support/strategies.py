"""Shared Hypothesis strategies: the public ``snapstore.testing`` ones (engines use the same)."""

from __future__ import annotations

from snapstore.testing import DTYPES, layouts, states, token_sequences

tokens = token_sequences()

__all__ = ["DTYPES", "layouts", "states", "token_sequences", "tokens"]
