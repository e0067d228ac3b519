"""The ``rsmem`` command line: generate, chat, serve, info, convert, quantize, bench, demo.

Every failure the user can cause (a missing model file, a bad option value, invalid input bytes, a
corrupt state file) ends with one ``rsmem: error: ...`` line on stderr and exit code 1 (2 for usage
errors), naming the flag the user typed. A closed stdout pipe (``| head``) ends the run quietly with
141 (128 + SIGPIPE, as a shell reports a program killed by it); Ctrl-C outside a generation exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys

from rsmem import startup
from rsmem.cli import chat, generate, quantize, serve, tools
from rsmem.cli.sampling import FLAG_OF_FIELD
from rsmem.errors import InvalidRequestError, RsmemError

__all__ = ["build_parser", "main"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
EXIT_INTERRUPTED = 130  # 128 + SIGINT

# integer options that must be at least 1, wherever a sub-command has them
_POSITIVE = (
    "parallel",
    "threads",
    "steps",
    "prompt_tokens",
    "max_queue",
    "max_body_bytes",
    "max_prompt_tokens",
    "max_tokens_limit",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rsmem", description="Recurrent language models on a recurrent memory"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    chat.register(sub)
    tools.register(sub)
    quantize.register(sub)
    serve.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_positive(args, parser)
    if getattr(args, "check", None) is not None:
        args.check(args)
    startup.release()  # Ctrl-C raises KeyboardInterrupt again: caught below
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except InvalidRequestError as exc:
        flag = FLAG_OF_FIELD.get(exc.param or "")
        return _error(exc.named(flag) if flag else str(exc))
    except (RsmemError, ValueError, OSError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return EXIT_INTERRUPTED


def _check_positive(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in _POSITIVE:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:  # bench's --parallel takes several
            if isinstance(v, int) and v < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    threads = getattr(args, "threads", None)
    if isinstance(threads, int) and threads > (limit := 2 * _cpus()):
        parser.error(
            f"-t {threads}: more than {limit} threads, twice the {limit // 2} CPUs this process may run "
            "on (more threads only wait for each other)"
        )


def _cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system has one).

    ``-t`` accepts up to twice as many threads: rsmem itself runs prompts at twice the cores beside a busy
    process (:func:`rsmem.threads.prompt_threads`); past that, threads only wait for each other."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _error(message: str) -> int:
    sys.stderr.write(f"rsmem: error: {message}\n")
    return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit does not fail again on the closed pipe (the
    recipe of Python's documentation for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (e.g. captured in a test)
        pass
