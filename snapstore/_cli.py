"""The ``snapstore`` command: inspect, verify, gc and stats for operators and scripts.

Human-readable text on stdout by default; ``--json`` prints one summary object (``"format": 1``)
on stdout. Errors always go to stderr. Exit codes: 0 ok/clean, 1 damage found (or repaired) or
no such snapshot, 2 usage or I/O error, 130 interrupted. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TextIO

from ._config import MIB, Budget, default_dir, env_int
from ._db import release_wal
from ._errors import CorruptionError, NotFoundError, SnapstoreError
from ._gc import gc
from ._inspect import FORMAT, inspect_all, inspect_one
from ._progress import Meter, human_bytes
from ._repo import DB_NAME, Repo, SnapshotRepo
from ._verify import VerifyReport, verify

__all__ = ["main"]

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_DELAY_ENV = "_SNAPSTORE_PROGRESS_DELAY"  # tests only: sleep per progress step (to interrupt mid-work)


class UsageError(Exception):
    """A problem with the command line or the store path: exit 2."""


class NotFound(Exception):
    """``inspect ID`` of a snapshot that does not exist: exit 1."""


# -- argument parsing ------------------------------------------------------------------------
_MAIN_HELP = """\
Inspect, verify and garbage-collect a snapstore store (a directory holding snapstore.db,
blobs/ and tmp/). Safe to run while an engine is using the store.

commands:
  inspect [ID]   identities, snapshot trees, bytes, pins, hits; one snapshot in detail
                   snapstore inspect            snapstore inspect 42 --json
  verify         prove the store intact (exit 0 clean, 1 damage found or repaired)
                   snapstore verify --deep      snapstore verify --repair
  gc             remove orphan/temp files, dead captures, expired/stale snapshots; evict to a budget
                   snapstore gc --dry-run --disk-mib 20480
  stats          the library's counters (hits, misses, inserts, evictions, bytes)
                   snapstore stats --json

exit codes: 0 ok; 1 damage found (verify; also after --repair) or no such snapshot (inspect ID);
2 usage or I/O error (bad flag, no store at --dir); 130 interrupted (the store stays consistent).

The store directory is --dir, else $SNAPSTORE_DIR, else the per-user cache directory.
Run `snapstore COMMAND --help` for a command's options. Reference: docs/cli.md.
"""

_INSPECT_HELP = """\
Without ID: every identity (with its fields) and, per identity and namespace, the snapshots
drawn as trees (a child is a delta over its parent; branches share their common chain). Per
snapshot: tokens, rows per stream, components, logical vs stored bytes, pinned (has children),
pending/superseded, session, last use and hits; then totals and the dedup ratio.
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
(--drop-identity, or every identity but --keep-identity), snapshots unused for --ttl seconds,
and least-recently-used leaves until the store fits --disk-mib / --max-entries (the library's
own eviction: a snapshot with children is never evicted). Then chunk files nothing references
and temp files, when older than --grace seconds (safe beside an engine that is writing).
--dry-run prints exactly what would be removed and changes nothing.

Defaults: --disk-mib $SNAPSTORE_DISK_MIB, --max-entries $SNAPSTORE_MAX_ENTRIES,
--ttl $SNAPSTORE_TTL (unset: no such limit), --grace 3600.

examples:
  snapstore gc --dry-run
  snapstore gc --disk-mib 20480 --ttl 604800
  snapstore gc --keep-identity id-3f9c0d...   # drop every other engine build's snapshots
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
    json_errors = False

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            _emit_error(None, f"{self.prog}: {message}", EXIT_USAGE, True)
            raise SystemExit(EXIT_USAGE)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


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


