"""The CLI's ``--remote`` flags: verify/gc act on the shared tier; stats/inspect show both tiers.

``_cli_parser`` adds the flags with :func:`add_remote_flags`; ``_cli_commands.cmd_remote`` hands a
command that has ``--remote`` to :func:`run_remote`. The URL is the flag's value, else ``$SNAPSTORE_REMOTE``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from ._cli_context import EXIT_DAMAGE, EXIT_OK, FORMAT, CliContext
from ._config import MIB, env_int
from ._errors import ConfigError
from ._s3client import S3Client

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
    from ._cli_commands import verify_status
    from ._remote_maint import gc_remote, inspect_remote, stats_remote, verify_remote

    line, emit_json = ctx.line, ctx.emit_json

    client = _client(args)
    if command == "verify":
        rep = verify_remote(client, deep=args.deep, repair=args.repair)
        doc = {"format": FORMAT, "command": "verify", "remote": rep.url,
               "status": verify_status(rep.ok, bool(rep.repaired)), **rep.to_dict()}
        if ctx.json:
            emit_json(doc)
        else:
            line(f"verify --remote {rep.url}{' (deep)' if rep.deep else ''}: {doc['status']}")
            line(f"  {rep.manifests} manifests, {rep.chunks} chunk objects ({_mib(rep.chunk_bytes)}), "
                 f"{rep.orphan_chunks} unreferenced (gc --remote collects them), {rep.live_leases} live uploads")
            for d in rep.damaged_manifests:
                line(f"  damaged manifest {d['manifest']}: {d['reason']}")
            for c in rep.corrupt_chunks:
                line(f"  corrupt chunk {c['chunk']}: {c['reason']}")
            for r in rep.repaired:
                line(f"  removed {r}")
        return EXIT_OK if rep.ok else EXIT_DAMAGE
    if command == "gc":
        mib = args.remote_budget_mib if args.remote_budget_mib is not None else env_int("SNAPSTORE_REMOTE_BUDGET_MIB")
        kw: dict[str, Any] = {}
        if args.lease_ttl is not None:
            kw["lease_ttl"] = args.lease_ttl
        g = gc_remote(client, grace=args.grace, budget_bytes=mib * MIB if mib is not None else None,
                      dry_run=args.dry_run, **kw)
        if ctx.json:
            emit_json({"format": FORMAT, "command": "gc", "remote": g.url, **g.to_dict()})
        else:
            verb = "would remove" if g.dry_run else "removed"
            line(f"gc --remote {g.url}" + (" (dry run: nothing was changed)" if g.dry_run else ""))
            if g.evicted_manifests:
                line(f"  evicted manifests (LRU leaves, to the budget): {len(g.evicted_manifests)}")
            if g.broken_manifests:
                line(f"  manifests of broken chains: {len(g.broken_manifests)}")
            line(f"{verb} {len(g.evicted_manifests) + len(g.broken_manifests)} manifests, {g.chunks_removed} "
                 f"chunk objects, {g.leases_removed} stale leases, {_mib(g.bytes_freed)}; "
                 f"{_mib(g.bytes_before)} -> {_mib(g.bytes_after)}"
                 + (f"; {g.kept_for_leases} kept for live uploads" if g.kept_for_leases else ""))
        return EXIT_OK
    remote = stats_remote(client) if command == "stats" else inspect_remote(client)
    if ctx.json:
        emit_json({"format": FORMAT, "command": command, **(local() or {}), "remote": remote})
        return EXIT_OK
    local()
    if command == "stats":
        line(f"shared tier {remote['url']}")
        line(f"  {'manifests':<14} {remote['manifests']} in {remote['scopes']} scopes")
        line(f"  {'chunks':<14} {remote['chunks']} objects, {_mib(remote['chunk_bytes'])}")
        line(f"  {'uploads':<14} {remote['leases']} in flight (leases)")
        return EXIT_OK
    now = time.time()
    line(f"shared tier {remote['url']}: {remote['chunks']} chunk objects, {_mib(remote['chunk_bytes'])}")
    for sc in remote["scopes"]:
        line(f"  scope {sc['scope'][:12]} identity {sc['identity']}"
             + (f" namespace {sc['namespace']!r}" if sc["namespace"] else ""))
        for e in sc["manifests"]:
            if "damaged" in e:
                line(f"    {e['manifest']}  DAMAGED: {e['damaged']}")
                continue
            parent = f" <- {e['parent'].split('/')[1][:12]}" if e["parent"] else ""
            line(f"    {e['n_tokens']:>8} tokens  {_mib(e['stored_bytes']):>10}  used {int(now - e['last_used'])}s ago"
                 f"  {e['manifest'].split('/')[1][:12]}{parent}" + ("" if e["matchable"] else "  (chain link)"))
    return EXIT_OK


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"
