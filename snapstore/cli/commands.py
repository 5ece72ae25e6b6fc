"""The ``snapstore`` commands: open the store, call the library, hand its report to the renderer.

Each ``cmd_*`` takes the parsed arguments and the run's :class:`CliContext` and returns the exit
code. The JSON a command prints is its library report's ``to_dict()`` in the ``format``/``command``
envelope (docs/cli.md); the text is :mod:`snapstore.cli.render`'s drawing of that same object.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from snapstore._config import MIB, Budget, default_dir, env_int
from snapstore._errors import CorruptionError
from snapstore.check.inspect import inspect_snapshot, inspect_store, resolve_identity, stats_of
from snapstore.check.report import SnapshotReport, StoreReport
from snapstore.check.verify import VerifyReport, verify
from snapstore.chunks.repo import DB_NAME, Repo, SnapshotRepo
from snapstore.cli import render as render
from snapstore.cli.remote import run_remote
from snapstore.console.context import EXIT_DAMAGE, EXIT_OK, FORMAT, CliContext, UsageError
from snapstore.lifecycle.gc import gc

__all__ = ["cmd_gc", "cmd_inspect", "cmd_remote", "cmd_stats", "cmd_verify", "inspect_doc"]


# -- opening ---------------------------------------------------------------------------------
def _store_dir(args: argparse.Namespace) -> str:
    root = getattr(args, "dir", None) or default_dir()
    if os.path.lexists(root) and not os.path.isdir(root):
        what = "a file" if os.path.isfile(root) else "not a directory"
        raise UsageError(f"{root} is {what}, not a store directory: pass --dir with the directory that holds "
                         f"{DB_NAME} (or set $SNAPSTORE_DIR)")
    if not os.path.isdir(root):
        raise UsageError(f"no snapstore store at {root} (no such directory); pass --dir or set $SNAPSTORE_DIR")
    if not os.path.isfile(os.path.join(root, DB_NAME)):
        raise UsageError(f"{root} is not a snapstore store (no {DB_NAME})")
    return root


@contextmanager
def _open(root: str, *, readonly: bool, snapshot: bool = False) -> Iterator[Repo]:
    """Open the store: read-write, read-only (live reads), or a snapshot (a private in-memory copy of
    the catalog, taken without writing any byte of the store directory: inspect, stats, gc --dry-run).

    A read-only session writes nothing at all (no -wal, -shm or lock file), so it also reads a
    store on read-only media or one this user may not write.
    """
    if snapshot:
        snap = SnapshotRepo.open(root)
        try:
            yield snap
        finally:
            snap.close()
        return
    repo = Repo.open(root, readonly=readonly, create=False)
    try:
        yield repo
    finally:
        repo.close()


# -- inspect ---------------------------------------------------------------------------------
def inspect_doc(report: StoreReport | SnapshotReport) -> dict[str, Any]:
    """The JSON of ``snapstore inspect [ID]``: the report's ``to_dict()`` in the envelope."""
    return {"format": FORMAT, "command": "inspect", **report.to_dict()}


def _inspect_report(root: str, sid: int | None) -> StoreReport | SnapshotReport:
    with _open(root, readonly=True, snapshot=True) as repo:
        if sid is not None:
            return repo.db.read(lambda c: inspect_snapshot(c, root, sid))
        return repo.db.read(lambda c: inspect_store(c, root))


def cmd_inspect(args: argparse.Namespace, ctx: CliContext) -> int:
    """``inspect [ID]``: the store's trees and totals, or one snapshot in detail."""
    report = _inspect_report(_store_dir(args), args.id)
    doc = inspect_doc(report)
    if ctx.json:
        ctx.emit_json(doc)
    elif isinstance(report, SnapshotReport):
        render.inspect_one(doc, ctx)
    else:
        render.inspect_all(doc, ctx)
    return EXIT_OK


# -- verify ----------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace, ctx: CliContext) -> int:
    """``verify [--deep] [--repair]``: exit 0 clean, 1 damage found or repaired."""
    root = _store_dir(args)
    progress = ctx.meter("verify --deep" if args.deep else "verify")
    clean_after: bool | None = None
    try:
        with _open(root, readonly=not args.repair) as repo:
            report = verify(repo, deep=args.deep, repair=args.repair, progress=progress, grace=args.grace,
                            pending_lease=args.pending_lease)
            if report.repaired:
                clean_after = verify(repo, deep=False).ok
    except CorruptionError as e:  # the catalog itself cannot be read: damage, not a usage error
        report = VerifyReport(deep=args.deep, sqlite_errors=[str(e)])
    doc = {"format": FORMAT, "command": "verify", "dir": os.path.abspath(root),
           "status": render.verify_status(report.ok, bool(report.repaired)), **report.to_dict(),
           "clean_after_repair": clean_after}
    if ctx.json:
        ctx.emit_json(doc)
    else:
        render.verify(doc, ctx, args.repair)
    return EXIT_OK if report.ok else EXIT_DAMAGE


