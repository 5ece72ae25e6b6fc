"""The ``mlx-server``, ``import-mlx-cache`` and ``export-mlx-cache`` commands (registered by snapstore.cli.parser).

Nothing here imports mlx when the CLI starts: ``mlx-server`` replaces this process with
``python -m snapstore.engine.mlx.server`` (mlx_lm.server with the store-backed prompt cache), and
the file commands import snapstore.engine.mlx when they run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from snapstore.console.context import CliContext, snapshot_id_arg, stored_file

__all__ = ["add_commands"]

_SERVER_HELP = """\
Start mlx_lm.server with a persistent prompt cache: mlx_lm's in-memory LRUPromptCache, with the store
behind it. Every prompt cache the server keeps (the end of the system prompt, of the user's message,
of each response) is also saved, as a delta over its stored prefix; a prompt whose stored prefix is
longer than what memory holds restores it instead of reading it. So after a restart a new chat with a
known system prompt starts from it (the response's usage.prompt_tokens_details.cached_tokens says how
many tokens were not read). Every other argument is mlx_lm.server's own, passed through unchanged.

examples:
  snapstore mlx-server --model mlx-community/Qwen3-4B-4bit --port 8080
  snapstore --dir /var/lib/snapstore mlx-server --disk-mib 20480 --model ./model --prompt-cache-size 20
