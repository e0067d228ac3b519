"""``rsmem chat``: every line typed continues one carried state (a session).

Ctrl-C during a reply stops that reply (the request is aborted, what it wrote stays in the state) and
returns to the prompt; Ctrl-C at the prompt, or the end of input, saves ``--save-state`` and exits 0.
SIGTERM stops a reply as Ctrl-C does, and then (or at the prompt) saves and exits 143 (128 + SIGTERM).
A line the conversation has no room for (a hybrid model's KV cells) is refused with an error line and
leaves the state as it was; the chat goes on. The speed line counts the time spent replying only.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import TYPE_CHECKING

from rsmem.cli.inputs import LineReader, check_input_file, check_output_path, stdin_bytes, stdin_is_terminal
from rsmem.cli.model import add_model_options, load
from rsmem.cli.run import (
    Interrupt,
    Terminated,
    note_context_full,
    open_session,
    report_speed,
    save_state,
    sigterm_raises,
    stream_request,
    write_out,
)
from rsmem.cli.sampling import add_sampling_options, check_sampling_args, sampling_params
from rsmem.errors import InvalidRequestError

if TYPE_CHECKING:
    from rsmem.engine import Engine, SamplingParams, Session

DEFAULT_STOP = ("\n\n",)  # a reply ends at a blank line unless --stop says otherwise
EXIT_TERMINATED = 128 + signal.SIGTERM  # as a shell reports a program SIGTERM ended


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chat = sub.add_parser("chat", help="interactive: every line continues one carried state")
    add_model_options(chat)
    add_sampling_options(chat)
    chat.add_argument("--save-state", metavar="FILE", help="save the conversation when you quit")
    chat.add_argument("--load-state", metavar="FILE", help="resume a saved conversation")
    chat.set_defaults(func=cmd_chat, check=lambda args: check_sampling_args(args, chat))


def cmd_chat(args: argparse.Namespace) -> int:
    if args.save_state:
        check_output_path("--save-state", args.save_state)
    if args.load_state:
        check_input_file("--load-state", args.load_state)
    params = sampling_params(args, default_stop=DEFAULT_STOP)
    llm = load(args, n_seq_max=1)
    engine = llm.engine
    session = open_session(engine, args.load_state)
    interactive = stdin_is_terminal()
    lines = LineReader(stdin_bytes())
    if interactive:
        sys.stderr.write(
            "rsmem chat: type a line, Enter to send; Ctrl-C stops a reply; Ctrl-C at the prompt or "
            "Ctrl-D quits\n"
        )
    replying = 0.0  # seconds spent on replies, not waiting at the prompt
    code = 0
    try:
        with sigterm_raises():
            while (line := _next_line(lines, interactive)) is not None:
                started = time.perf_counter()
                try:
                    _reply(engine, session, line, params)
                except InvalidRequestError as exc:
                    if exc.param != "prompt":
                        raise
                    _refuse(exc, llm.context.max_seq_tokens, session)
                finally:
                    replying += time.perf_counter() - started
    except KeyboardInterrupt:  # at the prompt (during a reply Ctrl-C only stops the reply)
        sys.stderr.write("\n")
    except Terminated:  # at the prompt, or after the reply it stopped
        code = EXIT_TERMINATED
    if args.save_state:
        save_state(engine, session, args.save_state)
        sys.stderr.write(f"[saved the conversation ({len(session.tokens)} tokens) to {args.save_state}]\n")
    report_speed(engine, replying)
    return code


def _next_line(lines: LineReader, interactive: bool) -> str | None:
    if interactive:
        sys.stderr.write("> ")
        sys.stderr.flush()
    return lines.readline()


def _reply(engine: Engine, session: Session, line: str, params: SamplingParams) -> None:
    """Generate the reply to one line; Ctrl-C stops it and leaves the session ready for the next, SIGTERM
    stops it and then raises :class:`Terminated`."""
    with Interrupt(terminate=True) as stop:
        rid = engine.add_request(line.rstrip("\n") + "\n", params, session=session)
        streamed = stream_request(engine, rid, write_out, stop)
    write_out("\n")
    note_context_full(streamed, params.max_tokens)
    if streamed.interrupted:
        sys.stderr.write("[interrupted]\n")
    if stop.signum == signal.SIGTERM:
        raise Terminated


def _refuse(exc: InvalidRequestError, max_seq_tokens: int | None, session: Session) -> None:
    """The error line of a line the conversation has no room for (refused before anything ran), with
    the room left: a session's prompt and reply fill all but one of a sequence's cells (the reply's last
    token, decoded by the next line or the save, takes the last)."""
    if max_seq_tokens is None:
        hint = ""
    elif (room := max_seq_tokens - 1 - len(session.tokens) - len(session.pending)) < 1:
        hint = "; the conversation fills the context: end the chat (Ctrl-D)"
    else:
        hint = f"; a line of at most {room} tokens fits, or end the chat (Ctrl-D)"
    sys.stderr.write(f"rsmem: error: not sent: {exc.named('the conversation with this line')}{hint}\n")
