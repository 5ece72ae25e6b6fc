"""PrefixCache: a persistent, exact, hybrid-aware prefix cache for a transformers model, in one line.

``PrefixCache(model).generate(input_ids, **generate_kwargs)`` returns what ``model.generate``
returns, and keeps the state of every prompt it reads in a snapstore store: before generating it
restores the deepest stored snapshot at one of the call's *cuts* and reads only the rest; while it
reads, it captures snapshots at the cuts as pending saves, commits them when the call returns
normally and abandons them when it raises. The policy is described in docs/engine.md, section 9.

The cuts (``PrefixCache.split``) depend only on the prompt length, ``boundary`` and the call's
``cache_prefix`` — never on what the store holds — so a hit and a miss read the prompt in the same
pieces and return the same bytes: chunked prefill is not bitwise equal to one-shot prefill, but
chunked prefill with the same chunks is. ``uncached_generate`` is that reference run (no store).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from snapstore import (
    Budget,
    ConfigError,
    InvalidInputError,
    LayoutError,
    Match,
    NotFoundError,
    RestoreError,
    SaveResult,
    StateError,
    Stats,
    StoreIOError,
)

if TYPE_CHECKING:
    from ._adapter import TorchAdapter

__all__ = ["BatchNotSupportedError", "PrefixCache", "PrefixCacheStats", "default_boundary"]

log = logging.getLogger("snapstore.engine.prefix_cache")

DEFAULT_BOUNDARY = 8192  # the boundary hybrid engines in the field snapshot at
SEGMENT_BYTES = 2 << 30  # a default boundary segment holds at most this many bytes of rows
MIN_BOUNDARY = 512
RESUME = ("cut", "longest")
# generate() arguments PrefixCache owns or cannot serve: the cache is ours, the batch is one sequence
_REFUSED = {
    "past_key_values": "PrefixCache builds and restores the cache itself",
    "inputs_embeds": "PrefixCache keys snapshots by token ids; pass input_ids",
    "assistant_model": "assisted generation rolls the cache back; use model.generate",
    "prompt_lookup_num_tokens": "prompt-lookup decoding rolls the cache back; use model.generate",
}


class BatchNotSupportedError(InvalidInputError, NotImplementedError):
    """PrefixCache serves one sequence per call (batch size 1, one beam, one return sequence)."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """What a PrefixCache did since it was opened (per call, not per store lookup), plus the store's Stats."""

    calls: int
    hits: int
    misses: int
    prompt_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    captures: int
    committed: int
    abandoned: int
    skipped: int
    restore_fallbacks: int
    restore_seconds: float
    store: Stats

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


def default_boundary(layout: Any) -> int:
    """8192 tokens, halved (down to 512) while one boundary segment's rows would exceed 2 GiB.

    A boundary snapshot stores the segment's K/V rows plus the fixed state; bigger per-token
    state means a shorter segment, so a resume never re-reads more than ~2 GiB worth of rows.
    """
    b = DEFAULT_BOUNDARY
    bpt = int(layout.bytes_per_token)
    while b > MIN_BOUNDARY and b * bpt > SEGMENT_BYTES:
        b //= 2
    return b


def _positions(cache_prefix: Any) -> list[int]:
    """cache_prefix as a list of positive ints (None, an int, or an iterable of ints)."""
    if cache_prefix is None:
        return []
    vals = [cache_prefix] if _is_int(cache_prefix) else cache_prefix
    if isinstance(vals, (str, bytes)) or not isinstance(vals, Iterable):
        raise InvalidInputError(f"cache_prefix must be an int or a list of ints, got {cache_prefix!r}")
    out = []
    for v in vals:
        if not _is_int(v) or operator.index(v) < 1:
            raise InvalidInputError(f"cache_prefix positions must be ints >= 1, got {v!r}")
        out.append(operator.index(v))
    return out


