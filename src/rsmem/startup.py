"""Ctrl-C while the ``rsmem`` command starts: a quiet exit with 130, not a traceback from inside torch.

``import rsmem`` loads torch, which takes a second or more before :func:`rsmem.cli.main` runs and can
catch ``KeyboardInterrupt``. When this process is the command (``rsmem ...``, ``python -m rsmem.cli``),
:func:`guard` (run as ``import rsmem`` imports this module, before anything else) makes SIGINT end it
at once with 130 until :func:`release` (``main``, before it runs the command) gives SIGINT back to
Python. In any other program that imports rsmem nothing changes. The command's model loads in
:func:`interrupt_exits`, which does the same.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

EXIT_INTERRUPTED = 128 + signal.SIGINT  # as a shell reports a Ctrl-C
COMMAND_MODULES = ("rsmem.cli", "rsmem.cli.__main__")
_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")  # python's options whose value is the next argument


def is_command(argv: Sequence[str] | None = None) -> bool:
    """Whether ``argv`` (default: this interpreter's own, ``sys.orig_argv``) runs the ``rsmem`` command: a
    script named ``rsmem`` (the installed entry point) or ``-m rsmem.cli``."""
    args = list(getattr(sys, "orig_argv", []) if argv is None else argv)[1:]
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        arg = args[i]
        if arg == "-m":
            return i + 1 < len(args) and args[i + 1] in COMMAND_MODULES
        if arg.startswith("-m"):  # -mrsmem.cli
            return arg[2:] in COMMAND_MODULES
        if arg.startswith("-c"):
            return False
        i += 2 if arg in _OPTIONS_WITH_VALUE else 1
    return i < len(args) and os.path.splitext(os.path.basename(args[i]))[0] == "rsmem"


def _quit(signum: int, frame: FrameType | None) -> None:
    """Nothing has started: nothing to save or clean up."""
    try:
        sys.stderr.write("\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    os._exit(EXIT_INTERRUPTED)


def guard() -> None:
    """In the ``rsmem`` command, SIGINT exits with 130 from now until :func:`release` (where SIGINT still
    raises ``KeyboardInterrupt``, Python's default)."""
    if is_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _quit)


@contextmanager
def interrupt_exits() -> Iterator[None]:
    """While the block runs (a model loading, the command's kernels building: nothing to save yet), SIGINT
    exits with 130 at once. Raising ``KeyboardInterrupt`` there could be lost: torch.compile runs code
    in callbacks whose exceptions Python only prints, so the load went on. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _quit)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def release() -> None:
    """SIGINT raises ``KeyboardInterrupt`` again, where :func:`guard` had changed it."""
    if signal.getsignal(signal.SIGINT) is _quit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


guard()  # on import: rsmem/__init__.py imports this module before anything else
