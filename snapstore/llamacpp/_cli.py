"""The ``import-slot``, ``export-slot`` and ``llama-proxy`` commands (registered by snapstore._cli_parser).

Each command takes the parsed arguments and the run's ``CliContext`` (its output) and returns the exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._cli_context import CliContext

__all__ = ["add_commands"]

_IMPORT_HELP = """\
Store a llama-server slot file (written by POST /slots/N?action=save) as a snapshot: a delta over
the deepest stored prefix of it, so a second file that extends the first stores only the new rows.
The file is parsed to its last byte first; a file of another layout, a truncated or damaged file
is refused and the store is left unchanged. Prints the snapshot id.

The identity is the GGUF's SHA-256 (--model), the llama.cpp build (--build, $SNAPSTORE_LLAMA_BUILD,
or asked of a running server with --upstream) and the slot's settings, so llama-proxy for the
same model and build finds it.

examples:
  snapstore import-slot /var/lib/llama/slots/chat1.bin --model model.gguf --upstream http://127.0.0.1:8080
  snapstore import-slot chat1.bin --model model.gguf --build b6500-abc123 --session chat-1 --json
"""

_EXPORT_HELP = """\
Write snapshot ID as a slot file llama-server restores (POST /slots/N?action=restore with its
name, the file in the server's --slot-save-path). Every chunk is verified while reading.

examples:
  snapstore export-slot 42 /var/lib/llama/slots/restored.bin
"""

_PROXY_HELP = """\
An HTTP proxy in front of a running llama-server that gives every client prefix persistence:
completion and chat-completion requests first get the longest stored prefix restored into their
slot, and after the response the end of the system prompt (shared by new chats, saved once per
distinct system prompt) and the conversation's prompt (under its session, so the next turn
restores it) are saved. Everything else is passed through untouched, streaming included.
llama-server must run with --slot-save-path DIR (the same DIR here) and --slots.
The proxy serves Prometheus metrics at /metrics and logs one line per restore/save decision.

examples:
  llama-server -m model.gguf --slot-save-path /var/lib/llama/slots --slots --port 8080 &
  snapstore llama-proxy --upstream http://127.0.0.1:8080 --slot-save-path /var/lib/llama/slots \\
      --model model.gguf --listen 127.0.0.1:8081 --disk-mib 20480
"""


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the llama.cpp subcommands to the snapstore parser, each with its handler as ``run``."""
    fmt = argparse.RawDescriptionHelpFormatter
    pi = sub.add_parser("import-slot", parents=[common], formatter_class=fmt, description=_IMPORT_HELP,
                        help="store a llama-server slot file as a snapshot (prints its id)")
    pi.add_argument("file", metavar="FILE")
    pi.add_argument("--model", required=True, metavar="MODEL.gguf", help="the GGUF the slot was computed with")
    pi.add_argument("--session", metavar="S", help="session key (a newer snapshot of it supersedes older ones)")
    _build_args(pi)
    pe = sub.add_parser("export-slot", parents=[common], formatter_class=fmt, description=_EXPORT_HELP,
                        help="write a snapshot as a slot file llama-server restores")
    pe.add_argument("id", type=int, metavar="ID")
    pe.add_argument("out", metavar="FILE")
    pp = sub.add_parser("llama-proxy", parents=[common], formatter_class=fmt, description=_PROXY_HELP,
                        help="HTTP proxy giving a running llama-server prefix persistence")
    pp.add_argument("--upstream", required=True, metavar="URL", help="llama-server base URL")
    pp.add_argument("--slot-save-path", required=True, metavar="DIR", help="llama-server's --slot-save-path")
    pp.add_argument("--model", required=True, metavar="MODEL.gguf", help="the GGUF llama-server serves")
    pp.add_argument("--listen", default="127.0.0.1:8081", metavar="HOST:PORT", help="default 127.0.0.1:8081")
    pp.add_argument("--build", metavar="B", help="llama.cpp build (default: $SNAPSTORE_LLAMA_BUILD, else /props)")
    pp.add_argument("--disk-mib", type=int, metavar="N", help="disk budget (default $SNAPSTORE_DISK_MIB)")
    pp.add_argument("--ram-mib", type=int, metavar="N", help="RAM tier budget (default $SNAPSTORE_RAM_MIB)")
    pp.add_argument("--api-key", metavar="KEY", default=os.environ.get("LLAMA_API_KEY"),
                    help="llama-server's --api-key (default $LLAMA_API_KEY): used for the proxy's own calls and "
                         "required of clients here as there")
    pi.set_defaults(run=cmd_import_slot)
    pe.set_defaults(run=cmd_export_slot)
    pp.set_defaults(run=cmd_llama_proxy)


