"""Shared Hypothesis strategies (kept for existing imports): see support/strategies.py."""

from __future__ import annotations

from support.strategies import DTYPES, layouts, states, token_sequences, tokens

__all__ = ["DTYPES", "layouts", "states", "token_sequences", "tokens"]
