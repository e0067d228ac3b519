"""``rsmem serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rsmem.cli.model import add_model_options, load, model_path


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
        "--no-prompt-cache", action="store_true", help="free a slot's state when a request ends"
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


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not args.shutdown_timeout >= 0:  # NaN too
        parser.error(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from rsmem.engine import Engine
    from rsmem.server import ChatTemplate, EngineRunner, ServerSettings, create_app, load_chat_template

    llm = load(args, n_seq_max=args.parallel)
    path = model_path(args.model)
    slot_dir = Path(args.slot_save_path) if args.slot_save_path else None
    if slot_dir is not None:
        slot_dir.mkdir(parents=True, exist_ok=True)
    tok = llm.tokenizer
    template = ChatTemplate(
        load_chat_template(path),
        bos_token=tok.token_text(tok.bos_token_id) if tok and tok.bos_token_id is not None else "",
        eos_token=tok.token_text(tok.eos_token_id) if tok and tok.eos_token_id is not None else "",
    )
    engine = Engine(llm.context, llm.tokenizer, prompt_cache=not args.no_prompt_cache)
    settings = ServerSettings(
        model_name=args.alias or path.stem,
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
