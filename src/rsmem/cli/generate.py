"""``rsmem generate``: one prompt streamed (with ``--save-state``/``--load-state``), or the prompts of
``--prompts-file`` decoded together.

The prompt is given one way: an argument, ``-p TEXT`` (escapes processed, as llama-cli), ``-f FILE``
(the whole file, one final newline dropped, as llama-cli) or stdin. Ctrl-C or SIGTERM stops the
generation: the text so far, the statistics line and ``--save-state`` are still written, and the exit code
is 130 (143 after SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING

from rsmem.cli.inputs import (
    check_input_file,
    check_one_prompt_source,
    check_output_path,
    read_prompts,
)
from rsmem.cli.model import add_model_options, load
from rsmem.cli.run import (
    Interrupt,
    note_context_full,
    open_session,
    report_speed,
    save_state,
    stream_request,
    write_out,
)
from rsmem.cli.sampling import add_sampling_options, check_sampling_args, sampling_params
from rsmem.errors import RsmemError

if TYPE_CHECKING:
    from rsmem.engine import LLM, RequestOutput, SamplingParams


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt (argument, -p, -f, stdin, or a file)")
    gen.add_argument("prompt", nargs="?", help="the prompt (default: -p, -f or stdin)")
    gen.add_argument(
        "-p", "--prompt", dest="prompt_text", metavar="TEXT", help="the prompt; escapes such as \\n processed"
    )
    gen.add_argument(
        "-f", "--file", metavar="FILE", help="a file holding the whole prompt (one final newline dropped)"
    )
    gen.add_argument(
        "--prompts-file", metavar="FILE", help="one prompt per line, decoded together (see --parallel)"
    )
    add_model_options(gen)
    add_sampling_options(gen)
    gen.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=4,
        help="sequences decoded together with --prompts-file (default 4)",
    )
    gen.add_argument("--save-state", metavar="FILE", help="save the final state + tokens (llama.cpp .ggsq)")
    gen.add_argument(
        "--load-state", metavar="FILE", help="continue from a saved state; the prompt is appended"
    )
    gen.set_defaults(func=cmd_generate, check=lambda args: _check(args, gen))


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_sampling_args(args, parser)
    check_one_prompt_source(args, parser)
    if args.prompts_file is not None and (args.save_state or args.load_state):
        parser.error("--save-state and --load-state work with one prompt, not --prompts-file")


def cmd_generate(args: argparse.Namespace) -> int:
    # everything the user named is checked before the model loads
    prompts = read_prompts(args)
    if args.save_state:
        check_output_path("--save-state", args.save_state)
    if args.load_state:
        check_input_file("--load-state", args.load_state)
    params = sampling_params(args)
    llm = load(args, n_seq_max=max(args.parallel, 1))
    if args.prompts_file is not None:
        return _generate_batch(llm, prompts, params)
    return _generate_one(llm, prompts[0], params, args)


def _generate_one(llm: LLM, prompt: str, params: SamplingParams, args: argparse.Namespace) -> int:
    engine = llm.engine
    started = time.perf_counter()
    # a session keeps the sequence (and its state) after the request, for --save-state
    session = open_session(engine, args.load_state) if (args.load_state or args.save_state) else None
    if args.load_state and session is not None:
        sys.stderr.write(f"[restored {len(session.tokens)} tokens from {args.load_state}]\n")
    rid = engine.add_request(prompt, params, session=session)
    if not args.load_state:
        write_out(prompt)
    with Interrupt(second_raises=True, terminate=True) as stop:
        streamed = stream_request(engine, rid, write_out, stop)
    write_out("\n")
    note_context_full(streamed, params.max_tokens)
    if args.save_state and session is not None:
        size = save_state(engine, session, args.save_state)
        sys.stderr.write(
            f"[saved {len(session.tokens)} tokens of state to {args.save_state}, {size} bytes]\n"
        )
    report_speed(engine, time.perf_counter() - started)
    return stop.exit_code if streamed.interrupted else 0


def _generate_batch(llm: LLM, prompts: list[str], params: SamplingParams) -> int:
    engine = llm.engine
    started = time.perf_counter()
    # prompt k samples with seed + k, as the k-th of n completions does: similar prompts part ways
    seeded = [
        params if params.seed is None else dataclasses.replace(params, seed=params.seed + k)
        for k in range(len(prompts))
    ]
    ids = engine.add_requests(prompts, seeded)
    latest: dict[str, RequestOutput] = {}
    with Interrupt(second_raises=True, terminate=True) as stop:
        while engine.has_unfinished and not stop.requested:
            for out in engine.step():
                latest[out.request_id] = out
    for rid in ids:
        engine.abort(rid)  # after Ctrl-C; a no-op for finished requests
    failed = []
    for k, rid in enumerate(ids):
        report = latest.get(rid)
        sys.stdout.write(f"--- prompt {k + 1} ---\n{prompts[k]}{report.text if report else ''}\n")
        if report is not None and report.outputs[0].finish_reason == "error":
            failed.append(f"prompt {k + 1}: {report.error or report.outputs[0].error}")
    sys.stdout.flush()
    report_speed(engine, time.perf_counter() - started)
    if failed:
        raise RsmemError("generation failed: " + "; ".join(failed))
    return stop.exit_code if stop.requested else 0
