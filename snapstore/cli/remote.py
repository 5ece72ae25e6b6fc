"""The CLI's ``--remote`` flags: verify/gc act on the shared tier; stats/inspect show both tiers.

``cli.parser`` adds the flags with :func:`add_remote_flags`; ``cli.commands.cmd_remote`` hands a
command that has ``--remote`` to :func:`run_remote`. The URL is the flag's value, else ``$SNAPSTORE_REMOTE``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from snapstore._config import MIB, env_int
from snapstore._errors import ConfigError
from snapstore.cli import render as render
from snapstore.console.context import EXIT_DAMAGE, EXIT_OK, FORMAT, CliContext
from snapstore.remote.maint import gc_remote, inspect_remote, stats_remote, verify_remote
from snapstore.remote.s3client import S3Client

__all__ = ["add_remote_flags", "run_remote"]


def add_remote_flags(p: argparse.ArgumentParser, command: str) -> None:
    """Add ``--remote [URL]`` (and gc's budget and lease flags) to one subcommand's parser."""
    what = {"verify": "check the shared tier (s3://BUCKET/PREFIX) instead of the local store",
            "gc": "collect the shared tier instead of the local store",
            "stats": "also show the shared tier's totals",
            "inspect": "also show the shared tier's scopes and chains"}[command]
    p.add_argument("--remote", nargs="?", const="", default=None, metavar="URL",
                   help=f"{what} (URL default: $SNAPSTORE_REMOTE)")
    if command == "gc":
        p.add_argument("--remote-budget-mib", type=int, default=None, metavar="N",
                       help="with --remote: evict LRU leaf manifests until referenced chunks <= N MiB "
                            "(default $SNAPSTORE_REMOTE_BUDGET_MIB; unset: no budget)")
        p.add_argument("--lease-ttl", type=float, default=None, metavar="S",
                       help="with --remote: leases older than S seconds protect nothing (default 3600)")


def _client(args: argparse.Namespace) -> S3Client:
    url = args.remote or os.environ.get("SNAPSTORE_REMOTE") or ""
    if not url:
        raise ConfigError("--remote needs a URL (s3://BUCKET/PREFIX) or $SNAPSTORE_REMOTE")
    return S3Client(url)


def run_remote(command: str, args: argparse.Namespace, ctx: CliContext,
               local: Callable[[], dict[str, Any] | None]) -> int:
    """Run ``command`` with ``--remote``. ``local`` prints (text) or returns (JSON) the local part, if any."""

    client = _client(args)
    if command == "verify":
        rep = verify_remote(client, deep=args.deep, repair=args.repair)
        doc = {"format": FORMAT, "command": "verify", "remote": rep.url,
               "status": render.verify_status(rep.ok, bool(rep.repaired)), **rep.to_dict()}
        if ctx.json:
            ctx.emit_json(doc)
        else:
            render.remote_verify(doc, ctx)
        return EXIT_OK if rep.ok else EXIT_DAMAGE
    if command == "gc":
        mib = args.remote_budget_mib if args.remote_budget_mib is not None else env_int("SNAPSTORE_REMOTE_BUDGET_MIB")
        kw: dict[str, Any] = {}
        if args.lease_ttl is not None:
            kw["lease_ttl"] = args.lease_ttl
        g = gc_remote(client, grace=args.grace, budget_bytes=mib * MIB if mib is not None else None,
                      dry_run=args.dry_run, **kw)
        doc = {"format": FORMAT, "command": "gc", "remote": g.url, **g.to_dict()}
        if ctx.json:
            ctx.emit_json(doc)
        else:
            render.remote_gc(doc, ctx)
        return EXIT_OK
    remote = stats_remote(client) if command == "stats" else inspect_remote(client)
    if ctx.json:
        ctx.emit_json({"format": FORMAT, "command": command, **(local() or {}), "remote": remote})
        return EXIT_OK
    local()
    if command == "stats":
        render.remote_stats(remote, ctx)
    else:
        render.remote_inspect(remote, ctx)
    return EXIT_OK