def _snapshot_id(text: str) -> int:
    try:
        v = int(text.lstrip("#"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a snapshot id is a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"snapshot ids start at 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    fmt = argparse.RawDescriptionHelpFormatter
    common = _Parser(add_help=False)
    common.add_argument("--dir", metavar="DIR", default=argparse.SUPPRESS,
                        help="store directory (default: $SNAPSTORE_DIR, else the per-user cache dir)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help='print one JSON object ("format": 1) on stdout instead of text')
    p = _Parser(prog="snapstore", description=_MAIN_HELP, formatter_class=fmt, parents=[common])
    p.add_argument("--version", action="version", version=f"snapstore {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    pi = sub.add_parser("inspect", parents=[common], formatter_class=fmt, description=_INSPECT_HELP,
                        help="identities, snapshot trees, bytes, pins; one snapshot in detail")
    pi.add_argument("id", nargs="?", type=_snapshot_id, metavar="ID", help="a snapshot id: show it in detail")

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
    who.add_argument("--keep-identity", metavar="KEY", help="remove every snapshot of every other identity")
    pg.add_argument("--grace", type=_nonneg_float, default=3600.0, metavar="S",
                    help="only remove orphan chunk files and temp files older than S seconds (default 3600)")
    pg.add_argument("--pending-lease", type=_nonneg_float, metavar="S", help=_LEASE_HELP)

    ps = sub.add_parser("stats", parents=[common], formatter_class=fmt, description=_STATS_HELP,
                        help="the library's counters")
    from ._remote_cli import add_remote_flags  # the shared tier's flags (docs/cli.md)
    for name, sp in (("inspect", pi), ("verify", pv), ("gc", pg), ("stats", ps)):
        add_remote_flags(sp, name)
    from .llamacpp._cli import add_commands  # import-slot, export-slot, llama-proxy (no heavy imports)
    add_commands(sub, common, _COMMANDS)
    return p


def _version() -> str:
    from . import __version__
    return __version__


# -- output ----------------------------------------------------------------------------------
def _emit_json(obj: dict[str, Any], stream: TextIO | None = None) -> None:
    out = stream if stream is not None else sys.stdout
    out.write(json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")
    out.flush()


def _emit_error(command: str | None, message: str, code: int, as_json: bool) -> None:
    if as_json:
        _emit_json({"format": FORMAT, "command": command, "error": message, "exit": code}, sys.stderr)
    else:
        sys.stderr.write(f"snapstore: error: {message}\n")
        sys.stderr.flush()


class _Out:
    """Collects human-readable lines and writes them to stdout."""

    def __init__(self) -> None:
        enc = getattr(sys.stdout, "encoding", None) or "ascii"
        try:
            "├└│─→".encode(enc)
            self.unicode = True
        except (UnicodeEncodeError, LookupError):
            self.unicode = False

    def line(self, text: str = "") -> None:
        sys.stdout.write(text + "\n")


def _ago(t: float, now: float) -> str:
    d = now - t
    if d < 0:
        return "in the future"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= span:
            return f"{int(d // span)}{unit} ago"
    return f"{int(d)}s ago"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _meter(label: str) -> Callable[[int, int], None] | None:
    meter = Meter(label)
    delay = float(os.environ.get(_DELAY_ENV) or 0)
    if not meter.enabled and not delay:
        return None

    def update(done: int, total: int) -> None:
        meter.update(done, total)
        if delay:
            time.sleep(delay)
        if done >= total:
            meter.close()

    _METERS.append(meter)
    return update


_METERS: list[Meter] = []


# -- opening ---------------------------------------------------------------------------------
def _store_dir(args: argparse.Namespace) -> str:
    root = getattr(args, "dir", None) or default_dir()
    if not os.path.isdir(root):
        raise UsageError(f"no snapstore store at {root} (no such directory); pass --dir or set $SNAPSTORE_DIR")
    if not os.path.isfile(os.path.join(root, DB_NAME)):
        raise UsageError(f"{root} is not a snapstore store (no {DB_NAME})")
    return root


@contextmanager
def _open(root: str, *, readonly: bool, snapshot: bool = False) -> Iterator[Repo]:
    """Open the store: read-write, read-only (live reads), or a snapshot (a private in-memory copy of
    the catalog, taken without writing any byte of the store directory: inspect, stats, gc --dry-run).

    A read-only session leaves no -wal/-shm files it created behind.
    """
    if snapshot:
        snap = SnapshotRepo.open(root)
        try:
            yield snap
        finally:
            snap.close()
        return
    db_path = os.path.join(root, DB_NAME)
    had_wal = os.path.exists(db_path + "-wal") or os.path.exists(db_path + "-shm")
    repo = Repo.open(root, readonly=readonly, create=False)
    try:
        yield repo
    finally:
        repo.close()
        if readonly and not had_wal:
            release_wal(db_path)


def _snap_line(d: dict[str, Any], now: float) -> str:
    bits = [f"#{d['id']}", f"{d['n_tokens']} tok"]
    if d["rows"]:
        bits.append(" ".join(f"{k}={v}" for k, v in sorted(d["rows"].items())))
    if d["components"]:
        bits.append("+" + ",".join(d["components"]))
    bits.append(f"{human_bytes(d['logical_bytes'])} logical / {human_bytes(d['stored_bytes'])} stored")
    flags = []
    if d["pending"]:
        flags.append("pending")
    if not d["matchable"]:
        flags.append("superseded")
    if d["pinned"]:
        flags.append("pinned")
    if flags:
        bits.append(",".join(flags))
    if d["session"] is not None:
        bits.append(f"session={d['session']}")
    bits.append(f"used {_ago(d['last_used'], now)}")
    bits.append(f"hits {d['hits']}")
    return "  ".join(bits)


def _print_inspect_all(doc: dict[str, Any], out: _Out) -> None:
    now = time.time()
    by_id = {d["id"]: d for d in doc["snapshots"]}
    tee, ell, bar = ("├── ", "└── ", "│   ") if out.unicode else ("|-- ", "`-- ", "|   ")
    out.line(f"store {doc['dir']}")
    if not doc["identities"]:
        out.line("  (no identities: nothing has opened this store for an engine yet)")
    drawn: set[int] = set()
    for ident in doc["identities"]:
        fields = ident["fields"]
        extra = fields.pop("extra", {}) if isinstance(fields.get("extra"), dict) else {}
        desc = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in fields.items())
        desc += "".join(f" extra.{k}={v}" for k, v in extra.items())
        fields["extra"] = extra
        out.line()
        out.line(f"identity {ident['key']}  {desc}")
        out.line(f"  {ident['snapshots']} snapshots; created {_stamp(ident['created'])}, "
                 f"last opened {_ago(ident['last_open'], now)}")
        for ns in ident["namespaces"]:
            out.line(f"  namespace {ns['namespace'] if ns['namespace'] is not None else '(default)'}: "
                     f"{ns['snapshots']} snapshots")
            # iterative depth-first walk (chains can be thousands deep)
            stack: list[tuple[int, str, str]] = [(r, "    ", "") for r in reversed(ns["roots"])]
            while stack:
                sid, prefix, connector = stack.pop()
                d = by_id[sid]
                drawn.add(sid)
                out.line(prefix + connector + _snap_line(d, now))
                child_prefix = prefix + ("" if not connector else (bar if connector == tee else "    "))
                children = [k for k in d["children"] if k in by_id]
                for i, k in reversed(list(enumerate(children))):
                    stack.append((k, child_prefix, ell if i == len(children) - 1 else tee))
    rest = [d for d in doc["snapshots"] if d["id"] not in drawn]
    if rest:
        out.line()
        out.line("snapshots outside any tree (their identity or parent is missing: run `snapstore verify`):")
        for d in rest:
            out.line("    " + _snap_line(d, now))
    t = doc["totals"]
    out.line()
    out.line(f"totals: {t['snapshots']} snapshots ({t['entries']} matchable, {t['pending']} pending), "
             f"{t['chunks']} chunks, {t['identities']} identities")
    out.line(f"  logical {human_bytes(t['logical_bytes'])}, referenced {human_bytes(t['referenced_bytes'])}, "
             f"stored {human_bytes(t['stored_bytes'])}; dedup {t['dedup_ratio']:.2f}x, "
             f"logical/stored {t['logical_ratio']:.2f}x")


def _print_inspect_one(doc: dict[str, Any], out: _Out) -> None:
    now = time.time()
    d = doc["snapshot"]
    arrow = " → " if out.unicode else " -> "
    out.line(f"snapshot #{d['id']}  identity {d['identity']}  namespace "
             f"{d['namespace'] if d['namespace'] is not None else '(default)'}  session {d['session']}")
    state = "pending" if d["pending"] else "committed"
    state += ", matchable" if d["matchable"] else ", superseded (a chain link only)"
    if d["pinned"]:
        state += ", pinned (has children: " + ", ".join(f"#{k}" for k in d["children"]) + ")"
    out.line(f"  tokens {d['n_tokens']} (this segment {d['base_tokens']}..{d['n_tokens']}), depth {d['depth']}, "
             f"parent {'#' + str(d['parent_id']) if d['parent_id'] is not None else '-'}")
    out.line(f"  {state}")
    out.line(f"  created {_stamp(d['created'])}, last used {_ago(d['last_used'], now)}, hits {d['hits']}")
    out.line(f"  bytes: logical {human_bytes(d['logical_bytes'])}, this segment {human_bytes(d['segment_bytes'])}"
             f" raw, stored {human_bytes(d['stored_bytes'])} (only this snapshot: {human_bytes(d['exclusive_bytes'])})")
    out.line("  chain: " + arrow.join(f"#{x['id']} [{x['base_tokens']},{x['n_tokens']})" for x in d["chain"]))
    out.line("  parts:")
    for p in d["parts"]:
        span = f"rows {p['row_start']}..{p['row_end']}" if p["kind"] == "rows" else "fixed"
        comp = f"  component {p['component']}" if p["component"] else ""
        out.line(f"    {p['name']}  {p['dtype']}{tuple(p['shape'])}  {span}  {human_bytes(p['nbytes'])}"
                 f"{comp}  {p['chunk_count']} chunk{'' if p['chunk_count'] == 1 else 's'}")
        for ch in p["chunks"]:
            if ch is None:
                out.line("      (missing chunk row: run `snapstore verify`)")
            else:
                out.line(f"      {ch['id'][:16]}…  raw {ch['raw_len']}  stored {ch['stored_len']}  "
                         f"{ch['codec']}  refs {ch['refs']}" if out.unicode else
                         f"      {ch['id'][:16]}...  raw {ch['raw_len']}  stored {ch['stored_len']}  "
                         f"{ch['codec']}  refs {ch['refs']}")


def cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    root = _store_dir(args)
    with _open(root, readonly=True, snapshot=True) as repo:
        if args.id is not None:
            doc = repo.db.read(lambda c: inspect_one(c, root, args.id))
        else:
            doc = repo.db.read(lambda c: inspect_all(c, root))
    if args.json:
        _emit_json(doc)
    elif args.id is not None:
        _print_inspect_one(doc, out)
    else:
        _print_inspect_all(doc, out)
    return EXIT_OK


# -- verify ----------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    root = _store_dir(args)
    progress = _meter("verify --deep" if args.deep else "verify")
    clean_after: bool | None = None
    try:
        with _open(root, readonly=not args.repair) as repo:
            report = verify(repo, deep=args.deep, repair=args.repair, progress=progress, grace=args.grace,
                            pending_lease=args.pending_lease)
            if report.repaired:
                clean_after = verify(repo, deep=False).ok
    except CorruptionError as e:  # the catalog itself cannot be read: damage, not a usage error
        report = VerifyReport(deep=args.deep, sqlite_errors=[str(e)])
    status = "clean" if report.ok else ("repaired" if report.repaired else "damaged")
    doc = {"format": FORMAT, "command": "verify", "dir": os.path.abspath(root), "status": status,
           **report.to_dict(), "clean_after_repair": clean_after}
    if args.json:
        _emit_json(doc)
    else:
        _print_verify(doc, report.sqlite_errors, out, args.repair)
    return EXIT_OK if report.ok else EXIT_DAMAGE


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(f"#{i}" for i in ids) if ids else "none"


def _print_verify(doc: dict[str, Any], sqlite_errors: list[str], out: _Out, repair: bool) -> None:
    kind = "deep" if doc["deep"] else "quick"
    out.line(f"verify ({kind}) {doc['dir']}: checked {doc['checked_chunks']} chunks "
             f"({human_bytes(doc['checked_bytes'])})")
    for e in sqlite_errors:
        out.line(f"  sqlite: {e}")
    affected = set(doc["affected_snapshots"])
    for item in doc["damage"]:
        out.line(f"  damaged snapshot #{item['snapshot']}:")
        for why in item["problems"]:
            out.line(f"    - {why}")
    below = sorted(affected - {i["snapshot"] for i in doc["damage"]})
    if below:
        out.line(f"  their chains also carry: {_ids(below)}")
    attributed = {why for item in doc["damage"] for why in item["problems"]}
    other = [p for p in doc["problems"] if not p.startswith("snapshot ") and p not in attributed]
    for p in other:
        out.line(f"  problem: {p}")
    for label, key in (("orphan chunk files", "orphan_files"), ("temp files", "temp_files")):
        if doc[key]:
            out.line(f"  {label} (not damage; `snapstore gc` removes them): {len(doc[key])}")
            for f in doc[key][:20]:
                out.line(f"    {f}")
            if len(doc[key]) > 20:
                out.line(f"    ... {len(doc[key]) - 20} more")
    if doc["dead_pending"]:
        out.line(f"  pending captures of dead processes (gc removes them): {_ids(doc['dead_pending'])}")
    if doc["status"] == "clean":
        if doc["removed_files"]:
            out.line(f"  removed {len(doc['removed_files'])} orphan/temp files older than the grace period")
        out.line("CLEAN: no damage found")
    elif doc["status"] == "repaired":
        out.line(f"REPAIRED: removed {len(doc['removed_snapshots'])} snapshots ({_ids(doc['removed_snapshots'])})"
                 + (f", pruned chain links {_ids(doc['pruned_snapshots'])}" if doc["pruned_snapshots"] else "")
                 + f", {len(doc['removed_files'])} orphan/temp files")
        out.line("  the store now verifies clean" if doc["clean_after_repair"] else
                 "  the store still does not verify clean: run `snapstore verify` again")
    else:
        hint = "" if repair else "; `snapstore verify --repair` removes the affected snapshots"
        if sqlite_errors:
            hint = "; the SQLite database itself is damaged (--repair cannot fix that: restore it or remove the store)"
        out.line(f"DAMAGE FOUND: {len(doc['damaged_snapshots'])} damaged snapshots, "
                 f"{len(doc['affected_snapshots'])} affected{hint}")


# -- gc --------------------------------------------------------------------------------------
def _resolve_identity(repo: Repo, key: str) -> str:
    keys = [k for _i, k, *_ in repo.db.read(lambda t: t.identities())]
    if key in keys:
        return key
    hits = [k for k in keys if k.startswith(key)] if len(key) >= 6 else []
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(keys) or "none"
    raise UsageError(f"no identity {key!r} in the store (known: {known})" if not hits else
                     f"identity prefix {key!r} is ambiguous: {', '.join(hits)}")


def cmd_gc(args: argparse.Namespace, out: _Out) -> int:
    root = _store_dir(args)
    disk_mib = args.disk_mib if args.disk_mib is not None else env_int("SNAPSTORE_DISK_MIB")
    max_entries = args.max_entries if args.max_entries is not None else env_int("SNAPSTORE_MAX_ENTRIES")
    ttl = args.ttl if args.ttl is not None else env_int("SNAPSTORE_TTL")
    progress = None if args.dry_run else _meter("gc")
    with _open(root, readonly=args.dry_run, snapshot=args.dry_run) as repo:
        drop = _resolve_identity(repo, args.drop_identity) if args.drop_identity else None
        keep = _resolve_identity(repo, args.keep_identity) if args.keep_identity else None
        report = gc(repo, grace=args.grace, dry_run=args.dry_run, ttl=float(ttl) if ttl else None,
                    drop_identity=drop, keep_identity=keep,
                    disk_bytes=disk_mib * MIB if disk_mib is not None else None, max_entries=max_entries,
                    progress=progress, pending_lease=args.pending_lease)
    doc = {"format": FORMAT, "command": "gc", "dir": os.path.abspath(root), **report.to_dict(),
           "limits": {"disk_bytes": disk_mib * MIB if disk_mib is not None else None, "max_entries": max_entries,
                      "ttl": float(ttl) if ttl else None, "grace": args.grace,
                      "drop_identity": drop, "keep_identity": keep}}
    if args.json:
        _emit_json(doc)
    else:
        _print_gc(doc, out)
    return EXIT_OK


def _print_gc(doc: dict[str, Any], out: _Out) -> None:
    dry = doc["dry_run"]
    verb = "would remove" if dry else "removed"
    out.line(f"gc {doc['dir']}" + (" (dry run: nothing was changed)" if dry else ""))
    for label, key in (("pending captures of dead processes", "dead_pending"),
                       ("snapshots of stale identities", "stale"),
                       ("expired snapshots (ttl)", "expired"),
                       ("evicted snapshots (LRU leaves, to the budget)", "evicted")):
        if doc[key]:
            out.line(f"  {label}: {_ids(doc[key])}")
    pruned = sorted(set(doc["removed_snapshots"]) - set(doc["dead_pending"]) - set(doc["stale"])
                    - set(doc["expired"]) - set(doc["evicted"]))
    if pruned:
        out.line(f"  chain links left without a purpose: {_ids(pruned)}")
    for label, key in (("chunk files no snapshot uses any more", "chunk_files"),
                       ("orphan chunk files", "orphan_files"), ("temp files", "temp_files")):
        files = doc[key]
        if files:
            out.line(f"  {label}: {len(files)}")
            if dry:
                for f in files:
                    out.line(f"    {f}")
    out.line(f"{verb} {len(doc['removed_snapshots'])} snapshots, "
             f"{len(doc['chunk_files']) + len(doc['orphan_files']) + len(doc['temp_files'])} files, "
             f"{human_bytes(doc['bytes_freed'])}; stored {human_bytes(doc['stored_bytes_before'])} -> "
             f"{human_bytes(doc['stored_bytes_after'])}")


# -- stats -----------------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace, out: _Out) -> int:
    from ._inspect import stats_of

    root = _store_dir(args)
    disk_budget = Budget().resolved().disk_bytes or 0
    with _open(root, readonly=True, snapshot=True) as repo:
        st = repo.db.read(lambda c: stats_of(c, disk_budget, 0))
    d = st.to_dict()
    if args.json:
        _emit_json({"format": FORMAT, "command": "stats", "dir": os.path.abspath(root), "stats": d})
        return EXIT_OK
    lookups = d["hits"] + d["misses"]
    rate = f" ({100 * d['hits'] / lookups:.1f}% hit rate)" if lookups else ""
    rows = [
        ("entries", f"{d['entries']} matchable ({d['snapshots']} snapshots, {d['pending']} pending)"),
        ("hits / misses", f"{d['hits']} / {d['misses']}{rate}"),
        ("hit tokens", f"{d['hit_tokens']} tokens served from the store"),
        ("restores", str(d["restores"])),
        ("inserts", str(d["inserts"])),
        ("evictions", str(d["evictions"])),
        ("supersedes", str(d["supersedes"])),
        ("expired", str(d["expired"])),
        ("abandoned", str(d["abandoned"])),
        ("stale dropped", str(d["stale_dropped"])),
        ("skipped saves", ", ".join(f"{k}={v}" for k, v in sorted(d["skipped"].items())) or "0"),
        ("stored", f"{human_bytes(d['stored_bytes'])} in {d['chunks']} chunks "
                   f"(disk budget {human_bytes(d['disk_budget'])})"),
        ("logical", f"{human_bytes(d['logical_bytes'])}; dedup {d['dedup_ratio']:.2f}x"),
        ("ram tier hits", str(d["ram_hits"])),
    ]
    out.line(f"stats {os.path.abspath(root)}")
    for k, v in rows:
        out.line(f"  {k:<14} {v}")
    return EXIT_OK


# -- main ------------------------------------------------------------------------------------
_COMMANDS: dict[str, Callable[[argparse.Namespace, _Out], int]] = {
    "inspect": cmd_inspect, "verify": cmd_verify, "gc": cmd_gc, "stats": cmd_stats}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``snapstore`` console script and ``python -m snapstore``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    args.json = bool(getattr(args, "json", False))
    command = str(args.command)
    try:
        if getattr(args, "remote", None) is not None:
            return _remote(command, args)
        return _COMMANDS[command](args, _Out())
    except KeyboardInterrupt:
        _close_meters()
        _emit_error(command, "interrupted; the store is consistent (`snapstore gc` collects any leftovers)",
                    EXIT_INTERRUPTED, args.json)
        return EXIT_INTERRUPTED
    except (NotFound, NotFoundError) as e:
        _close_meters()
        _emit_error(command, str(e), EXIT_DAMAGE, args.json)
        return EXIT_DAMAGE
    except (UsageError, SnapstoreError, OSError) as e:
        _close_meters()
        if isinstance(e, BrokenPipeError):
            _silence_stdout()
            return EXIT_OK
        _emit_error(command, str(e) or type(e).__name__, EXIT_USAGE, args.json)
        return EXIT_USAGE


def _remote(command: str, args: argparse.Namespace) -> int:
    """``--remote``: the shared tier's verify/gc; stats/inspect print the local store (if any) first."""
    from ._remote_cli import run_remote

    out = _Out()

    def local() -> dict[str, Any] | None:
        if command not in ("stats", "inspect"):
            return None
        root = getattr(args, "dir", None) or default_dir()
        if not os.path.isfile(os.path.join(root, DB_NAME)):
            return None  # no local store here: the shared tier alone
        with _open(root, readonly=True, snapshot=True) as repo:  # this node's traffic with the shared tier
            mine = repo.db.read(lambda c: {k: v for k, v in sorted(c.counters().items()) if k.startswith("remote_")})
        if not args.json:
            _COMMANDS[command](args, out)
            out.line("  shared tier, this node: " + (", ".join(f"{k[7:]}={v}" for k, v in mine.items())
                                                     or "no traffic yet"))
            return None
        with _open(root, readonly=True, snapshot=True) as repo:
            if command == "stats":
                from ._inspect import stats_of
                st = repo.db.read(lambda c: stats_of(c, Budget().resolved().disk_bytes or 0, 0))
                return {"dir": os.path.abspath(root), "stats": st.to_dict(), "counters": mine}
            return {"dir": os.path.abspath(root), "local": repo.db.read(lambda c: inspect_all(c, root)),
                    "counters": mine}

    return run_remote(command, args, out.line, _emit_json, local)


def _close_meters() -> None:
    for m in _METERS:
        m.close()
    _METERS.clear()


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except OSError:
        pass
