"""``snapstore export`` and ``snapstore import``: one snapshot chain as a portable file, and back.

``export (--name NAME | --id ID) FILE`` reads the store (read-only: nothing in it is written) and
writes FILE (docs/format.md "Export files") — never inside a store directory, never over an
existing file unless ``--force`` (:mod:`snapstore.transfer.destination`). ``import FILE [--name NAME]``
opens the store for the file's own identity (or, with ``--identity KEY``, for an identity the store
already holds) and the file's layout, and calls :meth:`snapstore.Store.import_file`; a directory that
holds no store yet (absent or empty) becomes one, created from the file's identity and layout (the
copy-a-file-to-a-new-host flow). ``--accept-identity KEY`` is the override that takes a file of another
identity (docs/api.md "Export and import"). Both draw a progress meter on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from snapstore._config import default_dir
from snapstore._errors import NotFoundError
from snapstore._identity import Identity
from snapstore.catalog.queries import SnapRow, Txn
from snapstore.check.inspect import resolve_identity
from snapstore.chunks.repo import DB_NAME, Repo
from snapstore.cli.commands import _store_dir
from snapstore.console.context import EXIT_OK, FORMAT, CliContext, UsageError, snapshot_id_arg
from snapstore.lifecycle.naming import check_name
from snapstore.store.store import Store
from snapstore.transfer.export import write_export
from snapstore.transfer.importer import read_header
from snapstore.transfer.policy import identity_decision

__all__ = ["add_commands", "cmd_export", "cmd_import"]

_EXPORT_HELP = """\
Write one committed snapshot and its chain (root to leaf) as one portable file: identity, layout,
tokens, every chunk, and checksums of everything (docs/format.md "Export files"). The store is only
read. With --name the file records the name, and an import names the snapshot so by default.

FILE is written to a temporary file beside it and renamed into place; it is never written inside a
store directory, and an existing FILE is replaced only with --force.

exit: 0 written; 1 no such name or id; 2 usage or I/O error, a damaged chunk, FILE exists.

examples:
  snapstore --dir /srv/cache-a export --name agent-7/plan plan.snapx
  snapstore export --id 42 /tmp/chain.snapx --json
  snapstore export --name brief --identity id-3f9c0d --namespace tenant-a brief.snapx --force"""

_IMPORT_HELP = """\
Load an export file into this store, deduplicating against the chunks already here; every byte is
checked before anything is committed (a truncated or altered file is refused, exit 2, nothing
imported). The snapshot goes under the file's own identity, or with --identity KEY under an identity
this store holds: a file of another identity is then refused unless --accept-identity names the
file's identity key (such a snapshot is restored only by id or name, never matched).

A --dir that holds no store yet (it does not exist, or is empty) becomes one, for the file's
identity and layout: copy a file to a new host and import it there.

