"""The ``import-slot``, ``export-slot`` and ``llama-proxy`` commands (registered by snapstore.cli.parser).

Each command takes the parsed arguments and the run's ``CliContext`` (its output) and returns the exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from snapstore.console.context import snapshot_id_arg

if TYPE_CHECKING:
    from snapstore.console.context import CliContext

__all__ = ["add_commands"]

_IMPORT_HELP = """\
Store a llama-server slot file (written by POST /slots/N?action=save) as a snapshot: a delta over
the deepest stored prefix of it, so a second file that extends the first stores only the new rows.
The file is parsed to its last byte first; a file of another layout, a truncated or damaged file
is refused and the store is left unchanged. Prints the snapshot id.

The identity is the GGUF's SHA-256 (--model), the llama.cpp build and the slot's settings. With
--upstream URL it is the identity of that running server, as llama-proxy takes it: its build, its
LoRA adapters and scales, and a K/V probe run in its slot 0 (put back afterwards; --slot-save-path,
default FILE's directory) that tells runtime settings it does not report (RoPE base and scaling,
YaRN, control vectors); the server must serve --model. Without a server those settings cannot be
known, so the snapshot is stored under runtime "unseen", which llama-proxy never matches
(export-slot by id still works).

examples:
  snapstore import-slot /var/lib/llama/slots/chat1.bin --model model.gguf --upstream http://127.0.0.1:8080
  snapstore import-slot chat1.bin --model model.gguf --build b6500-abc123 --session chat-1 --json
"""

_EXPORT_HELP = """\
Write snapshot ID as a slot file llama-server restores (POST /slots/N?action=restore with its
name, the file in the server's --slot-save-path). Every chunk is verified while reading. A
snapshot stored with the draft context's state (the file's SDFT block) is written with it, unless
--no-draft (a target without that draft model); one stored without it is written without.

With --for-model OTHER.gguf the file is written for a server running another GGUF (a smaller
quant of the same model, after a restart under memory pressure) only when the cache layout agrees
exactly: architecture, layer count, attention and recurrent layers, every layer's K/V row size,
the recurrent state's sizes, the sliding window, and the K/V cache types the target runs
(--cache-type-k/-v, llama-server's -ctk/-ctv, default f16). Otherwise it exits 2 naming the first
difference and writes nothing. Such a restore is an approximation you chose: the state was
computed with other weights. Nothing is stored for OTHER, and snapstore never matches a snapshot
of one model for another by itself.

examples:
  snapstore export-slot 42 /var/lib/llama/slots/restored.bin
  snapstore export-slot 42 /var/lib/llama/slots/moved.bin --for-model /models/model-Q4_K_M.gguf
"""

_PROXY_HELP = """\
An HTTP proxy in front of a running llama-server that gives every client prefix persistence:
completion and chat-completion requests first get the longest stored prefix restored into their
slot, and after the response the end of the system prompt (shared by new chats, saved once per
distinct system prompt) and the conversation's prompt (under its session, so the next turn
restores it) are saved. Everything else is passed through untouched, streaming included.
llama-server must run with --slot-save-path DIR (the same DIR here) and --slots.
The proxy serves Prometheus metrics at /metrics and logs one line per restore/save decision.

Before every restore and save it looks at what the server serves now (/props, /lora-adapters, the
model file): another model, build, process or adapter scale and it takes the identity again (the
weights' SHA-256, the adapters', and a K/V probe that tells RoPE/YaRN/control-vector settings the
server does not report), so state of one is never restored into another. What it cannot see makes
it restore and save nothing (logged, counted in /metrics).

examples:
  llama-server -m model.gguf --slot-save-path /var/lib/llama/slots --slots --port 8080 &
  snapstore llama-proxy --upstream http://127.0.0.1:8080 --slot-save-path /var/lib/llama/slots \\
      --listen 127.0.0.1:8081 --disk-mib 20480