def _is_int(v: Any) -> bool:
    """An integer (numpy and 0-d integer tensors too), not a bool."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


class _PromptEnd:
    """A stopping criterion that never stops: its first call (the cache holds exactly the prompt) captures it."""

    def __init__(self, capture: Any):
        self.capture = capture
        self.called = False

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if not self.called:
            self.called = True
            self.capture()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Captures:
    """One call's pending captures, a chain saved on a worker thread while the model reads on.

    A capture references the cache's K/V row tensors (transformers appends by concatenation, so
    rows already there never change) and clones its fixed parts (linear-attention state is updated
    in place by the next forward). At most one save is in flight: memory stays bounded by one
    clone of the fixed parts, and each capture's parent is the one saved before it.
    """

    def __init__(self, pc: PrefixCache, parent: int | None, namespace: str | None):
        self.pc, self.parent, self.namespace = pc, parent, namespace
        self.results: list[SaveResult] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def add(self, cache: Any, tokens: list[int], session: str | None) -> None:
        """Capture the cache after ``tokens`` (a pending delta over the previous capture, or the restore)."""
        from . import hf

        self.wait()
        snap = hf.snapshot(cache)
        if snap.layout != self.pc.store.layout:
            raise LayoutError("the cache's layout differs from the store's (batch size or model changed?)")
        if snap.n_tokens != len(tokens):
            raise LayoutError(f"the cache holds {snap.n_tokens} tokens, the capture names {len(tokens)}")
        fixed = snap.layout.fixed
        parts = {k: v.clone() if k in fixed and isinstance(v, torch.Tensor) else v for k, v in snap.parts.items()}
        self._thread = threading.Thread(target=self._run, args=(list(tokens), parts, snap, session),
                                        name="snapstore-prefix-capture", daemon=True)
        self._thread.start()

    def _run(self, tokens: list[int], parts: dict[str, Any], snap: Any, session: str | None) -> None:
        try:
            res = self.pc._save(tokens, parts, snap, self.parent, session, self.namespace)
        except BaseException as e:  # handed to the caller's thread by wait()
            self._error = e
            return
        if res is not None and res.ok:
            self.results.append(res)
            self.parent = res.snapshot_id
            self.pc._add(captures=1)

    def wait(self) -> None:
        """Wait for the save in flight; re-raise its error here, in the caller's thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def drain(self) -> None:
        """Wait for the save in flight, dropping its error (the call is failing already)."""
        try:
            self.wait()
        except BaseException as e:
            log.warning("prefix cache: a capture failed while the call was failing: %s", e)


