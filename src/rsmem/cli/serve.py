"""``rsmem serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from rsmem import settings
from rsmem.cli.model import add_model_options, load, model_path, prepare_kernels
from rsmem.startup import interrupt_exits


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "-np", "--parallel", type=int, default=8, help="slots: sequences decoded together (default 8)"
    )
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (all but /health)")
    serve.add_argument("--slot-save-path", help="folder for POST /slots/{id}?action=save|restore")
    serve.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--max-prompt-tokens", type=int, default=4096)
    serve.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted")
    serve.add_argument("--alias", help="model name reported by /v1/models")
    serve.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="free a slot's state when a request ends, and keep no checkpoints",
    )
    serve.add_argument(
        "--cache-ram",
        type=int,
        default=1024,
        metavar="MIB",
        help="MiB of checkpoints in the prefix cache shared by all slots (default 1024; 0: none)",
    )
    serve.add_argument(
        "--checkpoint-interval",
        type=int,
        default=256,
        metavar="N",
        help="also checkpoint every N tokens of a long prompt (default 256; 0: off)",
    )
    serve.add_argument(
        "--checkpoint-codec",
        choices=["exact", "bf16", "int8"],
        default="exact",
        help="how checkpoints are stored: exact (the state's dtype), bf16 or int8 (default exact)",
    )
    serve.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="also keep the prefix cache's checkpoints in DIR, so they outlive a restart (read lazily)",
    )
    serve.add_argument(
        "--cache-disk",
        type=int,
        default=4096,
        metavar="MIB",
        help="MiB of checkpoint files in --cache-dir, at least 1 (default 4096); past it the least "
        "valuable go",
    )
    serve.add_argument(
        "--prefill-cap",
        type=_cap,
        default=None,
        metavar="N|auto",
        help="most prompt tokens one prompt gets in a step while other requests run, so a long prompt "
        "does not hold up short ones and decodes (default auto: learnt from step costs, and a lone "
        "prompt's steps at most 4x that; 0: no cap)",
    )
    serve.add_argument(
        "--rollback-depth",
        type=int,
        default=0,
        metavar="N",
        help="keep what rolls each sequence back by up to N tokens (llama.cpp's n_rs_seq), so a prompt "
        "parting from a slot's kept tokens at most N before their end reuses it (default 0: off)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser requests from ORIGIN (repeatable; '*' for any; default: none)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on shutdown, time in-flight requests get to finish before they are cancelled (default 5)",
    )
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(func=cmd_serve, check=lambda args: _check(args, serve))


def _cap(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of tokens or 'auto'") from None


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not args.shutdown_timeout >= 0:  # NaN too
        parser.error(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    if args.cache_disk < 1:  # 0 MiB would keep no file, and delete those --cache-dir holds
        parser.error(
            f"--cache-disk must be at least 1 (MiB), got {args.cache_disk}: it bounds the files of "
            "--cache-dir (to keep no checkpoints on disk, leave --cache-dir out)"
        )
    if args.alias is not None and not args.alias.strip():
        parser.error(f"--alias must name the model (the name /v1/models reports), got {args.alias!r}")


def cmd_serve(args: argparse.Namespace) -> int:
    """Bind first (a busy or bad address is one error line before the model loads), then serve until
    SIGINT/SIGTERM, which finish or cancel in-flight work within --shutdown-timeout and exit 0."""
    from rsmem.server import ServeOptions, bind_socket, run_server

    if args.compile is None:  # a server runs for long: compiled decode steps pay for their seconds
        args.compile = settings.compile_setting(default="1")
    options = ServeOptions.from_args(args, model_path=model_path(args.model))
    options.check()
    sock = bind_socket(options.host, options.port)
    try:
        with interrupt_exits():  # Ctrl-C exits with 130 at once: nothing is served yet
            llm = load(args, n_seq_max=args.parallel)
            prepare_kernels(llm.model)
    except BaseException:
        sock.close()
        raise
    return run_server(llm, options, sock=sock)