# -- gc --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GcLimits:
    """gc's limits after the flag-else-environment defaults (docs/cli.md), as its JSON ``limits``."""

    disk_bytes: int | None
    max_entries: int | None
    ttl: float | None
    grace: float

    @classmethod
    def of(cls, args: argparse.Namespace) -> GcLimits:
        """The flags, else ``$SNAPSTORE_DISK_MIB`` / ``$SNAPSTORE_MAX_ENTRIES`` / ``$SNAPSTORE_TTL``."""
        disk_mib = args.disk_mib if args.disk_mib is not None else env_int("SNAPSTORE_DISK_MIB")
        max_entries = args.max_entries if args.max_entries is not None else env_int("SNAPSTORE_MAX_ENTRIES")
        ttl = args.ttl if args.ttl is not None else env_int("SNAPSTORE_TTL")
        return cls(disk_bytes=disk_mib * MIB if disk_mib is not None else None, max_entries=max_entries,
                   ttl=float(ttl) if ttl else None, grace=args.grace)

    def to_dict(self, drop: str | None, keep: str | None) -> dict[str, Any]:
        """The JSON ``limits`` object, with the identity keys the run resolved."""
        return {"disk_bytes": self.disk_bytes, "max_entries": self.max_entries, "ttl": self.ttl,
                "grace": self.grace, "drop_identity": drop, "keep_identity": keep}


def cmd_gc(args: argparse.Namespace, ctx: CliContext) -> int:
    """``gc [--dry-run] [limits]``: collect the store (or say what a real run would)."""
    root = _store_dir(args)
    limits = GcLimits.of(args)
    progress = None if args.dry_run else ctx.meter("gc")
    with _open(root, readonly=args.dry_run, snapshot=args.dry_run) as repo:
        drop = repo.db.read(lambda c: resolve_identity(c, args.drop_identity)) if args.drop_identity else None
        keep = repo.db.read(lambda c: resolve_identity(c, args.keep_identity)) if args.keep_identity else None
        report = gc(repo, grace=args.grace, dry_run=args.dry_run, ttl=limits.ttl, drop_identity=drop,
                    keep_identity=keep, disk_bytes=limits.disk_bytes, max_entries=limits.max_entries,
                    progress=progress, pending_lease=args.pending_lease)
    doc = {"format": FORMAT, "command": "gc", "dir": os.path.abspath(root), **report.to_dict(),
           "limits": limits.to_dict(drop, keep)}
    if ctx.json:
        ctx.emit_json(doc)
    else:
        render.gc(doc, ctx, verbose=bool(getattr(args, "verbose", False)))
    return EXIT_OK


# -- stats -----------------------------------------------------------------------------------
def _stats(repo: Repo) -> dict[str, Any]:
    disk_budget = Budget().resolved().disk_bytes or 0
    return repo.db.read(lambda c: stats_of(c, disk_budget, 0)).to_dict()


def _remote_counters(repo: Repo) -> dict[str, int]:
    """This node's traffic with the shared tier (the ``remote_*`` counters)."""
    return repo.db.read(lambda c: {k: v for k, v in c.counters().items() if k.startswith("remote_")})


def cmd_stats(args: argparse.Namespace, ctx: CliContext) -> int:
    """``stats``: the library's counters (``Store.stats().to_dict()``)."""
    root = _store_dir(args)
    with _open(root, readonly=True, snapshot=True) as repo:
        d = _stats(repo)
    if ctx.json:
        ctx.emit_json({"format": FORMAT, "command": "stats", "dir": os.path.abspath(root), "stats": d})
    else:
        render.stats(os.path.abspath(root), d, ctx)
    return EXIT_OK


# -- --remote --------------------------------------------------------------------------------
def cmd_remote(command: str, args: argparse.Namespace, ctx: CliContext) -> int:
    """``--remote``: the shared tier's verify/gc; stats/inspect print the local store (if any) first."""

    def local() -> dict[str, Any] | None:
        if command not in ("stats", "inspect"):
            return None
        root = getattr(args, "dir", None) or default_dir()
        if not os.path.isfile(os.path.join(root, DB_NAME)):
            return None  # no local store here: the shared tier alone
        with _open(root, readonly=True, snapshot=True) as repo:  # this node's traffic with the shared tier
            mine = _remote_counters(repo)
        if not ctx.json:
            (cmd_stats if command == "stats" else cmd_inspect)(args, ctx)
            render.remote_counters(mine, ctx)
            return None
        if command == "stats":
            with _open(root, readonly=True, snapshot=True) as repo:
                return {"dir": os.path.abspath(root), "stats": _stats(repo), "counters": mine}
        return {"dir": os.path.abspath(root), "local": inspect_doc(_inspect_report(root, None)), "counters": mine}

    return run_remote(command, args, ctx, local)
