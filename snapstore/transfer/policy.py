"""The one policy for state that crosses identities (issue 32 part 3; the llama.cpp quant move).

A snapshot is served only to the identity that computed it (invariant 10). Two operator acts
move state across anyway, and both follow the same rule:

- ``snapstore llama-cpp export-slot --for-model OTHER.gguf`` (:mod:`snapstore.engine.llamacpp._formodel`)
  writes a slot file for another model after checking that its cache layout agrees exactly; it
  writes nothing into the store;
- ``Store.import_file(path, accept_identity=KEY)`` / ``snapstore import --accept-identity KEY``
  takes an export file of identity KEY into a store of another identity.

The rule: the move is refused unless the caller names, explicitly, the identity whose state it
accepts (a flag that merely says "force" could accept a file it never looked at); agreement makes
the state restorable, not exact (it was computed with other weights, build or settings); so the
moved state is marked with the identity it came from (``snapshots.imported_from``), shown by
``inspect``, restored only when asked for by id or name, and never counts as an exact match of its
own: match() and ``parent="auto"`` pass over it, and a snapshot saved over it (``parent=`` naming it)
inherits the mark.

A slot file (``snapstore export-slot``) cannot carry the mark: a marked snapshot is written as one
only when ``--accept-identity`` names the identity that computed it, and reported as no exact
prefix (:func:`marked_output`).

The mark travels with the state (issue 46): a save is never deduplicated onto a marked snapshot
(a native save is stored as native), and an export of a marked chain carries the mark (the
header's ``imported_from``), so importing that file anywhere — the exporting identity's store
included — requires ``accept_identity`` naming the identity that computed the state (the mark),
and the import is marked again. No path turns foreign state into an exact hit.
"""

from __future__ import annotations

from snapstore._errors import IdentityError
from snapstore._identity import Identity

__all__ = ["accepted_key", "describe", "identity_decision", "marked_output"]


def describe(identity: Identity) -> str:
    """A short human form of an identity for messages: its key, build, pack and kv mode."""
    return f"{identity.key} (build {identity.build!r}, pack {identity.pack!r}, kv {identity.kv!r})"


def accepted_key(accept: object, example: str) -> str | None:
    """The identity key ``accept`` names (``accept_identity`` / ``--accept-identity``): None, or a str,
    its hex alone naming it too; IdentityError for anything else (``example``: a key to show)."""
    if accept is not None and not isinstance(accept, str):
        raise IdentityError(f"accept_identity must be an identity key (a str like {example!r}), got {accept!r}")
    if accept is not None and not accept.startswith("id-"):
        accept = "id-" + accept
    return accept


def marked_output(mark: str | None, accept: str | None, where: str, fmt: str) -> bool:
    """Whether writing snapshot state out as ``fmt`` (a format that cannot carry the override mark:
    a llama-server slot file) is exact: True for the store's own state; for state marked imported
    under an override from ``mark`` it is written only when ``accept`` names ``mark`` (then False: an
    approximation, never exact), else IdentityError — a file without the mark, imported again
    (import-slot), would be native state of this identity: the mark laundered (issue 46 item 1)."""
    if mark is None:
        return True
    if accepted_key(accept, mark) != mark:
        raise IdentityError(
            f"{where} holds state that identity {mark} computed (imported here under an identity override); a "
            f"{fmt} cannot carry that mark, so imported again it would pass as this identity's own state; "
            f"nothing written. Pass --accept-identity {mark} to write it anyway, as an approximation")
    return False


def identity_decision(source: Identity, target: Identity, accept: str | None, where: str,
                      mark: str | None = None) -> str | None:
    """None when ``source`` is ``target`` and the file is unmarked (an exact import); the key of the
    identity that computed the state when the caller accepts it by name (``accept`` equals it): the
    file's ``mark`` if it has one, else the source's; IdentityError otherwise, naming both and the override."""
    accept = accepted_key(accept, source.key)
    if mark is not None:  # already foreign state where it was exported from: never exact anywhere
        if accept is None:
            raise IdentityError(
                f"{where} holds state that identity {mark} computed (its exporting store {describe(source)} had "
                f"imported it under an identity override); this store is {describe(target)}; nothing imported. "
                f"Import it under the override again with accept_identity={mark!r} (CLI: --accept-identity "
                f"{mark}); it is then restored only by id or name, never matched")
        if accept != mark:
            raise IdentityError(f"accept_identity={accept!r} does not name the identity {mark} that computed "
                                f"{where}'s state (the file is marked imported under an override); nothing imported")
        return mark
    if source.key == target.key:
        if accept is not None and accept != source.key:
            raise IdentityError(f"accept_identity={accept!r} does not name {where}'s identity {source.key}; "
                                "nothing imported")
        return None
    if accept is None:
        raise IdentityError(
            f"{where} holds state of identity {describe(source)}, this store is {describe(target)}; nothing "
            f"imported. If that state is known to restore here (the same cache layout: e.g. another quant of the "
            f"same model), import it under an override with accept_identity={source.key!r} (CLI: "
            f"--accept-identity {source.key}); it is then restored only by id or name, never matched")
    if accept != source.key:
        raise IdentityError(f"accept_identity={accept!r} does not name {where}'s identity {source.key}; "
                            "nothing imported")
    return source.key