"""

_IMPORT_HELP = """\
Store a prompt-cache file (mlx_lm.cache_prompt's safetensors) as a snapshot of the model in DIR:
deduplicated against what is stored, checksummed, restorable by the MLX PrefixCache and mlx-server.
mlx_lm's files hold no token ids: give the prompt's with --tokens (a file export-mlx-cache wrote
records them). A file made for another model, or with other cache settings, is refused with what
differs. Prints the snapshot id.

examples:
  snapstore import-mlx-cache prompt.safetensors --model ./model --tokens @prompt_ids.json
"""

_EXPORT_HELP = """\
Write a stored snapshot of the model in DIR as a prompt-cache file mlx_lm loads (load_prompt_cache,
mlx_lm.generate --prompt-cache-file): the deepest stored prefix of --tokens, or snapshot --id.

examples:
  snapstore export-mlx-cache --model ./model --tokens @prompt_ids.json prompt.safetensors
"""


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the MLX subcommands to the snapstore parser, each with its handler as ``run``."""
    fmt = argparse.RawDescriptionHelpFormatter
    ps = sub.add_parser("mlx-server", parents=[common], formatter_class=fmt, description=_SERVER_HELP,
                        allow_abbrev=False, help="mlx_lm.server with a persistent prompt cache")
    ps.add_argument("--disk-mib", type=int, metavar="N", help="disk budget (default $SNAPSTORE_DISK_MIB)")
    ps.add_argument("--persist", default="system,user,assistant", metavar="TYPES",
                    help="the prompt caches saved to the store, by mlx_lm's cache type (default: all three)")
    ps.set_defaults(run=cmd_mlx_server, passthrough=[])
    for name, helptext, desc in (("import-mlx-cache", "store an mlx_lm prompt-cache file as a snapshot", _IMPORT_HELP),
                                 ("export-mlx-cache", "write a snapshot as an mlx_lm prompt-cache file", _EXPORT_HELP)):
        p = sub.add_parser(name, parents=[common], formatter_class=fmt, description=desc, help=helptext)
        p.add_argument("file", metavar="FILE")
        p.add_argument("--model", required=True, metavar="DIR", help="the mlx_lm model directory")
        p.add_argument("--name", metavar="NAME", help="the model's name as the file records it (default: DIR as "
                       "given; mlx_lm.cache_prompt records its --model)")
        p.add_argument("--tokens", metavar="IDS", help="token ids: comma-separated, or @FILE (a JSON list)")
        if name == "import-mlx-cache":
            p.add_argument("--session", metavar="S", help="session key (a newer snapshot of it supersedes older ones)")
            p.set_defaults(run=cmd_import)
        else:
            p.add_argument("--id", type=snapshot_id_arg, metavar="N",
                           help="the snapshot to write (instead of --tokens)")
            p.add_argument("--kv-bits", type=int, metavar="B", help="the KV quantization it was stored under")
            p.add_argument("--kv-group-size", type=int, default=64, metavar="G", help="with --kv-bits (default 64)")
            p.add_argument("--max-kv-size", type=int, metavar="N", help="the window it was stored under")
            p.add_argument("--accept-identity", metavar="KEY", help="write a snapshot imported under an identity "
                           "override from KEY (the file cannot carry that mark: an approximation)")
            p.set_defaults(run=cmd_export)


def _need_mlx() -> None:
    from snapstore.console.context import UsageError

    for mod in ("mlx", "mlx_lm"):
        if importlib.util.find_spec(mod) is None:
            raise UsageError(f"this command needs {mod}, which is not installed: pip install 'snapstore[mlx]'")


def cmd_mlx_server(args: argparse.Namespace, ctx: CliContext) -> int:
    """mlx-server ARGS...: replace this process with mlx_lm.server over the store."""
    _need_mlx()
    argv = [sys.executable, "-m", "snapstore.engine.mlx.server", "--store-persist", args.persist]
    if getattr(args, "dir", None):
        argv += ["--store-dir", str(args.dir)]
    if args.disk_mib is not None:
        argv += ["--store-disk-mib", str(args.disk_mib)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [*argv, *args.passthrough])  # noqa: S606  (no shell: an argument list; its exit status is ours)


def _token_list(text: str | None) -> list[int] | None:
    from snapstore.console.context import UsageError

    if text is None:
        return None
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                raw = json.load(f)
        else:
            raw = [t for t in text.replace(",", " ").split()]
        return [int(t) for t in raw]
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--tokens: expected comma-separated ids or @FILE with a JSON list ({e})") from None


def _load_model(path: str) -> Any:
    from pathlib import Path

    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    return model


def cmd_import(args: argparse.Namespace, ctx: CliContext) -> int:
    """import-mlx-cache FILE --model DIR [--tokens IDS]: store the file; print the snapshot id."""
    _need_mlx()
    from snapstore.console.context import FORMAT

    from . import import_prompt_cache

    res = import_prompt_cache(args.file, _load_model(args.model), getattr(args, "dir", None),
                              tokens=_token_list(args.tokens), model_name=args.name or args.model,
                              session=args.session)
    sv = res.save
    return stored_file({"format": FORMAT, "command": "import-mlx-cache", "snapshot_id": sv.snapshot_id,
                        "skipped": sv.skipped, "parent_id": sv.parent_id, "n_tokens": res.n_tokens,
                        "file_bytes": res.file_bytes, "stored_bytes": sv.stored_bytes,
                        "logical_bytes": sv.logical_bytes, "identity": res.identity}, ctx)


def cmd_export(args: argparse.Namespace, ctx: CliContext) -> int:
    """export-mlx-cache FILE --model DIR (--tokens IDS | --id N): write the snapshot as a prompt-cache file."""
    _need_mlx()
    from snapstore.console.context import FORMAT, UsageError

    from . import export_prompt_cache

    tokens = _token_list(args.tokens)
    if (tokens is None) == (args.id is None):
        raise UsageError("export-mlx-cache takes --tokens IDS or --id N, one of them")
    res = export_prompt_cache(args.file, _load_model(args.model), getattr(args, "dir", None), tokens=tokens,
                              snapshot_id=args.id, model_name=args.name or args.model, kv_bits=args.kv_bits,
                              kv_group_size=args.kv_group_size, max_kv_size=args.max_kv_size,
                              accept_identity=args.accept_identity)
    if ctx.json:
        ctx.emit_json({"format": FORMAT, "command": "export-mlx-cache", "snapshot_id": res.snapshot_id,
                       "n_tokens": res.n_tokens, "file": args.file, "bytes": res.file_bytes,
                       "tokens_recorded": res.tokens_recorded, "exact": res.exact})
    else:
        ctx.line(f"wrote {args.file} ({res.file_bytes} bytes): snapshot {res.snapshot_id}, {res.n_tokens} tokens")
    if not res.exact:
        ctx.note(f"snapstore: {args.file} is snapshot {res.snapshot_id}, state identity {args.accept_identity} "
                 "computed (imported under an identity override): a restore is an approximation, not an exact prefix")
    return 0