"""


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the llama.cpp subcommands to the snapstore parser, each with its handler as ``run``."""
    fmt = argparse.RawDescriptionHelpFormatter
    pi = sub.add_parser("import-slot", parents=[common], formatter_class=fmt, description=_IMPORT_HELP,
                        help="store a llama-server slot file as a snapshot (prints its id)")
    pi.add_argument("file", metavar="FILE")
    pi.add_argument("--model", required=True, metavar="MODEL.gguf", help="the GGUF the slot was computed with")
    pi.add_argument("--session", metavar="S", help="session key (a newer snapshot of it supersedes older ones)")
    pi.add_argument("--slot-save-path", metavar="DIR", help="with --upstream: the server's --slot-save-path "
                    "(default: FILE's directory)")
    _build_args(pi)
    pe = sub.add_parser("export-slot", parents=[common], formatter_class=fmt, description=_EXPORT_HELP,
                        help="write a snapshot as a slot file llama-server restores")
    pe.add_argument("id", type=snapshot_id_arg, metavar="ID")
    pe.add_argument("out", metavar="FILE")
    pe.add_argument("--for-model", metavar="OTHER.gguf", help="write it for a server running this other GGUF "
                    "(only when its cache layout agrees exactly; an approximation, never an exact restore)")
    pe.add_argument("--accept-identity", metavar="KEY", help="write a snapshot imported under an identity "
                    "override from KEY (the slot file cannot carry that mark: an approximation)")
    pe.add_argument("--cache-type-k", metavar="T", help="with --for-model: the target's -ctk (default f16)")
    pe.add_argument("--cache-type-v", metavar="T", help="with --for-model: the target's -ctv (default f16)")
    pe.add_argument("--no-draft", action="store_true", help="leave out the draft context's state (the SDFT block), "
                    "for a target that runs no draft model (always left out with --for-model)")
    pp = sub.add_parser("llama-proxy", parents=[common], formatter_class=fmt, description=_PROXY_HELP,
                        help="HTTP proxy giving a running llama-server prefix persistence")
    pp.add_argument("--upstream", required=True, metavar="URL", help="llama-server base URL")
    pp.add_argument("--slot-save-path", required=True, metavar="DIR", help="llama-server's --slot-save-path")
    pp.add_argument("--model", metavar="MODEL.gguf", help="the GGUF llama-server serves, when the path it reports "
                    "(/props model_path) is not readable here (default: that path)")
    pp.add_argument("--listen", default="127.0.0.1:8081", metavar="HOST:PORT", help="default 127.0.0.1:8081")
    pp.add_argument("--build", metavar="B", help="llama.cpp build (default: $SNAPSTORE_LLAMA_BUILD, else /props)")
    pp.add_argument("--disk-mib", type=int, metavar="N", help="disk budget (default $SNAPSTORE_DISK_MIB)")
    pp.add_argument("--ram-mib", type=int, metavar="N", help="RAM tier budget (default $SNAPSTORE_RAM_MIB)")
    pp.add_argument("--keep-stale", action="store_true", help="keep the snapshots of this model under another "
                    "build or cache setting (default: dropped at start, as the store's stale rule says)")
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
    from snapstore import default_dir
    from snapstore.console.context import UsageError

    root = str(getattr(args, "dir", None) or default_dir())
    if not create and not os.path.isdir(root):
        raise UsageError(f"no snapstore store at {root}; pass --dir or set $SNAPSTORE_DIR")
    return root


UNSPECIFIED_BUILD = "unspecified"  # the build of an import that named none
MIB = 1 << 20


def _build(args: argparse.Namespace, ctx: CliContext) -> str:
    from ._identify import BUILD_ENV

    if getattr(args, "build", None):
        return str(args.build)
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
    from snapstore.console.context import FORMAT, UsageError, stored_file

    from ._slotstore import SlotStore

    if not os.path.isfile(args.file):  # as `import`: not a raw "[Errno 2] No such file or directory"
        raise UsageError(f"no slot file at {args.file}")
    with open(args.file, "rb") as f:
        data = f.read()
    if args.upstream:
        ss = _server_slotstore(args, ctx)
    else:
        ss = SlotStore(_root(args, create=True), args.model, _build(args, ctx))
        ctx.note("snapstore: no --upstream: the server's runtime settings (LoRA, RoPE, control vectors) are unknown, "
                 "so this is stored under runtime 'unseen', which llama-proxy never matches — pass --upstream URL "
                 "of the server that computed it so it can")
    try:
        res = ss.import_bytes(data, session=args.session, what=args.file)
    finally:
        ss.close()
    sv = res.save
    doc = {"format": FORMAT, "command": "import-slot", "snapshot_id": sv.snapshot_id, "skipped": sv.skipped,
           "parent_id": sv.parent_id, "n_tokens": res.n_tokens, "file_bytes": res.file_bytes,
           "stored_bytes": sv.stored_bytes, "logical_bytes": sv.logical_bytes,
           "checkpoints_dropped": res.checkpoints_dropped, "draft": res.draft}
    return stored_file(doc, ctx)


