"""Where prompts come from, and the paths the user names: everything checked before a model is loaded.

Text is read as bytes and decoded as strict UTF-8 here, so an invalid byte becomes one
:class:`~rsmem.errors.RsmemError` naming its source and offset (never a traceback, and never a lone
surrogate handed to the tokenizer). File errors name the flag and the path as the user typed them.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from pathlib import Path
from typing import BinaryIO

from rsmem.cli.sampling import unescape
from rsmem.errors import RsmemError


def decode(data: bytes, source: str, offset: int = 0) -> str:
    """``data`` as UTF-8; ``source`` (e.g. ``stdin``, ``-f notes.txt``) and ``offset`` (of ``data`` in
    the source) name an invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RsmemError(
            f"{source}: invalid UTF-8 at byte {offset + exc.start} (0x{data[exc.start]:02x})"
        ) from None


def argument_text(source: str, value: str) -> str:
    """A command-line argument as text: bytes that were not UTF-8 (kept by Python as lone surrogates,
    which no tokenizer accepts) are reported like invalid input."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        decode(os.fsencode(value), source)
    return value


def read_file_text(flag: str, path: str) -> str:
    """A whole text file named by ``flag``."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RsmemError(f"{flag} {path}: {exc.strerror or exc}") from None
    return decode(data, f"{flag} {path}")


def stdin_bytes() -> BinaryIO:
    """The binary stream under ``sys.stdin`` (read at call time, so tests can replace it); an empty one
    when stdin is closed."""
    return sys.stdin.buffer if sys.stdin is not None else io.BytesIO()


def stdin_is_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``generate``: one whole prompt (argument, ``-p``, ``-f`` or stdin) or, with
    ``--prompts-file``, one per non-blank line."""
    if args.prompts_file is not None:
        text = read_file_text("--prompts-file", args.prompts_file)
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise RsmemError(f"--prompts-file {args.prompts_file} holds no prompts")
        return prompts
    if args.prompt_text is not None:
        text = argument_text("-p", args.prompt_text)
        return [unescape(text) if args.escape else text]
    if args.file is not None:
        text = read_file_text("-f", args.file)
        return [text[:-1] if text.endswith("\n") else text]  # as llama.cpp: one final newline dropped
    if args.prompt is not None:
        return [argument_text("the prompt argument", args.prompt)]
    if sys.stdin is not None and not sys.stdin.isatty():
        return [decode(stdin_bytes().read(), "stdin")]
    raise RsmemError("no prompt: give one as an argument, with -p or -f, on stdin, or with --prompts-file")


def check_one_prompt_source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error when the prompt is given two ways."""
    given = [
        name
        for name, value in (
            ("a prompt argument", args.prompt),
            ("-p", args.prompt_text),
            ("-f", args.file),
            ("--prompts-file", args.prompts_file),
        )
        if value is not None
    ]
    if len(given) > 1:
        parser.error(f"give the prompt one way, not {' and '.join(given)}")


class LineReader:
    """Lines of a binary stream as text, each checked as UTF-8 with its byte offset in the stream."""

    def __init__(self, stream: BinaryIO, source: str = "stdin") -> None:
        self.stream = stream
        self.source = source
        self.offset = 0

    def readline(self) -> str | None:
        """The next line (with its newline), or None at the end of the stream."""
        data = self.stream.readline()
        if not data:
            return None
        line = decode(data, self.source, self.offset)
        self.offset += len(data)
        return line


def check_output_path(flag: str, path: str) -> None:
    """Fail now, before any work, if ``path`` cannot be written: its folder must exist and be writable,
    and it must not be a folder itself. Creates nothing."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise RsmemError(f"{flag} {path}: is a folder, not a file")
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        raise RsmemError(f"{flag} {path}: the folder {str(folder)!r} {why}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RsmemError(f"{flag} {path}: the folder {str(folder)!r} is not writable")


def check_input_file(flag: str, path: str) -> None:
    """Fail now, before any work, if ``path`` is not a readable file."""
    target = Path(path)
    if not target.exists():
        raise RsmemError(f"{flag} {path}: {os.strerror(errno.ENOENT)}")
    if not target.is_file():
        raise RsmemError(f"{flag} {path}: not a file")
    if not os.access(target, os.R_OK):
        raise RsmemError(f"{flag} {path}: {os.strerror(errno.EACCES)}")
