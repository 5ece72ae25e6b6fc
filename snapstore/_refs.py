"""References the public API takes: snapshot ids (or results naming one), namespaces, names, exclusions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import numpy as np

from snapstore._errors import IdentityError, InvalidInputError
from snapstore._results import Match, SaveResult

__all__ = ["MAX_ID", "MAX_NAME", "MAX_NAMESPACE", "SnapshotRef", "check_name", "excluded", "name_problem",
           "namespace_key", "namespace_problem", "ref_namespace", "session_key", "snapshot_id"]

MAX_ID = 2**63 - 1  # SQLite's INTEGER range: no snapshot id lies beyond it

# what names a snapshot in the API: its id, or the Match / SaveResult that reported it
SnapshotRef = Union[int, np.integer[Any], Match, SaveResult]


def snapshot_id(ref: Any) -> int:
    """The snapshot id a reference names; InvalidInputError for anything else."""
    sid = getattr(ref, "snapshot_id", ref)
    if isinstance(sid, (int, np.integer)) and not isinstance(sid, bool):
        if not 0 <= int(sid) <= MAX_ID:
            raise InvalidInputError(f"snapshot id {int(sid)} is out of range: snapshot ids are integers in "
                                    "[1, 2**63) as save() and match() report them")
        return int(sid)
    if isinstance(ref, SaveResult) and ref.skipped is not None:
        raise InvalidInputError(f"that save was skipped ({ref.skipped}): no snapshot was stored, so there is nothing "
                                "to commit, abandon or restore; skipped saves are counted in stats().skipped")
    raise InvalidInputError(f"expected a snapshot id, Match or SaveResult, got {ref!r}")


# -- the one validation of namespaces and snapshot names (issue 46 item 9): the public API and the
# export-file decoder (snapstore.transfer.format) both ask these, so a file can never bring in a
# namespace or name that no call could reach
MAX_NAMESPACE = 256
MAX_NAME = 256


def namespace_problem(namespace: object) -> str | None:
    """Why ``namespace`` (not None) is no namespace, or None when it is one: a non-empty str of at
    most 256 characters."""
    if not isinstance(namespace, str) or not namespace or len(namespace) > MAX_NAMESPACE:
        return f"namespace must be None or a non-empty string (<= {MAX_NAMESPACE} chars), got {namespace!r:.80}"
    return None


def name_problem(name: object) -> str | None:
    """Why ``name`` is no snapshot name, or None when it is one: a non-empty str of at most 256
    characters without control characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or any(ord(ch) < 32 for ch in name):
        return (f"a snapshot name must be a non-empty str of at most {MAX_NAME} characters without control "
                f"characters, got {name!r:.80}")
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
    if session is not None and (not isinstance(session, str) or not session):
        raise InvalidInputError(f"session must be None or a non-empty string, got {session!r}")
    return session


def ref_namespace(ref: Any, namespace: str | None) -> str:
    """The namespace a snapshot reference speaks for: a Match/SaveResult's own, else the keyword."""
    ns = getattr(ref, "namespace", None) if isinstance(ref, (Match, SaveResult)) else None
    if namespace is not None and ns is not None and namespace != ns:
        raise IdentityError(f"namespace {namespace!r} given for a result of namespace {ns!r}")
    return namespace_key(namespace if namespace is not None else ns)


def excluded(exclude: Iterable[SnapshotRef] | None) -> set[int]:
    """The snapshot ids match() passes over; None (like an empty collection) excludes nothing."""
    if exclude is None:
        return set()
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
        raise InvalidInputError(f"exclude must be a collection of snapshot ids, got {exclude!r}")
    return {snapshot_id(x) for x in exclude}
