"""The ``rsmem`` command line: generate, chat, info, convert, bench, demo.

Every failure the user can cause (a missing model file, a bad option value, a corrupt state file)
ends with one ``rsmem: error: ...`` line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from rsmem.errors import RsmemError

PROGRESS_MIN_TOKENS = 256  # show prefill progress for prompts at least this long


# ------------------------------------------------------------------ shared


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file or Hugging Face folder (default: the embedded model)")
    p.add_argument("-t", "--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--bf16", action="store_true", help="keep weight matrices in bfloat16")
    p.add_argument(
        "--compile",
        choices=["auto", "1", "0"],
        default=None,
        help="decode steps through torch.compile: auto (models of 16M+ matrix weights), 1 or 0 "
        "(default: $RSMEM_COMPILE, else auto)",
    )


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.1, help="repetition penalty (default 1.1)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace, **overrides):
    from rsmem.engine import SamplingParams

    fields = dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    fields.update(overrides)
    return SamplingParams(**fields)


def _model_path(model: str | None) -> Path:
    """The model named on the command line, or the embedded one; it must exist."""
    from rsmem.engine import default_model_path

    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise RsmemError(f"model not found: {path}")
    return path


def _load(args: argparse.Namespace, n_seq_max: int):
    from rsmem.engine import LLM

    path = _model_path(args.model)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    llm = LLM(
        path, n_seq_max=n_seq_max, n_batch=512, dtype=dtype, n_threads=args.threads, compile=args.compile
    )
    if llm.tokenizer is None:
        raise RsmemError(f"{path} has no tokenizer: text generation needs one")
    if getattr(llm.model, "compile_decode", False):  # say so, and pay it now rather than mid-generation
        sys.stderr.write("[compiling decode steps (torch.compile; cached for later runs)...]\n")
        sys.stderr.write(f"[compiled in {llm.model.warm_up():.1f} s]\n")
    return llm


class Progress:
    """One self-overwriting status line on stderr (only when stderr is a terminal, or forced)."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool | None = None) -> None:
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self._shown = False

    def update(self, text: str) -> None:
        if self.enabled:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()
            self._shown = True

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False


def _report_speed(engine, started: float, stream: TextIO = sys.stderr) -> None:
    s = engine.stats
    wall = time.perf_counter() - started
    stream.write(
        f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated in {wall:.2f}s: "
        f"{s.generated_tokens / wall if wall else 0:.1f} tok/s generated, "
        f"{(s.prompt_tokens + s.generated_tokens) / wall if wall else 0:.1f} tok/s total]\n"
    )


def _run_with_progress(engine, request_id: str, progress: Progress, on_text) -> object:
    """Step the engine until ``request_id`` finishes; show prefill progress; stream its text."""
    final = None
    while final is None:
        req = engine.requests.get(request_id)
        if (
            req is not None
            and len(req.prompt_tokens) >= PROGRESS_MIN_TOKENS
            and req.n_prefilled < len(req.prompt_tokens)
        ):
            progress.update(f"prefill {req.n_prefilled}/{len(req.prompt_tokens)} tokens")
        for out in engine.step():
            if out.request_id != request_id:
                continue
            progress.done()
            on_text(out.outputs[0].delta_text)
            if out.finished:
                final = out
    return final


