"""The ``snapstore`` command line: help texts, value types and the argument parser.

Parsing only: a bad command line raises :class:`ArgumentsError` (``main`` reports it as text or
JSON, exit 2); each subcommand's parser carries its handler as the ``run`` default.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from snapstore.cli.commands import cmd_gc, cmd_inspect, cmd_stats, cmd_verify
from snapstore.console.context import UsageError, snapshot_id_arg

__all__ = ["ArgumentsError", "build_parser", "parse_command_line"]


class ArgumentsError(UsageError):
    """The command line could not be parsed: ``prog: message``, with that parser's usage."""

    def __init__(self, prog: str, message: str, usage: str) -> None:
        super().__init__(f"{prog}: {message}")
        self.prog, self.message, self.usage = prog, message, usage


_MAIN_HELP = """\
Inspect, verify and garbage-collect a snapstore store (a directory holding snapstore.db,
blobs/ and tmp/); move snapshots between stores and engines. Safe to run while an engine is
using the store.

commands:
{commands}

examples:
  snapstore inspect                       snapstore inspect 42 --json
  snapstore verify --deep                 snapstore verify --repair
  snapstore gc --dry-run --disk-mib 20480
  snapstore stats --json
  snapstore export --name agent-7/plan plan.snapx
  snapstore --dir /srv/new-host import plan.snapx   # creates the store there if there is none

exit codes: 0 ok; 1 damage found (verify; also after --repair) or no such snapshot or name
(inspect ID, export); 2 usage or I/O error (bad flag, no store at --dir); 130 interrupted
(the store stays consistent).

The store directory is --dir, else $SNAPSTORE_DIR, else the per-user cache directory.
Run `snapstore COMMAND --help` for a command's options and examples. Reference: docs/cli.md.
"""


def _command_list(sub: Any) -> str:
    """Every command the parser has, one line each with its help: the main help's list, built from
    the parser itself so that no command is ever left out of it."""
    rows = [(a.dest, a.help or "") for a in sub._choices_actions]
    width = max(len(n) for n, _ in rows) + 2
    return "\n".join(f"  {n:<{width}}{h}" for n, h in rows)


_INSPECT_HELP = """\
Without ID: every identity (with its fields) and, per identity and namespace, the snapshots
drawn as trees (a child is a delta over its parent; branches share their common chain). Per
snapshot: tokens, rows per stream, components, logical vs stored bytes, has children (so it is
not evicted), pinned by a name (Store.name), pending/superseded, session, last use and hits; then
the names of each identity, the totals and the dedup ratio.
With ID: that snapshot's parts, their chunks, and its chain from the root.

Opens the store read-only and never changes it.

examples:
  snapstore inspect
  snapstore --dir /var/cache/engine/snapstore inspect 42
  snapstore inspect --json | jq '.totals'
"""

_VERIFY_HELP = """\
Quick (default): SQLite integrity and foreign keys, every referenced chunk file present with
its recorded size and a valid header, chains complete and contiguous, accounting consistent;
orphan chunk files, temp files and dead pending captures are listed (gc removes them; they
are not damage). --deep also re-reads every chunk and checks its checksum and content address.

The report names each damaged snapshot and every snapshot whose chain includes it.
--repair removes exactly those snapshots (nothing else), then orphan files older than --grace.

exit: 0 clean; 1 damage found, or repaired (the output says which); 2 usage/I-O error;
130 interrupted.

examples:
  snapstore verify
  snapstore verify --deep --json
  snapstore verify --deep --repair
"""

_LEASE_HELP = ("the lease of pending captures whose owner token has the old (schema v1) form, counted from "
               "the capture (default $SNAPSTORE_PENDING_LEASE_S, else 300); current owners carry their own")

_GC_HELP = """\
Removes, in one transaction: pending captures of dead owners (lock free, or lease expired; see
docs/format.md "Owners and liveness"), snapshots of a stale identity
(--drop-identity: that one; --keep-identity: the other identities of its model and extra keys, the same pack —
never another model's), snapshots unused for --ttl seconds,
and least-recently-used leaves until the store fits --disk-mib / --max-entries (the library's
own eviction: a snapshot with children is never evicted). Then chunk files nothing references
and temp files, when older than --grace seconds (safe beside an engine that is writing).
--dry-run prints exactly what would be removed and changes nothing. The text counts the files
and lists the first 20 (--verbose: all of them; --json: all of them, always).

Defaults: --disk-mib $SNAPSTORE_DISK_MIB, --max-entries $SNAPSTORE_MAX_ENTRIES,
--ttl $SNAPSTORE_TTL (unset: no such limit), --grace 3600.

examples:
  snapstore gc --dry-run
  snapstore gc --disk-mib 20480 --ttl 604800
  snapstore gc --keep-identity id-3f9c0d...   # drop this model's other builds' snapshots
  snapstore gc --dry-run --verbose            # every file a real run would remove
"""

