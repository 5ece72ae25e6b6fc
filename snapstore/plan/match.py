"""Match: the longest committed snapshot of one identity whose tokens are a prefix of a prompt.

The find-key index (:mod:`snapstore.catalog.find_keys`: one cheap integer per 256-token block of the prompt, the
deepest 32 first, the rest only on no hit) narrows the candidates; each candidate's chain of stored
token blobs, compared with the prompt encoded once, decides — the only check trusted, since a find
key may collide. A snapshot that would read a quarantined chunk is passed over, so the
next-longest prefix serves until a save heals the chunk; so is one whose parts cannot restore into
the store's layout (:mod:`snapstore.plan.fit`: one identity may hold snapshots of two layouts).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from snapstore._layout import Layout
from snapstore._tokens import Encoded, decode_tokens, spells_chain, spells_prefix, spells_segment
from snapstore.catalog.chain_cache import ChainReads
from snapstore.catalog.find_keys import find_keys
from snapstore.catalog.queries import SnapRow, Txn
from snapstore.plan.fit import fits
from snapstore.plan.prefix import find_prefix, prefix_chain
from snapstore.plan.restore_plan import needs_quarantined

__all__ = ["Prompt", "best_match", "longest_prefix", "tokens_of"]


class Prompt:
    """A prompt and what matching it derives from its tokens alone — find keys, its encodings, the
    block-prefix chain — computed once however often it is matched: restore or recompute matches
    one prompt again past each prefix it weighs (issue 31)."""

    __slots__ = ("_chains", "_encoded", "_keys", "arr")

    def __init__(self, arr: np.ndarray):
        self.arr = arr
        self._keys: np.ndarray | None = None
        self._encoded: Encoded | None = None
        self._chains: dict[int, list[bytes]] = {}

    @property
    def keys(self) -> np.ndarray:
        """The prompt's find keys (:func:`snapstore.catalog.find_keys.find_keys`)."""
        if self._keys is None:
            self._keys = find_keys(self.arr)
        return self._keys

    @property
    def encoded(self) -> Encoded:
        """The prompt in each stored token width, shared by every candidate compared with it."""
        if self._encoded is None:
            self._encoded = Encoded(self.arr)
        return self._encoded

    def chain(self, step: int) -> list[bytes]:
        """The block-prefix keys of the prompt at ``step`` (:func:`snapstore.plan.prefix.prefix_chain`)."""
        got = self._chains.get(step)
        if got is None:
            got = self._chains[step] = prefix_chain(self.arr, step, len(self.arr))
        return got


def tokens_of(chain: list[SnapRow]) -> np.ndarray:
    """The tokens of a chain's leaf, from the token segments its links (root first) store."""
    segs = [decode_tokens(s.tokens, s.token_width, s.n_tokens - s.base_tokens) for s in chain]
    return np.concatenate(segs) if segs else np.zeros(0, dtype="<u8")


def longest_prefix(c: Txn, layout: Layout, identity_key: str, ns: str, prompt: Prompt | np.ndarray, skip: set[int],
                   not_before: float, kept: Callable[[], ChainReads | None] | None = None) -> SnapRow | None:
    """The longest restorable committed snapshot whose tokens are ``arr[:n]``, or None.

    ``layout``: the store's (a snapshot that cannot restore into it is passed over); ``skip``:
    ids passed over; ``not_before``: snapshots last used earlier have expired (TTL), unless a name
    pins them (:meth:`Txn.ttl_fresh`: named snapshots are exempt from the TTL in every query).
    ``kept``: gives the plan reads kept under this transaction's catalog stamp (asked once a
    candidate's own tokens match, so a miss reads no stamp): a candidate whose chain they hold has
    its links checked against them, token by token, and its row taken from them (two statements
    fewer a hit, issue 48); any other is checked in SQL.
    """
    prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
    arr, keys = prompt.arr, prompt.keys
    encoded = prompt.encoded  # the prompt in each stored token width, encoded once for every candidate
    broken: dict[int, bool] | None = None  # read once a candidate's tokens are a prefix
    for sid, _n, _key, own, lkey in c.match_candidates(identity_key, ns, keys, len(arr), not_before):
        if sid in skip or not spells_segment(own, arr, encoded):
            continue  # excluded, or its own last tokens differ (a sibling, a find-key collision)
        reads = kept() if kept is not None else None
        chain = reads.kept_chain(sid) if reads is not None else None
        if chain is not None:  # the kept rows (the same rows, under this stamp): root to leaf, every token
            assert reads is not None
            whole = reads.kept_spelling(sid)  # the links joined: one compare; else link by link
            if not (spells_segment(whole, arr, encoded) if whole is not None else spells_prefix(
                    [(link.tokens, link.token_width, link.base_tokens, link.n_tokens) for link in chain], arr,
                    encoded)):
                continue
        elif own[2]:  # the links below its own segment, compared in SQL against the prompt in its width
            w = own[1]
            below = memoryview(encoded.width(w))[:own[2] * w]
            # one aggregate statement shows the usual case; anything else takes the exact link-by-link check
            if not c.chain_spells(sid, w, below, encoded.narrow()) and not spells_chain(
                    own, c.chain_links(sid, 1, w, below), arr, encoded):
                continue  # the tokens below its own segment differ: the stored blobs decide, not the key
        broken = c.quarantined_users() if broken is None else broken
        if broken and needs_quarantined(chain if chain is not None else c.chain(sid), broken, leaf=True):
            continue  # it cannot restore until a save heals its chunk: the next-longest serves
        if not fits(c, layout, sid, lkey):
            continue  # saved under another layout that this one cannot restore: the next-longest serves
        return chain[-1] if chain is not None else c.snapshot(sid)
    return None


def best_match(c: Txn, layout: Layout, identity_key: str, ns: str, prompt: Prompt | np.ndarray, skip: set[int],
               not_before: float, kept: Callable[[], ChainReads | None] | None = None) -> tuple[SnapRow, int] | None:
    """``(snapshot, tokens it serves)``: the longest exact prefix (:func:`longest_prefix`), or, for a
    layout with ``tokens_per_row``, rows [0, k) of any snapshot sharing a longer block-aligned
    prefix with ``arr`` (:mod:`snapstore.plan.prefix`); None on a miss. ``prompt``: the prompt's tokens,
    or a :class:`Prompt` of them kept across matches of the same prompt; ``kept``: as for
    :func:`longest_prefix`."""
    prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
    arr = prompt.arr
    hit = longest_prefix(c, layout, identity_key, ns, prompt, skip, not_before, kept)
    exact = (hit, hit.n_tokens) if hit is not None else None
    broken: dict[int, bool] | None = None

    def usable(snap: SnapRow, k: int) -> bool:
        nonlocal broken
        if snap.id in skip or not c.ttl_fresh(snap.id, snap.last_used, not_before) or \
                not fits(c, layout, snap.id, snap.layout_key):
            return False
        chain = c.chain(snap.id)
        broken = c.quarantined_users() if broken is None else broken
        if broken and needs_quarantined(chain, broken, leaf=True):
            return False
        return bool(np.array_equal(tokens_of(chain)[:k], arr[:k]))

    more = find_prefix(c, layout, identity_key, ns, arr, exact[1] if exact else 0, usable, prompt.chain)
    return (more.snap, more.n_tokens) if more is not None else exact
