"""The workload model: deterministic conversations whose state is a function of (conversation,
tokens, turn), so any process can check a snapshot from its tokens alone, plus the one-off random
state (:func:`make_state`) and the hashing helpers that compare restored parts with saved ones."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import snapstore as ss
from support.model import LAYOUT

State = dict[str, np.ndarray]


def _np_dtype(name: str) -> np.dtype[Any] | None:
    try:
        return np.dtype(name)
    except TypeError:
        return None  # bfloat16/float8 without ml_dtypes: hand the core raw bytes


def _view(raw: np.ndarray, dtype: str, shape: tuple[int, ...], flat: tuple[int, ...]) -> np.ndarray:
    """``raw`` bytes as ``dtype`` of ``shape``, or as uint8 of ``flat`` where numpy lacks the dtype."""
    dt = _np_dtype(dtype)
    return raw.view(dt).reshape(shape) if dt is not None else raw.reshape(flat)


def make_state(layout: ss.Layout, n: int, seed: int = 0) -> State:
    """Random parts for ``n`` tokens (row streams hold exactly n rows), a new draw for each seed."""
    rng = np.random.default_rng(seed)
    out: State = {}
    for name, spec in layout.fixed.items():
        raw = rng.integers(0, 256, spec.nbytes, dtype=np.uint8)
        out[name] = _view(raw, spec.dtype, spec.shape, (spec.nbytes,))
    for name, rspec in layout.rows.items():
        raw = rng.integers(0, 256, n * rspec.row_bytes, dtype=np.uint8)
        out[name] = _view(raw, rspec.dtype, (n, *rspec.row_shape), (n, rspec.row_bytes))
    return out


def save_chain(s: ss.Store, toks: np.ndarray, cuts: list[int], seed: int = 3) -> int:
    """Save ``toks`` as a chain of snapshots ending at each of ``cuts`` (one state, each a delta over
    the one before: ``parent="auto"``); the leaf's id."""
    state = make_state(LAYOUT, len(toks), seed)
    sid = 0
    for n in cuts:
        r = s.save(toks[:n], {k: (v if k == "rec.state" else v[:n]) for k, v in state.items()})
        assert r.ok and r.snapshot_id is not None, r
        sid = r.snapshot_id
    return sid


class Workload:
    """``conversations`` conversations of up to ``max_tokens`` tokens over ``layout``.

    Conversation ``k`` has a fixed token sequence whose first token is ``k`` (so no two share a
    prefix) and fixed row streams: a row depends only on (k, row), so a delta over any prefix is a
    valid delta. Fixed parts depend on (k, n, turn): a later turn at the same length is new state.
    ``levels`` is how many distinct values a byte takes: 16 compresses (zstd ~0.6), 256 does not.
    """

    def __init__(self, layout: ss.Layout = LAYOUT, *, conversations: int = 6, max_tokens: int = 320,
                 levels: int = 16, vocab: int = 50_000):
        self.layout, self.conversations, self.max_tokens = layout, conversations, max_tokens
        self.levels, self.vocab = levels, vocab
        self._tokens: dict[int, np.ndarray] = {}
        self._rows: dict[int, State] = {}

    def tokens(self, k: int) -> np.ndarray:
        """All ``max_tokens`` tokens of conversation ``k`` (int64; slice for a prefix)."""
        if k not in self._tokens:
            t = np.random.default_rng(7000 + k).integers(0, self.vocab, self.max_tokens, dtype=np.int64)
            t[0] = k
            self._tokens[k] = t
        return self._tokens[k]

    def rows(self, k: int) -> State:
        """Every row stream of conversation ``k``, ``max_tokens`` rows each (read-only views)."""
        if k not in self._rows:
            rng = np.random.default_rng(9000 + k)
            rows: State = {}
            for name, spec in self.layout.rows.items():
                raw = rng.integers(0, self.levels, self.max_tokens * spec.row_bytes, dtype=np.uint8)
                rows[name] = _view(raw, spec.dtype, (self.max_tokens, *spec.row_shape),
                                   (self.max_tokens, spec.row_bytes))
                rows[name].flags.writeable = False
            self._rows[k] = rows
        return self._rows[k]

    def state(self, k: int, n: int, turn: int = 0) -> State:
        """The parts of conversation ``k`` after ``n`` tokens at ``turn`` (fresh, writable arrays;
        row streams hold exactly n rows)."""
        out = {name: arr[:n].copy() for name, arr in self.rows(k).items()}
        rng = np.random.default_rng(100_000 * (k + 1) + n + 1_000_000_000 * turn)
        for name, spec in self.layout.fixed.items():
            raw = rng.integers(0, self.levels, spec.nbytes, dtype=np.uint8)
            out[name] = _view(raw, spec.dtype, spec.shape, (spec.nbytes,))
        return out

    def identify(self, tokens: Any) -> tuple[int, int] | None:
        """(k, n) of a token sequence of this workload, or None if it is none of them."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return None
        k = int(tokens[0])
        if not 0 <= k < self.conversations or not np.array_equal(np.asarray(tokens, dtype=np.int64),
                                                                 self.tokens(k)[:n]):
            return None
        return k, n

    def conversation(self, k: int) -> Conversation:
        """Conversation ``k`` as a turn-by-turn cursor."""
        return Conversation(self, k)


class Conversation:
    """One conversation of a :class:`Workload`, turn by turn: tokens and rows only grow, and every
    :meth:`state` call is a new turn (new fixed parts)."""

    def __init__(self, workload: Workload, k: int):
        self.workload, self.k, self.turn = workload, k, 0
        self.tokens = workload.tokens(k)
        self.rows = workload.rows(k)

    def state(self, n: int | None = None) -> State:
        """The next turn's parts after ``n`` tokens (default: all rows, the caller saves a prefix)."""
        self.turn += 1
        return self.workload.state(self.k, self.workload.max_tokens if n is None else n, self.turn)


def empty_like_state(state: State) -> State:
    """Zeroed destinations of the same shapes."""
    return {k: np.zeros_like(v) for k, v in state.items()}


def sha(buf: Any) -> str:
    """SHA-256 of a buffer's bytes."""
    arr = np.ascontiguousarray(buf)  # bytes through a uint8 view: ml_dtypes' types export no buffer format
    return hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()


def part_hashes(layout: ss.Layout, state: State, rows: dict[str, int]) -> dict[str, str]:
    """SHA-256 of every fixed part and of the valid rows of every stream."""
    out = {}
    for name, arr in state.items():
        if name in layout.rows:
            out[name] = sha(arr.reshape(-1).view(np.uint8)[: rows[name] * layout.rows[name].row_bytes])
        else:
            out[name] = sha(arr)
    return out
