"""``Store.load``: a prefix in one call — match, size the destinations, restore — that leaves the
engine clean on a miss or an error.

Every engine wrote the same eight lines: match; on a hit, describe the snapshot, allocate
blocks for its rows, restore into them; on an error, give the blocks back. The error half is
the easy one to get wrong (blocks leaked on a corrupt chunk), so it lives here once:

- a miss: ``None``, and ``allocate`` is never called;
- a hit: ``allocate(details)`` gets the checked plan (:class:`snapstore.MatchDetails`: rows per
  stream, bytes) and returns the destinations; the restore writes them;
- an error after ``allocate`` returned: ``release(destinations)`` is called, then the error is
  re-raised (a ``release`` that raises too is logged; the restore's error is the one raised);
- an error raised by ``allocate`` itself: ``release({})`` is called — allocate may have taken
  blocks before it failed, and only the engine knows which — then that error is re-raised.
  So ``release`` frees whatever the engine holds for this load, whatever mapping it gets.

Instead of tokens, ``load`` takes the :class:`snapstore.Match` or :class:`snapstore.MatchDetails`
of an earlier ``match()`` / ``lookup()`` (a scheduler that sized its blocks first): that prefix is
restored as it is, not matched again — the hit is counted once, and no other snapshot is picked.

The allocation happens inside the restore's plan step (``restore(m, into=callable)``), so a
shared-tier match and a local one go the same way and the plan is checked once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from snapstore._errors import InvalidInputError
from snapstore._refs import SnapshotRef, resolve_ref
from snapstore._results import LoadResult, Match, MatchDetails, RestoreResult
from snapstore._tokens import TokensLike
from snapstore.parts.buffers import Destination

__all__ = ["LoadStore", "load_prefix"]

log = logging.getLogger("snapstore")

Allocate = Callable[[MatchDetails], Mapping[str, Destination]]
Release = Callable[[Mapping[str, Destination]], object]


class LoadStore(Protocol):
    """The calls ``load`` makes on its Store (:class:`snapstore.Store` is one)."""

    def match(self, tokens: TokensLike, *, namespace: str | None = None,
              exclude: Iterable[SnapshotRef] | None = ()) -> Match | None: ...

    def restore(self, m: SnapshotRef,
                into: Mapping[str, Destination] | Callable[[MatchDetails], Mapping[str, Destination]],
                components: Iterable[str] | None = None, *, namespace: str | None = None,
                rows_from: int = 0, session: str | None = None) -> RestoreResult: ...


def load_prefix(store: LoadStore, tokens: TokensLike | Match | MatchDetails, allocate: Allocate,
                release: Release | None, *, components: Iterable[str] | None, namespace: str | None,
                exclude: Iterable[SnapshotRef] | None, session: str | None) -> LoadResult | None:
    """Match ``tokens`` (or take the Match / MatchDetails given); on a hit allocate and restore
    (see the module docstring)."""
    if isinstance(tokens, (Match, MatchDetails)):
        if exclude:
            raise InvalidInputError("load(): exclude= passes over snapshots of the match load makes; given a "
                                    "Match or MatchDetails there is none (match or lookup again with exclude=)")
        ref = resolve_ref(tokens)  # the prefix the earlier call matched: restored as it is, counted once
        m = tokens if isinstance(tokens, Match) else Match(ref.snapshot_id, tokens.n_tokens, tokens.namespace,
                                                           why=tokens.why)
    else:
        found = store.match(tokens, namespace=namespace, exclude=exclude)
        if found is None:
            return None
        m = found
    if not callable(allocate) or (release is not None and not callable(release)):
        raise InvalidInputError("load() takes allocate(details) -> destinations and release(destinations) or None: "
                                f"callables, got {allocate!r:.60} and {release!r:.60}")
    got: dict[str, Any] = {}

    def into(details: MatchDetails) -> Mapping[str, Destination]:
        got["details"] = details
        got["into"] = {}  # allocate raising: release({}) frees what it took before it failed
        got["into"] = allocate(details)
        return got["into"]  # type: ignore[no-any-return]

    try:
        res = store.restore(m, into, components, namespace=namespace, session=session)
    except BaseException:
        if "into" in got and release is not None:
            try:
                release(got["into"])
            except Exception:
                log.exception("load(): release() raised while giving back the destinations of a failed restore")
        raise
    return LoadResult(res.n_tokens, res.rows, res.missing_components, res.chain, res.bytes_restored, res.seconds,
                      m, got["details"], got["into"])