examples:
  snapstore --dir /srv/cache-b import plan.snapx                  # creates the store if there is none
  snapstore import plan.snapx --name agent-7/plan-v2 --json
  snapstore import q8.snapx --identity id-77aa01 --accept-identity id-3f9c0d   # another quant: an override"""


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``export`` and ``import`` to the snapstore parser, each with its handler as ``run``."""
    fmt = argparse.RawDescriptionHelpFormatter
    pe = sub.add_parser("export", parents=[common], formatter_class=fmt, description=_EXPORT_HELP,
                        help="write a snapshot's chain as one portable, checksummed file")
    which = pe.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", metavar="NAME", help="the snapshot this name pins (Store.name)")
    which.add_argument("--id", type=snapshot_id_arg, metavar="ID", help="a snapshot id (as inspect lists them)")
    pe.add_argument("--identity", metavar="KEY", help="with --name: the identity whose name it is (a key or a "
                    "prefix of 6+ characters), when several identities use the name")
    pe.add_argument("--namespace", metavar="NS", help="with --name: the namespace whose name it is")
    pe.add_argument("file", metavar="FILE")
    pe.add_argument("--force", action="store_true", help="replace FILE if it exists (never inside a store)")
    pe.set_defaults(run=cmd_export)
    pi = sub.add_parser("import", parents=[common], formatter_class=fmt, description=_IMPORT_HELP,
                        help="load an export file into this store (checked, deduplicated)")
    pi.add_argument("file", metavar="FILE")
    pi.add_argument("--name", metavar="NAME", help="name the imported snapshot (default: the name it was exported by)")
    pi.add_argument("--identity", metavar="KEY", help="import under this identity of the store (default: the file's)")
    pi.add_argument("--accept-identity", metavar="KEY", help="accept a file of this other identity key (an override: "
                    "the snapshot is marked, restored by id or name only)")
    pi.set_defaults(run=cmd_import)


def _plain_chain(t: Txn, snap: SnapRow) -> list[SnapRow]:
    return t.chain(snap.id)


def _named(repo: Repo, name: str, identity: str | None, namespace: str | None) -> int:
    """The snapshot ``name`` pins; UsageError when it is ambiguous, NotFoundError when none."""
    now = time.time()

    def find(t: Txn) -> list[tuple[str, str, int]]:
        keys = {i: k for i, k, *_ in t.identities()}
        want = resolve_identity(t, identity) if identity is not None else None
        return [(keys.get(iid, "?"), ns, sid) for iid, ns, nm, sid, _c, exp in t.all_names()
                if nm == name and (exp is None or exp > now) and (want is None or keys.get(iid) == want)
                and (namespace is None or ns == namespace)]

    hits = repo.db.read(find)
    if not hits:
        raise NotFoundError(f"no snapshot is named {name!r}" + (" there" if identity or namespace else ""))
    if len(hits) > 1:
        listed = "; ".join(f"identity {k} namespace {ns or '(default)'}: #{sid}" for k, ns, sid in hits)
        raise UsageError(f"the name {name!r} is used by several identities or namespaces ({listed}); "
                         "pass --identity and/or --namespace")
    return hits[0][2]


def cmd_export(args: argparse.Namespace, ctx: CliContext) -> int:
    """``export (--name NAME | --id ID) FILE [--force]``."""
    root = _store_dir(args)
    name = check_name(args.name) if args.name is not None else None
    repo = Repo.open(root, readonly=True, create=False)
    try:
        sid = _named(repo, name, args.identity, args.namespace) if name is not None else int(args.id)
        if repo.db.read(lambda t: t.snapshot(sid)) is None:  # docs/cli.md: no such id is exit 1
            raise NotFoundError(f"no snapshot {sid} in {root} (evicted, superseded, abandoned or never saved)")
        res = write_export(repo, sid, args.file, chain_of=_plain_chain, name=name, overwrite=args.force,
                           progress=ctx.meter("export"))
    finally:
        repo.close()
    ctx.close_meters()
    doc = {"format": FORMAT, "command": "export", **res.to_dict()}
    if ctx.json:
        ctx.emit_json(doc)
    else:
        ctx.line(f"exported #{res.snapshot_id} ({res.n_tokens} tokens, {res.links} links, {res.chunks} chunks) "
                 f"to {res.path}: {res.file_bytes} bytes")
    return EXIT_OK


def _import_root(args: argparse.Namespace) -> tuple[str, bool]:
    """The store directory to import into, and whether the import creates it: a directory that
    holds no store (absent, or empty) becomes one; one that holds other files is refused."""
    root = getattr(args, "dir", None) or default_dir()
    if os.path.isfile(os.path.join(root, DB_NAME)):
        return _store_dir(args), False
    if not _holds_no_store(root):
        if os.path.isdir(root) and not os.path.islink(root):
            raise UsageError(f"{root} holds files but no snapstore store (no {DB_NAME}); import into an empty or "
                             "new directory to create a store there")
        return _store_dir(args), False  # a file, a link: it says what is there instead
    if args.identity is not None:
        raise UsageError(f"{root} holds no snapstore store, so it has no identity {args.identity}; import without "
                         "--identity to create the store for the file's own identity")
    return root, True


def _holds_no_store(root: str) -> bool:
    """Whether ``root`` is absent, or an empty directory: a place an import may create a store."""
    if not os.path.lexists(root):
        return True
    if os.path.islink(root) or not os.path.isdir(root):
        return False
    with os.scandir(root) as it:
        return next(it, None) is None


def cmd_import(args: argparse.Namespace, ctx: CliContext) -> int:
    """``import FILE [--name NAME] [--identity KEY] [--accept-identity KEY]``."""
    root, create = _import_root(args)
    if not os.path.isfile(args.file):
        raise UsageError(f"no export file at {args.file}")
    header = read_header(args.file)  # checked: a damaged header is refused before the store is opened
    identity = header.identity
    if create:  # a refused import creates nothing: what the import would refuse at once, asked first
        if args.name is not None:
            check_name(args.name)
        identity_decision(identity, identity, args.accept_identity, args.file, header.imported_from)
    if args.identity is not None:
        repo = Repo.open(root, readonly=True, create=False)
        try:
            identity = repo.db.read(lambda t: _identity_of(t, args.identity))
        finally:
            repo.close()
    # drop_stale=False: opening for the file's identity must not drop another build's snapshots here
    with Store.open(root, identity=identity, layout=header.layout, drop_stale=False) as store:
        res = store.import_file(args.file, args.name, accept_identity=args.accept_identity,
                                progress=ctx.meter("import"))
    ctx.close_meters()
    doc = {"format": FORMAT, "command": "import", **res.to_dict(), "created_store": create}
    if ctx.json:
        ctx.emit_json(doc)
    else:
        over = f" (imported under an identity override from {res.imported_from})" if res.imported_from else ""
        named = f" named {res.name!r}" if res.name else ""
        made = f" into a new store at {os.path.abspath(root)}" if create else ""
        ctx.line(f"imported #{res.snapshot_id}{named} ({res.n_tokens} tokens){made}: {res.links_added} of "
                 f"{res.links} links added, {res.chunks_written} of {res.chunks} chunks written "
                 f"({res.bytes_written} bytes){over}")
    return EXIT_OK


def _identity_of(t: Txn, key: str) -> Identity:
    full = resolve_identity(t, key)
    for _i, k, canonical, *_ in t.identities():
        if k == full:
            return Identity.from_dict(json.loads(canonical))
    raise UsageError(f"no identity {key} in this store")  # resolve_identity raised already; kept for mypy