# ---------------------------------------------------------------- commands


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    llm = _load(args, n_seq_max=max(args.parallel, 1))
    engine = llm.engine
    started = time.perf_counter()
    if len(prompts) > 1:
        if args.save_state or args.load_state:
            raise RsmemError("--save-state/--load-state work with a single prompt")
        ids = [engine.add_request(p, _sampling_params(args)) for p in prompts]
        final = {o.request_id: o for o in engine.run_until_done() if o.finished}
        for k, rid in enumerate(ids):
            sys.stdout.write(f"--- prompt {k + 1} ---\n{prompts[k]}{final[rid].text}\n")
        _report_speed(engine, started)
        return 0

    # a session keeps the sequence (and its state) after the request, for --save-state
    session = engine.open_session(args.load_state) if (args.load_state or args.save_state) else None
    if args.load_state:
        sys.stderr.write(f"[restored {len(session.tokens)} tokens from {args.load_state}]\n")
    rid = engine.add_request(prompts[0], _sampling_params(args), session=session)
    if not args.load_state:
        sys.stdout.write(prompts[0])

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    _run_with_progress(engine, rid, Progress(), emit)
    sys.stdout.write("\n")
    if args.save_state and session is not None:
        size = engine.save_session(session, args.save_state)
        sys.stderr.write(
            f"[saved {len(session.tokens)} tokens of state to {args.save_state}, {size} bytes]\n"
        )
    _report_speed(engine, started)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file:
        text = Path(args.prompts_file).read_text(encoding="utf-8")
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise RsmemError(f"{args.prompts_file} holds no prompts")
        return prompts
    if args.prompt is not None:
        return [args.prompt]
    if not sys.stdin.isatty():
        return [sys.stdin.read()]
    raise RsmemError("no prompt: give one as an argument, on stdin, or with --prompts-file")


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive continuation: each line you type is appended to one running state."""
    llm = _load(args, n_seq_max=1)
    engine = llm.engine
    session = engine.open_session(args.load_state) if args.load_state else engine.open_session()
    interactive = sys.stdin.isatty()
    stops = tuple(args.stop) or ("\n\n",)
    params = _sampling_params(args, stop=stops)
    if interactive:
        sys.stderr.write("rsmem chat: type a line, Enter to send, Ctrl-D to quit\n")
    started = time.perf_counter()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        rid = engine.add_request(line.rstrip("\n") + "\n", params, session=session)
        _run_with_progress(engine, rid, Progress(), lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        sys.stdout.write("\n")
        sys.stdout.flush()
    if args.save_state:
        engine.save_session(session, args.save_state)
        sys.stderr.write(f"[saved the conversation ({len(session.tokens)} tokens) to {args.save_state}]\n")
    _report_speed(engine, started)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from rsmem.engine import load_text_model

    path = _model_path(args.model)
    model, tokenizer = load_text_model(path)
    cfg = model.config
    tensors = [model.embedding, model.norm_f] + [getattr(ly, f) for ly in model.layers for f in ly.__slots__]
    if model.lm_head.data_ptr() != model.embedding.data_ptr():  # untied head
        tensors.append(model.lm_head)
    n_params = sum(t.numel() for t in tensors)
    n_attn = sum(1 for il in range(model.n_layer) if not model.is_recurrent_layer(il))
    state = 4 * (model.n_embd_r + model.n_embd_s) * (model.n_layer - n_attn)
    print(
        f"file:            {path} ({path.stat().st_size / 1e6:.1f} MB)"
        if path.is_file()
        else f"folder: {path}"
    )
    print(f"architecture:    {model.arch}")
    for key in (
        "d_model",
        "n_layer",
        "n_vocab",
        "d_inner",
        "d_state",
        "d_conv",
        "dt_rank",
        "n_head",
        "n_group",
    ):
        if hasattr(cfg, key):
            print(f"{key + ':':<16} {getattr(cfg, key)}")
    print(f"parameters:      {n_params / 1e6:.2f} M")
    print(f"state per layer: r {model.n_embd_r} + s {model.n_embd_s} floats")
    print(f"state per seq:   {state} bytes ({state / 1024:.1f} KiB, f32)")
    how = "torch.compile" if getattr(model, "compile_decode", False) else "eager"
    print(f"decode steps:    {how} (RSMEM_COMPILE / --compile of generate, chat, serve)")
    if tokenizer is not None:
        print(
            f"tokenizer:       {tokenizer.tokenizer.get_vocab_size()} tokens, bos {tokenizer.bos_token_id}, "
            f"eos {tokenizer.eos_token_id}"
        )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from rsmem.loaders import convert_hf_to_gguf

    src = Path(args.hf_dir)
    if not (src / "config.json").is_file():
        raise RsmemError(f"{src} is not a Hugging Face model folder (no config.json)")
    t0 = time.perf_counter()
    sys.stderr.write(f"converting {src} -> {args.out} ({args.outtype})...\n")
    convert_hf_to_gguf(src, args.out, outtype=args.outtype)
    size = Path(args.out).stat().st_size
    sys.stderr.write(f"wrote {args.out}: {size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f}s\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rsmem.benchmark import format_table, measure
    from rsmem.engine import load_text_model
    from rsmem.models.random_init import mamba2_130m, mamba_130m

    if args.threads:
        torch.set_num_threads(args.threads)
    progress = Progress(enabled=True)
    parallel = tuple(args.parallel)
    results = []
    path = _model_path(args.model)
    model, _ = load_text_model(path)
    name = "default model" if not args.model else path.name
    results.append(
        measure(
            model,
            name,
            n_prompt=args.prompt_tokens,
            parallel=parallel,
            steps=args.steps,
            progress=progress.update,
        )
    )
    if not args.skip_130m:
        for label, build in (("mamba 130M (random)", mamba_130m), ("mamba2 130M (random)", mamba2_130m)):
            progress.update(f"building {label}")
            results.append(
                measure(
                    build(),
                    label,
                    n_prompt=args.prompt_tokens,
                    parallel=parallel,
                    steps=args.steps,
                    progress=progress.update,
                )
            )
    progress.done()
    print(f"threads: {torch.get_num_threads()}, f32")
    print(format_table(results))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from rsmem.engine import Engine
    from rsmem.server import ChatTemplate, EngineRunner, ServerSettings, create_app, load_chat_template

    llm = _load(args, n_seq_max=args.parallel)
    model_path = _model_path(args.model)
    slot_dir = Path(args.slot_save_path) if args.slot_save_path else None
    if slot_dir is not None:
        slot_dir.mkdir(parents=True, exist_ok=True)
    tok = llm.tokenizer
    template = ChatTemplate(
        load_chat_template(model_path),
        bos_token=tok.token_text(tok.bos_token_id) if tok and tok.bos_token_id is not None else "",
        eos_token=tok.token_text(tok.eos_token_id) if tok and tok.eos_token_id is not None else "",
    )
    engine = Engine(llm.context, llm.tokenizer, prompt_cache=not args.no_prompt_cache)
    settings = ServerSettings(
        model_name=args.alias or model_path.stem,
        api_key=args.api_key,
        slot_save_path=slot_dir,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        chat_template=template,
    )
    runner = EngineRunner(engine, max_queue=args.max_queue)
    app = create_app(runner, settings)
    sys.stderr.write(
        f"rsmem serve: {settings.model_name} on http://{args.host}:{args.port} with {args.parallel} slots"
        f"{' (chat template from the model)' if template.source else ''}\n"
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        runner.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Walk through the recurrent memory: parallel decode, fork, save and restore, on the toy model."""
    import tempfile

    from rsmem import Batch, Context
    from rsmem.models import DecayedSumModel

    model = DecayedSumModel(n_vocab=64, n_embd=8, n_layer=4)
    ctx = Context(model, n_seq_max=args.parallel)
    prompts = {s: [(7 * s + k) % 64 for k in range(3 + s)] for s in range(args.parallel)}
    ctx.decode(Batch.from_sequences(prompts))
    print(f"decoded {sum(map(len, prompts.values()))} prompt tokens of {len(prompts)} sequences in one batch")
    mem = ctx.memory
    print(
        f"memory: {mem.used} cells used of {mem.size}, {mem.state_bytes_per_seq()} state bytes per sequence"
    )
    if args.parallel > 1:
        mem.seq_rm(args.parallel - 1, -1, -1)
        mem.seq_cp(0, args.parallel - 1)
        print(f"forked sequence 0 into {args.parallel - 1} (shared cell, no copy): {mem.used} cells used")
    ctx.decode(Batch.from_sequences({s: [s % 64] for s in range(args.parallel)}))
    print(f"decoded one step of {args.parallel} sequences: {mem.used} cells used")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seq0.ggsq"
        size = ctx.state_seq_save_file(path, 0, prompts[0])
        tokens = ctx.state_seq_load_file(path, 0)
        print(f"saved sequence 0 to a llama.cpp-format file ({size} bytes), restored {len(tokens)} tokens")
    return 0


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rsmem", description="Recurrent language models on a recurrent memory"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (argument, stdin or file)")
    gen.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    _add_model_options(gen)
    _add_sampling_options(gen)
    gen.add_argument("-f", "--prompts-file", help="one prompt per line, generated in parallel")
    gen.add_argument("--parallel", type=int, default=4, help="sequences decoded together (default 4)")
    gen.add_argument("--save-state", metavar="FILE", help="save the final state + tokens (llama.cpp .ggsq)")
    gen.add_argument(
        "--load-state", metavar="FILE", help="continue from a saved state; the prompt is appended"
    )
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive: every line continues one carried state")
    _add_model_options(chat)
    _add_sampling_options(chat)
    chat.add_argument("--save-state", metavar="FILE", help="save the conversation when you quit")
    chat.add_argument("--load-state", metavar="FILE", help="resume a saved conversation")
    chat.set_defaults(func=cmd_chat)

    info = sub.add_parser("info", help="architecture, sizes and state bytes of a model")
    info.add_argument("model", nargs="?", help="GGUF file or HF folder (default: the embedded model)")
    info.set_defaults(func=cmd_info)

    conv = sub.add_parser("convert", help="convert a Hugging Face Mamba/Mamba-2 folder to GGUF")
    conv.add_argument("hf_dir")
    conv.add_argument("out")
    conv.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16")
    conv.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", help="tokens per second: default model and 130M configs")
    bench.add_argument("-m", "--model", help="model to measure (default: the embedded model)")
    bench.add_argument("-t", "--threads", type=int, default=2)
    bench.add_argument("--prompt-tokens", type=int, default=512)
    bench.add_argument("--parallel", type=int, nargs="+", default=[1, 8])
    bench.add_argument("--steps", type=int, default=16)
    bench.add_argument("--skip-130m", action="store_true", help="only the default (or -m) model")
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "--parallel", type=int, default=8, help="slots: sequences decoded together (default 8)"
    )
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (all but /health)")
    serve.add_argument("--slot-save-path", help="folder for POST /slots/{id}?action=save|restore")
    serve.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--max-prompt-tokens", type=int, default=4096)
    serve.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted")
    serve.add_argument("--alias", help="model name reported by /v1/models")
    serve.add_argument(
        "--no-prompt-cache", action="store_true", help="free a slot's state when a request ends"
    )
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="walk through the recurrent memory on a toy model")
    demo.add_argument("--parallel", type=int, default=4, help="number of sequences (default 4)")
    demo.set_defaults(func=cmd_demo)
    return parser


def _check_positive(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in (
        "parallel",
        "threads",
        "steps",
        "prompt_tokens",
        "max_queue",
        "max_body_bytes",
        "max_prompt_tokens",
        "max_tokens_limit",
    ):
        value = getattr(args, name, None)
        if isinstance(value, int) and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_positive(args, parser)
    try:
        return args.func(args)
    except (RsmemError, ValueError, OSError) as exc:
        sys.stderr.write(f"rsmem: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
