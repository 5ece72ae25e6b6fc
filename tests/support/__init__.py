"""The tests' shared support: one identity and layout, one workload model, one store factory, and
the shared Hypothesis strategies (tests/README.md, "Where things are")."""

from __future__ import annotations

from support.model import IDENT, LAYOUT
from support.stores import DEFAULTS, StoreFactory, open_store, small_budget, store_factory
from support.strategies import DTYPES, layouts, states, token_sequences, tokens
from support.workload import Conversation, Workload, empty_like_state, make_state, part_hashes, save_chain, sha

__all__ = ["DEFAULTS", "DTYPES", "IDENT", "LAYOUT", "Conversation", "StoreFactory", "Workload", "empty_like_state",
           "layouts", "make_state", "open_store", "part_hashes", "save_chain", "sha", "small_budget", "states",
           "store_factory", "token_sequences", "tokens"]