def _server_slotstore(args: argparse.Namespace, ctx: CliContext) -> Any:
    """A SlotStore under the identity the running server at --upstream has now (as llama-proxy takes it)."""
    from snapstore import ConfigError

    from ._identify import BUILD_ENV, build_warning, model_info
    from ._served import identify, model_of, served_now
    from ._slotfile import decode
    from ._slotstore import SlotStore
    from ._upstream import LlamaServer

    slot_dir = args.slot_save_path or os.path.dirname(os.path.abspath(args.file))
    server = LlamaServer(str(args.upstream), slot_dir, 600.0, os.environ.get("LLAMA_API_KEY"))
    served = served_now(server, args.model)
    mine, theirs = model_info(args.model), model_of(served, args.model, served.model_path)
    if mine.sha256 != theirs.sha256:
        raise ConfigError(f"llama-server at {server.upstream} serves {theirs.path} ({theirs.pack}), not --model "
                          f"{args.model} ({mine.pack}): its settings are not the ones the slot was computed with")
    env = os.environ.get(BUILD_ENV) or None
    warning = build_warning(served.build, env)
    if warning:
        ctx.note(f"snapstore: warning: {warning}")
    _, _, runtime = identify(server, served, 0, model_hint=args.model, hint_path=served.model_path,
                             decode_with=lambda m: lambda b: decode(b, m.shape, what="the K/V probe"),
                             keep_slot=lambda m, r: True)  # the server's own slot 0, as it was
    return SlotStore(_root(args, create=True), mine, env or served.build or "unspecified", runtime=runtime.to_extra())


def cmd_export_slot(args: argparse.Namespace, ctx: CliContext) -> int:
    """export-slot ID FILE: write the snapshot as a slot file."""
    from snapstore import OutputFile
    from snapstore.console.context import FORMAT, UsageError

    from ._slotstore import export_slot

    check = None
    if args.for_model:
        check = _for_model_check(args)
    elif args.cache_type_k or args.cache_type_v:
        raise UsageError("--cache-type-k/-v only go with --for-model (a plain export writes the snapshot's own types)")
    root = _root(args, create=False)
    # nothing a command does destroys a store (issue 46 item 10): never inside a store, never over a
    # store's own file (checked before the snapshot is read); a file elsewhere is replaced (as before),
    # by one rename of a fresh temporary file (snapstore.OutputFile)
    with OutputFile(args.out, overwrite=True, store_root=root, what="the slot file") as out:
        data, own = export_slot(root, args.id, check=check, draft=not (args.no_draft or args.for_model),
                                accept_identity=args.accept_identity)
        out.write(data)
    if ctx.json:
        ctx.emit_json({"format": FORMAT, "command": "export-slot", "snapshot_id": args.id, "file": args.out,
                       "bytes": len(data), "for_model": args.for_model, "exact": own and not args.for_model})
    else:
        ctx.line(f"wrote {args.out} ({len(data)} bytes)")
    if not own:
        ctx.note(f"snapstore: {args.out} is snapshot {args.id}, state identity {args.accept_identity} computed "
                 "(imported under an identity override): a restore is an approximation, not an exact prefix")
    if args.for_model:
        ctx.note(f"snapstore: {args.out} is snapshot {args.id} written for {args.for_model}, whose cache layout "
                 "agrees; its state was computed with the snapshot's weights, so a restore there is an approximation, "
                 "not an exact prefix (nothing was stored for that model)")
    return 0


def _for_model_check(args: argparse.Namespace) -> Any:
    """The ``--for-model`` check: the snapshot's cache layout against OTHER's metadata and the target's types."""
    from ._formodel import check_for_model, type_id
    from ._identify import model_shape

    other = model_shape(args.for_model)
    ck, cv = type_id(args.cache_type_k or "f16"), type_id(args.cache_type_v or "f16")
    return lambda extra: check_for_model(extra, other, args.for_model, cache_k=ck, cache_v=cv)


def cmd_llama_proxy(args: argparse.Namespace, ctx: CliContext) -> int:
    """llama-proxy: serve until interrupted."""
    from snapstore import Budget
    from snapstore.console.context import UsageError

    from ._bridge import LlamaBridge
    from ._proxy import run_proxy

    host, _, port = str(args.listen).rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--listen takes HOST:PORT, got {args.listen!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    budget = Budget(disk_bytes=None if args.disk_mib is None else args.disk_mib * MIB,
                    ram_bytes=None if args.ram_mib is None else args.ram_mib * MIB)
    root = _root(args, create=True)
    bridge = LlamaBridge(args.upstream, args.slot_save_path, args.model, store_dir=root, build=args.build,
                         budget=budget, keep_stale=args.keep_stale, api_key=args.api_key)
    bridge.start()
    try:
        run_proxy(bridge, host, int(port), on_listen=lambda: _say(ctx, listen_line(bridge, host, int(port), root)))
    finally:
        bridge.close()
    return 0


def _say(ctx: CliContext, text: str) -> None:
    ctx.line(text)
    ctx.stdout.flush()  # a long-running command: the line must not wait in a pipe's buffer


def listen_line(bridge: Any, host: str, port: int, root: str) -> str:
    """The one line printed when the proxy listens: address, upstream, store and identity."""
    store = bridge.slots.store
    ident = store.identity.key if store is not None else f"none (not persisting: {bridge.refusal_reason})"
    model = bridge.slots.model
    return (f"snapstore llama-proxy: listening on http://{host}:{port}, upstream {bridge.upstream}, store {root}, "
            f"identity {ident} (model {os.path.basename(model.path)} {model.pack[:19]}, build {bridge.build})")
