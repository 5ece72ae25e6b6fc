"""Ctrl-C while the ``snapstore`` command starts (issue 46 item 14): one line and exit 130, never a
``KeyboardInterrupt`` traceback.

Importing the package takes most of a short command's time (numpy, SQLite, the codecs), and no
code of the command runs before it, so the package imports this module first. It acts only when
the process *is* the snapstore command — the console script, or ``python -m snapstore`` — and
Python's own handler is still in place; a program that imports snapstore as a library is left
alone. Until :func:`snapstore.cli.main.main` takes over (:func:`take_over`), a Ctrl-C ends the
process at once: nothing has been opened or written yet. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["guard", "take_over", "taken"]

_taken = False  # take_over() gave SIGINT back to Python: from then on a Ctrl-C raises KeyboardInterrupt


def _is_the_command() -> bool:
    """Whether this process runs the snapstore command (``python -m snapstore``, ``bin/snapstore``)."""
    if sys.argv[:1] == ["-m"]:  # the interpreter's own -m, while it imports the module's package
        argv: list[str] = [str(a) for a in getattr(sys, "orig_argv", [])]
        for i, a in enumerate(argv[1:], 1):
            if a == "-m":
                return i + 1 < len(argv) and argv[i + 1] == "snapstore"
            if a.startswith("-m"):
                return a[2:] == "snapstore"
        return False
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return os.path.basename(script) == "snapstore"


def _interrupted(_signum: int, _frame: FrameType | None) -> None:
    """SIGINT before the command began: say so on stderr, as the command reports errors, and exit 130."""
    msg = "interrupted while starting; nothing was read or changed"
    line = (f'{{"format": 1, "command": null, "error": "{msg}", "exit": 130}}' if "--json" in sys.argv[1:]
            else f"snapstore: error: {msg}")
    try:
        os.write(2, (line + "\n").encode())
    finally:
        os._exit(130)


def guard() -> None:
    """Install the start-up handler when this process is the snapstore command (see the module)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler and _is_the_command():
        signal.signal(signal.SIGINT, _interrupted)


def take_over() -> bool:
    """For the command's ``main``: whether the start-up handler was installed (this process is the
    command); if so, Ctrl-C raises ``KeyboardInterrupt`` again from here on, for ``main`` to handle."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not _interrupted:
        return False
    global _taken
    _taken = True  # before the swap: a Ctrl-C that lands inside it raises in the caller, which then knows
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


def taken() -> bool:
    """Whether :func:`take_over` began to hand SIGINT back (also when a Ctrl-C interrupted it)."""
    return _taken


guard()
