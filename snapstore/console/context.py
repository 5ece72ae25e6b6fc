"""One run of the ``snapstore`` command: its output streams, JSON mode and progress meters.

Everything a command writes goes through the :class:`CliContext` it is handed, so no state
outlives a run (``main`` may run many times in one process: tests, an embedding script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from snapstore._errors import ConfigError
from snapstore._refs import MAX_ID
from snapstore.check.inspect import FORMAT
from snapstore.console.progress import Meter

__all__ = ["EXIT_DAMAGE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "FORMAT", "CliContext", "UsageError",
           "snapshot_id_arg", "stored_file"]

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DELAY_ENV = "_SNAPSTORE_PROGRESS_DELAY"  # tests only: sleep per progress step (to interrupt mid-work)


class UsageError(ConfigError):
    """A problem with the command line or the store path: exit 2."""


def snapshot_id_arg(text: str) -> int:
    """argparse ``type=`` of every command's snapshot id (inspect, export, export-slot,
    export-mlx-cache): a whole number in [1, 2**63), the API's range, so an id no snapshot can have
    is a usage error (exit 2) and never reaches SQLite (which raised OverflowError past 2**63)."""
    try:
        v = int(text.lstrip("#"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a snapshot id is a whole number, got {text[:40]!r}") from None
    if not 1 <= v <= MAX_ID:
        raise argparse.ArgumentTypeError(f"snapshot ids are whole numbers in [1, 2**63), got {text[:40]}")
    return v


def _can_draw(stream: TextIO) -> bool:
    """Whether *stream*'s encoding has the tree and arrow characters (else ASCII art)."""
    enc = getattr(stream, "encoding", None) or "ascii"
    try:
        "├└│─→".encode(enc)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


@dataclass
class CliContext:
    """Per-run output: text lines or one JSON object on ``stdout``, errors and notes on ``stderr``."""

    json: bool = False
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    meters: list[Meter] = field(default_factory=list)
    unicode: bool = field(init=False)  # draw trees and arrows with box characters (stdout's encoding has them)

    def __post_init__(self) -> None:
        self.unicode = _can_draw(self.stdout)

    def line(self, text: str = "") -> None:
        """One line of human-readable output."""
        self.stdout.write(text + "\n")

    def note(self, text: str) -> None:
        """A line for the operator on stderr (not part of the command's output)."""
        self.stderr.write(text + "\n")
        self.stderr.flush()

    def emit_json(self, obj: dict[str, Any], stream: TextIO | None = None) -> None:
        """Write one JSON object (stdout unless *stream*)."""
        out = stream if stream is not None else self.stdout
        out.write(json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")
        out.flush()

    def error(self, command: str | None, message: str, code: int) -> None:
        """Report an error on stderr: a line, or with --json an object carrying the exit code."""
        if self.json:
            self.emit_json({"format": FORMAT, "command": command, "error": message, "exit": code}, self.stderr)
        else:
            self.note(f"snapstore: error: {message}")

    def meter(self, label: str) -> Callable[[int, int], None] | None:
        """A progress callback drawing a meter on a terminal; None when nothing would be drawn."""
        meter = Meter(label)
        delay = float(os.environ.get(DELAY_ENV) or 0)
        if not meter.enabled and not delay:
            return None

        def update(done: int, total: int) -> None:
            meter.update(done, total)
            if delay:
                time.sleep(delay)
            if done >= total:
                meter.close()

        self.meters.append(meter)
        return update

    def close_meters(self) -> None:
        """Finish every meter's line (an error or interrupt must not print over a half-drawn meter)."""
        for m in self.meters:
            m.close()
        self.meters.clear()

    def silence_stdout(self) -> None:
        """After a broken pipe: point stdout at /dev/null so the interpreter's final flush stays quiet."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def stored_file(doc: dict[str, Any], out: CliContext) -> int:
    """An imported file's save (``import-slot``, ``import-mlx-cache``): the JSON document, else the
    snapshot id on stdout and what was stored on stderr; exit 1 when the save was skipped."""
    sid = doc["snapshot_id"]
    if out.json:
        out.emit_json(doc)
    elif sid is None:
        out.line(f"skipped: {doc['skipped']}")
    else:
        out.line(str(sid))
        out.note(f"snapshot {sid}: {doc['n_tokens']} tokens, {doc['stored_bytes']} new bytes stored "
                 f"(file {doc['file_bytes']} bytes), parent {doc['parent_id']}")
    return 0 if sid is not None else 1
