"""References the public API takes: snapshot ids (or results naming one), namespaces, names, exclusions."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from snapstore._errors import IdentityError, InvalidInputError, StateError
from snapstore._results import LoadResult, Match, MatchDetails, SaveResult, SnapshotInfo

__all__ = ["MAX_ID", "MAX_NAME", "MAX_NAMESPACE", "Ref", "SnapshotRef", "check_name", "excluded", "name_problem",
           "namespace_key", "namespace_problem", "ref_namespace", "resolve_ref", "session_key", "snapshot_id"]

MAX_ID = 2**63 - 1  # SQLite's INTEGER range: no snapshot id lies beyond it

# what names a snapshot in the API: its id, or the Match / SaveResult that reported it, or the
# MatchDetails (lookup, describe) or LoadResult of one — resolved by :func:`resolve_ref`
SnapshotRef = Union[int, np.integer[Any], Match, SaveResult, MatchDetails, LoadResult]


@dataclass(frozen=True, slots=True)
class Ref:
    """A snapshot reference resolved (:func:`resolve_ref`): the snapshot, the namespace the reference
    carries (None for a bare id) and the tokens it names (``upto``: a Match's or MatchDetails'
    ``n_tokens``, which may be a block-granular prefix of the snapshot; None: the whole snapshot)."""

    snapshot_id: int
    namespace: str | None
    upto: int | None


def _id(sid: Any, ref: Any) -> int:
    if isinstance(sid, numbers.Integral) and not isinstance(sid, bool):
        if not 0 <= int(sid) <= MAX_ID:
            raise InvalidInputError(f"snapshot id {int(sid)} is out of range: snapshot ids are integers in "
                                    "[1, 2**63) as save() and match() report them")
        return int(sid)
    raise InvalidInputError(f"{ref!r:.200} names no snapshot: its snapshot_id is {sid!r:.80}, not an integer")


def resolve_ref(ref: Any) -> Ref:
    """What a snapshot reference names — the one reading of a ref, for every call that takes one.

    A ref is a snapshot id (an int, numpy integers too), a :class:`Match`, a :class:`SaveResult`,
    the :class:`MatchDetails` that ``lookup()`` / ``describe()`` return, a :class:`LoadResult` (its
    match), a :class:`SnapshotInfo` (``snapshots()``), or a finished ``SaveHandle`` (its result).
    A Match and a MatchDetails name ``n_tokens`` tokens — a block-granular prefix of a longer
    snapshot restores rows ``[0, n_tokens // g)`` only, never the rows past the point where the
    snapshot leaves the prompt. Anything else is an InvalidInputError; a SaveHandle still in
    flight a StateError saying what to do.
    """
    if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
        return Ref(_id(ref, ref), None, None)
    if isinstance(ref, LoadResult):
        ref = ref.match
    if isinstance(ref, (Match, MatchDetails)):
        upto = ref.n_tokens
        if isinstance(upto, bool) or not isinstance(upto, numbers.Integral) or upto < 0:
            raise InvalidInputError(f"{type(ref).__name__}.n_tokens must be an integer >= 0, got {upto!r:.80}")
        return Ref(_id(ref.snapshot_id, ref), ref.namespace, int(upto))
    if isinstance(ref, SaveResult):
        if ref.skipped is not None:
            raise InvalidInputError(f"that save was skipped ({ref.skipped}): no snapshot was stored, so there is "
                                    "nothing to commit, abandon or restore; skipped saves are counted in "
                                    "stats().skipped")
        return Ref(_id(ref.snapshot_id, ref), ref.namespace, None)
    if isinstance(ref, SnapshotInfo):
        return Ref(_id(ref.snapshot_id, ref), ref.namespace, None)
    if callable(getattr(ref, "done", None)) and callable(getattr(ref, "result", None)) \
            and callable(getattr(ref, "add_done_callback", None)):  # a SaveHandle (save or capture, wait=False)
        if not ref.done():
            raise StateError("this save (wait=False) is still in flight, so no snapshot is known yet: wait for it "
                             "with handle.result() and pass that SaveResult (store.commit(handle.result())), "
                             "or let a Turn commit it when it lands (turn.commit(wait=False))")
        return resolve_ref(ref.result())  # a failed save raises its error here
    raise InvalidInputError(f"expected a snapshot reference — a snapshot id, Match, SaveResult, MatchDetails "
                            f"(lookup/describe) or LoadResult — got {type(ref).__name__} {ref!r:.120}")


def snapshot_id(ref: Any) -> int:
    """The snapshot id a reference names (:func:`resolve_ref`); InvalidInputError for anything else."""
    return resolve_ref(ref).snapshot_id


# -- the one validation of namespaces and snapshot names (issue 46 item 9): the public API and the
# export-file decoder (snapstore.transfer.format) both ask these, so a file can never bring in a
# namespace or name that no call could reach
MAX_NAMESPACE = 256
MAX_NAME = 256


def _utf8(text: str) -> bool:
    """Whether ``text`` can be stored as UTF-8 (a lone surrogate, such as a byte of another encoding
    decoded with ``surrogateescape``, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def namespace_problem(namespace: object) -> str | None:
    """Why ``namespace`` (not None) is no namespace, or None when it is one: a non-empty str of at
    most 256 characters, valid UTF-8."""
    if not isinstance(namespace, str) or not namespace or len(namespace) > MAX_NAMESPACE or not _utf8(namespace):
        return (f"namespace must be None or a non-empty string (<= {MAX_NAMESPACE} chars, valid UTF-8), got "
                f"{namespace!r:.80}")
    return None


def name_problem(name: object) -> str | None:
    """Why ``name`` is no snapshot name, or None when it is one: a non-empty str of at most 256
    characters without control characters, valid UTF-8."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or any(ord(ch) < 32 for ch in name) \
            or not _utf8(name):
        return (f"a snapshot name must be a non-empty str of at most {MAX_NAME} characters without control "
                f"characters, valid UTF-8, got {name!r:.80}")
    return None


def namespace_key(namespace: str | None) -> str:
    """The catalog's form of a namespace: "" for None, else the validated name."""
    if namespace is None:
        return ""
    why = namespace_problem(namespace)
    if why is not None:
        raise InvalidInputError(why)
    return namespace


def check_name(name: object) -> str:
    """A validated snapshot name (:func:`name_problem`); InvalidInputError otherwise."""
    why = name_problem(name)
    if why is not None:
        raise InvalidInputError(why)
    assert isinstance(name, str)
    return name


def session_key(session: str | None) -> str | None:
    """A validated session key (None: no session)."""
    if session is not None and (not isinstance(session, str) or not session or not _utf8(session)):
        raise InvalidInputError(f"session must be None or a non-empty string (valid UTF-8), got {session!r:.80}")
    return session


def ref_namespace(ref: Any, namespace: str | None) -> str:
    """The namespace a snapshot reference speaks for: a result's own (:func:`resolve_ref`), else the keyword."""
    ns = (ref if isinstance(ref, Ref) else resolve_ref(ref)).namespace
    if namespace is not None and ns is not None and namespace != ns:
        raise IdentityError(f"namespace {namespace!r} given for a result of namespace {ns!r}")
    return namespace_key(namespace if namespace is not None else ns)


def excluded(exclude: Iterable[SnapshotRef] | None) -> set[int]:
    """The snapshot ids match() passes over; None (like an empty collection) excludes nothing."""
    if exclude is None:
        return set()
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
        raise InvalidInputError(f"exclude must be a collection of snapshot ids, got {exclude!r:.80}")
    try:
        return {snapshot_id(x) for x in exclude}
    except TypeError:  # iterable in name only (a 0-d array)
        raise InvalidInputError(f"exclude must be a collection of snapshot ids, got {exclude!r:.80}") from None
