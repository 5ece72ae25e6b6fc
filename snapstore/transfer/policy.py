"""The one policy for state that crosses identities (issue 32 part 3; the llama.cpp quant move).

A snapshot is served only to the identity that computed it (invariant 10). Two operator acts
move state across anyway, and both follow the same rule:

- ``snapstore llama-cpp export-slot --for-model OTHER.gguf`` (:mod:`snapstore.llamacpp._formodel`)
  writes a slot file for another model after checking that its cache layout agrees exactly; it
  writes nothing into the store;
- ``Store.import_file(path, accept_identity=KEY)`` / ``snapstore import --accept-identity KEY``
  takes an export file of identity KEY into a store of another identity.

The rule: the move is refused unless the caller names, explicitly, the identity whose state it
accepts (a flag that merely says "force" could accept a file it never looked at); agreement makes
the state restorable, not exact (it was computed with other weights, build or settings); so the
moved state is marked with the identity it came from (``snapshots.imported_from``), shown by
``inspect``, restored only when asked for by id or name, and never counts as an exact match of its
own: match() and ``parent="auto"`` pass over it, and a snapshot saved over it inherits the mark.
"""

from __future__ import annotations

from snapstore._errors import IdentityError
from snapstore._identity import Identity

__all__ = ["describe", "identity_decision"]


def describe(identity: Identity) -> str:
    """A short human form of an identity for messages: its key, build, pack and kv mode."""
    return f"{identity.key} (build {identity.build!r}, pack {identity.pack!r}, kv {identity.kv!r})"


def identity_decision(source: Identity, target: Identity, accept: str | None, where: str) -> str | None:
    """None when ``source`` is ``target`` (an exact import); the source's key when the caller
    accepts it by name (``accept`` equals it); IdentityError otherwise, naming both and the override."""
    if accept is not None and not isinstance(accept, str):
        raise IdentityError(f"accept_identity must be an identity key (a str like {source.key!r}), got {accept!r}")
    if accept is not None and not accept.startswith("id-"):
        accept = "id-" + accept  # the key's hex alone names it too
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
