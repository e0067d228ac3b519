"""Sampling options of ``generate`` and ``chat``, spelled as llama.cpp spells them.

``-n -1`` means no limit, ``--seed -1`` draws a seed (and prints it, so the run can be repeated), and
``-p``/``--stop`` text understands backslash escapes (``\\n``, ``\\t``, ``\\\\``, ``\\"``, ``\\xHH``) unless
``--no-escape`` is given. ``--grammar``/``--grammar-file`` (GBNF) and ``-j``/``--json-schema`` (or
``-jf``/``--json-schema-file``) constrain the output, as llama-cli's do; at most one of them.
:data:`FLAG_OF_FIELD` maps a :class:`SamplingParams` field back to the flag the
user typed, so an error can name it.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rsmem.engine import SamplingParams
    from rsmem.engine.constraints import Constraint

UNLIMITED = -1  # -n -1: until EOS, a stop string or Ctrl-C (llama.cpp's n_predict = -1)
RANDOM_SEED = -1  # --seed -1: draw one (llama.cpp's LLAMA_DEFAULT_SEED)

# SamplingParams field -> the flag that sets it, for error messages
FLAG_OF_FIELD: dict[str, str] = {
    "temperature": "--temp",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repeat-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "penalty_last_n": "--repeat-last-n",
    "seed": "--seed",
    "max_tokens": "-n",
    "stop": "--stop",
}


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n",
        "--max-tokens",
        "--n-predict",
        type=int,
        default=128,
        metavar="N",
        help="tokens to generate, -1 = until EOS, a stop string or Ctrl-C (default 128)",
    )
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.1, help="repetition penalty (default 1.1)")
    p.add_argument(
        "--repeat-last-n",
        type=int,
        default=64,
        help="last N tokens the penalties look at, -1 = all, 0 = off (default 64)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument(
        "-s",
        "--seed",
        type=int,
        default=None,
        help="seed for reproducible sampling; -1: draw one and print it (default: random, not shown)",
    )
    p.add_argument(
        "--stop",
        "-r",
        "--reverse-prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop string (repeatable; escapes such as \\n are processed)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    p.add_argument(
        "-e", "--escape", action="store_true", default=True, help="process escapes in -p and --stop (default)"
    )
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take -p and --stop literally")
    add_constraint_options(p)


def add_constraint_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    group.add_argument(
        "--grammar", metavar="GBNF", help="constrain the output to a GBNF grammar (llama.cpp's)"
    )
    group.add_argument("--grammar-file", metavar="FILE", help="--grammar, read from FILE")
    group.add_argument("-j", "--json-schema", metavar="SCHEMA", help="constrain the output to a JSON schema")
    group.add_argument("-jf", "--json-schema-file", metavar="FILE", help="--json-schema, read from FILE")


def check_sampling_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors the parser cannot express (exit code 2)."""
    if args.max_tokens < 1 and args.max_tokens != UNLIMITED:
        parser.error(f"-n must be at least 1, or -1 for no limit, got {args.max_tokens}")


def sampling_params(args: argparse.Namespace, *, default_stop: tuple[str, ...] = ()) -> SamplingParams:
    """The request's parameters from the options; draws (and reports) the seed for ``--seed -1``.

    Raises :class:`~rsmem.errors.InvalidRequestError` for a value out of range (the caller names the
    flag with :data:`FLAG_OF_FIELD`).
    """
    from rsmem.engine import SamplingParams

    constraint = constraint_of(args)
    stops = tuple(unescape(s) if args.escape else s for s in args.stop)
    if constraint is None:  # under a constraint the grammar decides where the output ends
        stops = stops or default_stop
    return SamplingParams(
        max_tokens=None if args.max_tokens == UNLIMITED else args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        penalty_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=resolve_seed(args.seed),
        stop=stops,
        ignore_eos=args.ignore_eos,
        constraint=constraint,
    )


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The constraint the options ask for; a file that cannot be read is an OSError, a schema that is
    not JSON an InvalidRequestError naming its flag."""
    from rsmem.engine.constraints import Constraint

    if args.grammar is not None:
        return Constraint.grammar(args.grammar, field="--grammar")
    if args.grammar_file is not None:
        with open(args.grammar_file, encoding="utf-8") as f:
            return Constraint.grammar(f.read(), field="--grammar-file")
    if args.json_schema is not None:
        return Constraint("json_schema", args.json_schema, "--json-schema")
    if args.json_schema_file is not None:
        with open(args.json_schema_file, encoding="utf-8") as f:
            return Constraint("json_schema", f.read(), "--json-schema-file")
    return None


def resolve_seed(seed: int | None) -> int | None:
    """``-1`` becomes a fresh 32-bit seed, printed on stderr as ``[seed: N]``; others pass through."""
    if seed != RANDOM_SEED:
        return seed
    drawn = secrets.randbits(32)
    sys.stderr.write(f"[seed: {drawn}]\n")
    return drawn


_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def unescape(text: str) -> str:
    """llama.cpp's escape processing: ``\\n \\r \\t \\' \\" \\\\ \\xHH``; any other ``\\c`` stays as typed."""

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        if len(code) == 3:  # xHH
            return chr(int(code[1:], 16))
        return _SIMPLE.get(code, m.group(0))

    return _ESCAPE.sub(one, text)