class PrefixCache:
    """A persistent prefix cache for one transformers model: ``generate`` restores, reads the rest, captures.

    path: the store directory (None: ``$SNAPSTORE_DIR``, else the per-user cache dir). boundary:
    tokens between automatic snapshots while reading a prompt (None: :func:`default_boundary`;
    0: none). budget: a :class:`snapstore.Budget` (None: environment / defaults). resume: ``"cut"``
    (default) restores only at one of the call's cuts, so the output is byte-identical to
    :meth:`uncached_generate`; ``"longest"`` restores the longest stored prefix wherever it ends
    (more reuse; the output then equals ``uncached_generate`` with that position added to
    ``cache_prefix``). pack: the checkpoint's hash for the identity (default: SHA-256 of the
    weights). store_options go to :func:`snapstore.engine.hf.open_store` (drop_stale, chunk_bytes,
    codec, staging_bytes, check_rows, staging, extra). One ``generate`` at a time per instance.
    """

    def __init__(self, model: Any, path: str | os.PathLike[str] | None = None, *, boundary: int | None = None,
                 budget: Budget | None = None, resume: str = "cut", pack: str | None = None,
                 **store_options: Any):
        from . import hf

        if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 0):
            raise ConfigError(f"boundary must be None, 0 (off) or a positive number of tokens, got {boundary!r}")
        if resume not in RESUME:
            raise ConfigError(f"resume must be one of {RESUME}, got {resume!r}")
        if "batch" in store_options:
            raise ConfigError("PrefixCache serves batch size 1; do not pass batch=")
        self.model = model
        self.device = next(model.parameters()).device
        self.adapter: TorchAdapter = hf.open_store(
            model, path, pack=pack or "sha256:" + hf.weights_sha256(model), budget=budget, **store_options)
        self.store = self.adapter.store
        self.boundary = default_boundary(self.store.layout) if boundary is None else boundary
        self.resume = resume
        self._lock = threading.Lock()
        self._n: dict[str, float] = dict.fromkeys(
            ("calls", "hits", "misses", "prompt_tokens", "restored_tokens", "prefilled_tokens", "captures",
             "committed", "abandoned", "skipped", "restore_fallbacks", "restore_seconds"), 0)
        self._closed = False

    # -- the split ------------------------------------------------------------------------------
    def split(self, n_tokens: int, cache_prefix: Any = None) -> list[int]:
        """The cuts a ``generate`` of an ``n_tokens`` prompt reads at (sorted, each < n_tokens).

        Every multiple of ``boundary`` and every ``cache_prefix`` position below the prompt's end.
        The prompt is read in the pieces between cuts, the last piece by ``model.generate`` itself.
        """
        cuts = {p for p in _positions(cache_prefix) if p < n_tokens}
        if self.boundary:
            cuts.update(range(self.boundary, n_tokens, self.boundary))
        return sorted(cuts)

    # -- generate -------------------------------------------------------------------------------
    def generate(self, input_ids: Any, *, cache_prefix: Any = None, session: str | None = None,
                 namespace: str | None = None, **generate_kwargs: Any) -> Any:
        """``model.generate(input_ids, **generate_kwargs)`` through the prefix cache; returns what it returns.

        cache_prefix: a position (or list) to snapshot exactly at — the end of the system prompt or
        of the previous turn — so later prompts sharing it restore all of it. session: the
        conversation's key; the prompt's own snapshot supersedes the session's previous one.
        namespace: a tenant scope (nothing is matched or shared across namespaces).
        """
        from transformers import DynamicCache

        ids = self._check(input_ids, generate_kwargs)
        if session is not None and (not isinstance(session, str) or not session):
            raise InvalidInputError(f"session must be None or a non-empty string, got {session!r}")
        tokens: list[int] = ids[0].tolist()
        n = len(tokens)
        cuts = self.split(n, cache_prefix)
        m, prompt_stored = self._lookup(tokens, cuts, namespace)
        cache, start, parent = None, 0, None
        if m is not None:
            cache, start, parent = self._restore(m, session)
            if self.resume == "longest" and start and start not in cuts:
                cuts = sorted({*cuts, start})
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        self._add(calls=1, hits=int(start > 0), misses=int(start == 0), prompt_tokens=n, restored_tokens=start,
                  prefilled_tokens=n - start)
        caps = _Captures(self, parent, namespace)

        def prompt_end() -> None:
            if not prompt_stored and cache.get_seq_length() == n:
                caps.add(cache, tokens, session)

        try:
            self._prefill(ids, cache, start, cuts, lambda c: caps.add(cache, tokens[:c], None))
            out = self._generate(ids, cache, generate_kwargs, _PromptEnd(prompt_end))
            caps.wait()
        except BaseException:
            caps.drain()
            self._abandon(caps.results)
            raise
        self._commit(caps.results)
        return out

    def uncached_generate(self, input_ids: Any, *, cache_prefix: Any = None, **generate_kwargs: Any) -> Any:
        """What ``generate`` returns, computed from token 0 without the store: the byte-identical reference.

        ``model.generate`` over a cache prefilled at the same cuts (``split``); with no cuts it is
        plain ``model.generate(input_ids, **generate_kwargs)``.
        """
        from transformers import DynamicCache

        ids = self._check(input_ids, generate_kwargs)
        cache = DynamicCache(config=self.model.config)
        self._prefill(ids, cache, 0, self.split(ids.shape[1], cache_prefix), None)
        return self._generate(ids, cache, generate_kwargs, None)

    # -- steps ----------------------------------------------------------------------------------
    def _check(self, input_ids: Any, kw: dict[str, Any]) -> torch.Tensor:
        """input_ids as a (1, n) long tensor on the model's device; refuse what the cache cannot serve."""
        if self._closed:
            raise StateError("this PrefixCache is closed")
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
            raise InvalidInputError(f"input_ids must be (1, n) token ids, got shape {tuple(ids.shape)} {ids.dtype}")
        if ids.shape[0] != 1:
            raise BatchNotSupportedError(f"a batch of {ids.shape[0]} sequences: PrefixCache serves one sequence "
                                         "per call; call generate once per prompt (batching is not done yet)")
        if ids.shape[1] == 0:
            raise InvalidInputError("input_ids is empty: generate needs at least one prompt token")
        for key, why in _REFUSED.items():
            if kw.get(key) is not None:
                raise InvalidInputError(f"generate({key}=...) is not supported: {why}")
        if kw.get("use_cache") is False:
            raise InvalidInputError("generate(use_cache=False) reads no cache; call model.generate directly")
        gc = kw.get("generation_config") or self.model.generation_config
        for key in ("num_beams", "num_return_sequences"):
            value = kw.get(key, getattr(gc, key, 1))
            if value not in (None, 1):
                raise BatchNotSupportedError(f"generate({key}={value}) expands the cache to a batch; PrefixCache "
                                             "serves one sequence (batching is not done yet)")
        mask = kw.get("attention_mask")
        if mask is not None and (tuple(mask.shape) != tuple(ids.shape) or not bool(torch.all(mask == 1))):
            raise InvalidInputError("attention_mask must be all ones for the one (unpadded) sequence")
        return ids.to(device=self.device, dtype=torch.long)

    def _lookup(self, tokens: list[int], cuts: list[int], namespace: str | None) -> tuple[Match | None, bool]:
        """The snapshot to resume from (deepest at a cut, or the longest), and whether the whole prompt is stored."""
        n = len(tokens)
        m = self.store.match(tokens, namespace=namespace)
        prompt_stored = m is not None and m.n_tokens == n
        while m is not None:
            if m.n_tokens < n and (self.resume == "longest" or m.n_tokens in cuts):
                return m, prompt_stored
            # a snapshot off the split (or the whole prompt: the last token must be read to get
            # its logits): look again below it, at the deepest cut (or one token short of the prompt)
            below = n - 1 if self.resume == "longest" else max((c for c in cuts if c < m.n_tokens), default=0)
            if below <= 0:
                break
            m = self.store.match(tokens[:below], namespace=namespace)
        return None, prompt_stored

    def _restore(self, m: Match, session: str | None) -> tuple[Any, int, int | None]:
        """Restore ``m`` into a fresh cache (as ``session``: the conversation's own snapshots stay
        supersedable); on failure (damage, eviction race) read from token 0 instead."""
        from . import hf

        t0 = time.perf_counter()
        try:
            cache, res = hf.restore(self.model.config, self.adapter, m, device=self.device, session=session)
        except (RestoreError, NotFoundError) as e:
            # the split does not depend on the store, so re-reading from 0 yields the same bytes
            log.warning("prefix cache: restoring snapshot %s failed (%s); reading the prompt from token 0",
                        m.snapshot_id, e)
            self._add(restore_fallbacks=1)
            return None, 0, None
        self._add(restore_seconds=time.perf_counter() - t0)
        return cache, res.n_tokens, m.snapshot_id

    def _prefill(self, ids: torch.Tensor, cache: Any, start: int, cuts: list[int], at_cut: Any) -> None:
        """Read the prompt from ``start`` to its last cut, one piece per cut, calling ``at_cut`` at each.

        Each piece is read by ``model.generate`` itself (one new token, discarded): the forward
        gets exactly the inputs generate's own prefill gives the last piece (position ids, mask,
        logits_to_keep, model-specific preparation), so a snapshot taken at the prompt's end and
        one taken at a cut hold the same bytes a later call computes for that piece.
        """
        pos = start
        for c in cuts:
            if c <= pos:
                continue
            self.model.generate(ids[:, :c], attention_mask=torch.ones_like(ids[:, :c]), past_key_values=cache,
                                generation_config=self._piece_config())
            pos = c
            if at_cut is not None:
                at_cut(c)

    def _piece_config(self) -> Any:
        """A generation config for reading one piece: greedy, one new token, nothing returned but the ids."""
        from transformers import GenerationConfig

        gc = self.model.generation_config
        pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
        if isinstance(pad, list):
            pad = pad[0] if pad else None
        return GenerationConfig(max_new_tokens=1, min_new_tokens=0, do_sample=False, num_beams=1,  # type: ignore[no-untyped-call]
                                pad_token_id=0 if pad is None else pad, eos_token_id=None)

    def _generate(self, ids: torch.Tensor, cache: Any, kw: dict[str, Any], hook: _PromptEnd | None) -> Any:
        """``model.generate`` over the prefilled cache; it reads the last piece and decodes."""
        from transformers import StoppingCriteriaList

        kw = dict(kw)
        kw["attention_mask"] = torch.ones_like(ids)  # one unpadded sequence: a pad id in the prompt is a token
        if hook is not None:
            kw["stopping_criteria"] = StoppingCriteriaList([hook, *(kw.get("stopping_criteria") or [])])
        return self.model.generate(ids, past_key_values=cache, **kw)

    def _save(self, tokens: list[int], parts: dict[str, Any], snap: Any, parent: int | None,
              session: str | None, namespace: str | None) -> SaveResult | None:
        """One pending capture; a failing disk skips the capture (counted), it does not fail the call."""
        kw: dict[str, Any] = {"commit": False, "session": session, "namespace": namespace,
                              "token_dims": snap.token_dims, "pad_rows": snap.pad_rows}
        try:
            try:
                res = self.adapter.save(tokens, parts, parent=parent, **kw)
            except NotFoundError:
                # the parent was evicted meanwhile: store this capture whole
                res = self.adapter.save(tokens, parts, parent=None, **kw)
        except StoreIOError as e:
            log.warning("prefix cache: capture at %d tokens failed (%s); continuing without it", len(tokens), e)
            self._add(skipped=1)
            return None
        if not res.ok:
            self._add(skipped=1)
        return res

    def _commit(self, pending: list[SaveResult]) -> None:
        """Commit the call's captures (one chain: committing the deepest commits them all, root first)."""
        if not pending:
            return
        try:
            res = self.store.commit(pending[-1])
        except StoreIOError as e:
            log.warning("prefix cache: commit failed (%s); the captures are dropped", e)
            self._abandon(pending)
            return
        if res.ok:
            self._add(committed=len(pending))
        else:
            self._add(skipped=len(pending))

    def _abandon(self, pending: list[SaveResult]) -> None:
        """Drop the call's pending captures (abandoning the first drops its pending descendants)."""
        if not pending:
            return
        try:
            self.store.abandon(pending[0])
        except StoreIOError as e:  # the next open (or gc) drops them: their owner is gone by then
            log.warning("prefix cache: abandon failed (%s)", e)
        self._add(abandoned=len(pending))

    def _add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self._n[k] += v

    # -- the rest -------------------------------------------------------------------------------
    def stats(self) -> PrefixCacheStats:
        """Per-call counters since open (hits, tokens restored vs read, captures) and the store's Stats."""
        with self._lock:
            n = dict(self._n)
        ints = {k: int(v) for k, v in n.items() if k != "restore_seconds"}
        return PrefixCacheStats(**ints, restore_seconds=float(n["restore_seconds"]), store=self.store.stats())

    def close(self) -> None:
        """Close the store (pending captures of this process are abandoned) and release the staging buffer."""
        if self._closed:
            return
        self._closed = True
        try:
            self.adapter.close()
        finally:
            self.store.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