def _build_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--build", metavar="B", help="the llama.cpp build that wrote the slot ($SNAPSTORE_LLAMA_BUILD)")
    g.add_argument("--upstream", metavar="URL", help="ask this running llama-server for its build (/props)")


def _root(args: argparse.Namespace, create: bool) -> str:
    from .._cli_context import UsageError
    from .._config import default_dir

    root = str(getattr(args, "dir", None) or default_dir())
    if not create and not os.path.isdir(root):
        raise UsageError(f"no snapstore store at {root}; pass --dir or set $SNAPSTORE_DIR")
    return root


UNSPECIFIED_BUILD = "unspecified"  # the build of an import that named none


def _build(args: argparse.Namespace, ctx: CliContext) -> str:
    from ._identity import BUILD_ENV, build_of_server

    if getattr(args, "build", None):
        return str(args.build)
    if getattr(args, "upstream", None):
        return build_of_server(str(args.upstream))
    env = os.environ.get(BUILD_ENV)
    if env:
        return env
    # no build named: stored under a build no real server reports, so no build ever restores it by
    # match (export-slot by id still works); the operator is told how to make it matchable
    ctx.note(f"snapstore: no llama.cpp build given; stored under build {UNSPECIFIED_BUILD!r}, which llama-proxy "
             f"never matches — pass --build B, --upstream URL or set ${BUILD_ENV} so it can")
    return UNSPECIFIED_BUILD


def cmd_import_slot(args: argparse.Namespace, ctx: CliContext) -> int:
    """import-slot FILE --model MODEL: store a slot file; print the snapshot id."""
    from .._inspect import FORMAT
    from ._slotstore import SlotStore

    with open(args.file, "rb") as f:
        data = f.read()
    ss = SlotStore(_root(args, create=True), args.model, _build(args, ctx))
    try:
        res = ss.import_bytes(data, session=args.session, what=args.file)
    finally:
        ss.close()
    sv = res.save
    doc = {"format": FORMAT, "command": "import-slot", "snapshot_id": sv.snapshot_id, "skipped": sv.skipped,
           "parent_id": sv.parent_id, "n_tokens": res.n_tokens, "file_bytes": res.file_bytes,
           "stored_bytes": sv.stored_bytes, "logical_bytes": sv.logical_bytes,
           "checkpoints_dropped": res.checkpoints_dropped}
    if ctx.json:
        ctx.emit_json(doc)
    elif sv.snapshot_id is None:
        ctx.line(f"skipped: {sv.skipped}")
    else:
        ctx.line(str(sv.snapshot_id))
        ctx.note(f"snapshot {sv.snapshot_id}: {res.n_tokens} tokens, {sv.stored_bytes} new bytes stored "
                 f"(file {res.file_bytes} bytes), parent {sv.parent_id}")
    return 0 if sv.snapshot_id is not None else 1


def cmd_export_slot(args: argparse.Namespace, ctx: CliContext) -> int:
    """export-slot ID FILE: write the snapshot as a slot file."""
    from .._inspect import FORMAT
    from ._slotstore import export_snapshot

    data = export_snapshot(_root(args, create=False), args.id)
    tmp = args.out + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.out)
    if ctx.json:
        ctx.emit_json({"format": FORMAT, "command": "export-slot", "snapshot_id": args.id, "file": args.out,
                       "bytes": len(data)})
    else:
        ctx.line(f"wrote {args.out} ({len(data)} bytes)")
    return 0


def cmd_llama_proxy(args: argparse.Namespace, ctx: CliContext) -> int:
    """llama-proxy: serve until interrupted."""
    from .._cli_context import UsageError
    from .._config import MIB, Budget
    from ._bridge import LlamaBridge
    from ._proxy import run_proxy

    host, _, port = str(args.listen).rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--listen takes HOST:PORT, got {args.listen!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    budget = Budget(disk_bytes=None if args.disk_mib is None else args.disk_mib * MIB,
                    ram_bytes=None if args.ram_mib is None else args.ram_mib * MIB)
    bridge = LlamaBridge(args.upstream, args.slot_save_path, args.model, store_dir=_root(args, create=True),
                         build=args.build, budget=budget, api_key=args.api_key)
    bridge.start()
    try:
        run_proxy(bridge, host, int(port))
    finally:
        bridge.close()
    return 0