_STATS_HELP = """\
The library's counters, persisted in the store: entries, hits, misses, tokens served from
cache, inserts, evictions, supersedes, expirations, skipped saves by reason, stored vs logical
bytes and the dedup ratio. disk_budget is $SNAPSTORE_DISK_MIB (or the library default).

examples:
  snapstore stats
  snapstore stats --json | jq '.stats.hits'
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ArgumentsError(self.prog, message, self.format_usage())


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    fmt = argparse.RawDescriptionHelpFormatter
    common = _Parser(add_help=False)
    common.add_argument("--dir", metavar="DIR", default=argparse.SUPPRESS,
                        help="store directory (default: $SNAPSTORE_DIR, else the per-user cache dir)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help='print one JSON object ("format": 1) on stdout instead of text')
    p = _Parser(prog="snapstore", description=_MAIN_HELP, formatter_class=fmt, parents=[common],
                usage="%(prog)s [-h] [--dir DIR] [--json] [--version] COMMAND [options]")
    p.add_argument("--version", action="version", version=f"snapstore {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, prog="snapstore",
                           help=argparse.SUPPRESS)  # listed in the description, with the rest
    sub.required = True

    pi = sub.add_parser("inspect", parents=[common], formatter_class=fmt, description=_INSPECT_HELP,
                        help="identities, snapshot trees, bytes, pins; one snapshot in detail")
    pi.add_argument("id", nargs="?", type=snapshot_id_arg, metavar="ID", help="a snapshot id: show it in detail")

    pv = sub.add_parser("verify", parents=[common], formatter_class=fmt, description=_VERIFY_HELP,
                        help="check integrity (exit 0 clean, 1 damage)")
    pv.add_argument("--deep", action="store_true", help="re-read every chunk: checksum and content address")
    pv.add_argument("--repair", action="store_true",
                    help="remove the damaged snapshots and every snapshot whose chain includes one")
    pv.add_argument("--grace", type=_nonneg_float, default=3600.0, metavar="S",
                    help="with --repair: remove orphan/temp files older than S seconds (default 3600)")
    pv.add_argument("--pending-lease", type=_nonneg_float, metavar="S", help=_LEASE_HELP)

    pg = sub.add_parser("gc", parents=[common], formatter_class=fmt, description=_GC_HELP,
                        help="reclaim space: orphans, dead captures, expired/stale, over budget")
    pg.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    pg.add_argument("--disk-mib", type=_nonneg_int, metavar="N",
                    help="evict LRU leaves until stored bytes <= N MiB (default $SNAPSTORE_DISK_MIB)")
    pg.add_argument("--max-entries", type=_nonneg_int, metavar="N",
                    help="evict LRU leaves until at most N matchable snapshots (default $SNAPSTORE_MAX_ENTRIES)")
    pg.add_argument("--ttl", type=_nonneg_float, metavar="S",
                    help="remove snapshots unused for S seconds; 0: none (default $SNAPSTORE_TTL)")
    who = pg.add_mutually_exclusive_group()
    who.add_argument("--drop-identity", metavar="KEY", help="remove every snapshot of this identity")
    who.add_argument("--keep-identity", metavar="KEY",
                     help="remove the snapshots of every other identity of the same model (pack)")
    pg.add_argument("--grace", type=_nonneg_float, default=3600.0, metavar="S",
                    help="only remove orphan chunk files and temp files older than S seconds (default 3600)")
    pg.add_argument("--pending-lease", type=_nonneg_float, metavar="S", help=_LEASE_HELP)
    pg.add_argument("-v", "--verbose", action="store_true",
                    help="list every chunk and temp file removed (the text lists the first 20; --json lists all)")

    ps = sub.add_parser("stats", parents=[common], formatter_class=fmt, description=_STATS_HELP,
                        help="the library's counters")
    from snapstore.cli.remote import add_remote_flags  # the shared tier's flags (docs/cli.md)
    for name, sp in (("inspect", pi), ("verify", pv), ("gc", pg), ("stats", ps)):
        add_remote_flags(sp, name)
    for sp, run in ((pi, cmd_inspect), (pv, cmd_verify), (pg, cmd_gc), (ps, cmd_stats)):
        sp.set_defaults(run=run)
    from snapstore.cli.export_import import add_commands as add_transfer  # export, import (issue 32)
    add_transfer(sub, common)
    from snapstore.engine.llamacpp.cli import add_commands  # import-slot, export-slot, llama-proxy (no heavy imports)
    add_commands(sub, common)
    from snapstore.engine.mlx.cli import add_commands as add_mlx  # mlx-server, import-/export-mlx-cache (no mlx import)
    add_mlx(sub, common)
    from snapstore.cli.bench import add_commands as add_bench  # bench: the storage's limits and the store's figures
    add_bench(sub, common)
    p.description = _MAIN_HELP.format(commands=_command_list(sub))
    return p


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``. A command that passes arguments on (``mlx-server``: mlx_lm.server's own) gets those it
    does not know as ``args.passthrough``; for every other command they are an error, as argparse makes them."""
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra and not hasattr(args, "passthrough"):
        p.error("unrecognized arguments: " + " ".join(extra))
    if hasattr(args, "passthrough"):
        args.passthrough = [*args.passthrough, *extra]
    return args


def _version() -> str:
    from snapstore import __version__
    return __version__


