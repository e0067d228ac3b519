"""The OpenAI-compatible HTTP server: completions, chat, models, health, metrics and slots."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rsmem.engine import RequestOutput, SamplingParams, TokenLogprobs
from rsmem.errors import RsmemError
from rsmem.server.chat import ChatTemplate
from rsmem.server.runner import EngineRunner, QueueFullError
from rsmem.server.schemas import ChatRequest, CompletionRequest, SlotAction

SAFE_FILENAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass(slots=True)
class ServerSettings:
    model_name: str = "rsmem"
    api_key: str | None = None
    slot_save_path: Path | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 4096
    default_chat_max_tokens: int = 256
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error JSON."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyLimitMiddleware:
    """Rejects request bodies above ``limit`` bytes (declared or streamed) with a 400 naming the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body exceeds the limit of {self.limit} bytes (--max-body-bytes)"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(400, message, param="body")(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise ApiError(400, message, param="body")
            return msg

        await self.app(scope, limited, send)


def create_app(runner: EngineRunner, settings: ServerSettings) -> FastAPI:
    engine = runner.engine
    tokenizer = engine.tokenizer
    counts: Counter[tuple[str, int]] = Counter()
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not runner._thread.is_alive():
            runner.start()
        yield

    app = FastAPI(title="rsmem", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        path = request.url.path
        authorized = request.headers.get("authorization", "") == f"Bearer {settings.api_key}"
        if settings.api_key and path != "/health" and not authorized:
            counts[(path, 401)] += 1
            return error_response(
                401, "invalid or missing API key (Authorization: Bearer ...)", kind="authentication_error"
            )
        try:
            response = await call_next(request)
        except ApiError as exc:
            response = error_response(exc.status, exc.message, exc.kind, exc.param, exc.headers)
        counts[(path, response.status_code)] += 1
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {err.get('msg')}")
        return error_response(400, f"{loc or 'body'}: {err.get('msg')}", param=loc or None)

    # ------------------------------------------------------------- helpers

    def sampling(body, max_tokens: int | None, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        max_tokens = max_tokens or settings.default_chat_max_tokens
        if max_tokens > settings.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens {max_tokens} exceeds the server limit of {settings.max_tokens_limit}"
                " (--max-tokens-limit)",
                param="max_tokens",
            )
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        for token in bias:
            if not 0 <= token < engine.ctx.n_vocab:
                raise ApiError(
                    400,
                    f"logit_bias token {token} is outside the vocabulary [0, {engine.ctx.n_vocab})",
                    param="logit_bias",
                )
        try:
            return SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                repetition_penalty=body.repeat_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=bias or None,
                seed=body.seed,
                max_tokens=max_tokens,
                stop=tuple(body.stop or ()) + extra_stop,
                n=body.n,
                logprobs=logprobs_count(body),
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    def logprobs_count(body) -> int | None:
        if isinstance(body, ChatRequest):
            return (body.top_logprobs or 0) if body.logprobs else None
        return body.logprobs

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids")
            tokens = tokenizer.encode(prompt)
            if not tokens and tokenizer.bos_token_id is not None:
                tokens = [tokenizer.bos_token_id]
        else:
            tokens = list(prompt)
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        for i, t in enumerate(tokens):
            if not 0 <= t < engine.ctx.n_vocab:
                raise ApiError(
                    400, f"prompt token {i}: id {t} is outside [0, {engine.ctx.n_vocab})", param="prompt"
                )
        if len(tokens) > settings.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(tokens)} tokens, more than the limit of "
                f"{settings.max_prompt_tokens} (--max-prompt-tokens)",
                param="prompt",
            )
        return tokens

    def slot_of(body) -> int | None:
        if body.id_slot is None or body.id_slot < 0:
            return None
        if body.id_slot >= engine.ctx.n_seq_max:
            raise ApiError(
                400,
                f"id_slot {body.id_slot} does not exist (slots 0 to {engine.ctx.n_seq_max - 1})",
                param="id_slot",
            )
        return body.id_slot

    async def submit(tokens: list[int], params: SamplingParams, slot: int | None):
        if runner.error is not None:
            raise ApiError(500, f"the engine failed: {runner.error}", kind="server_error")
        try:
            return await runner.submit(tokens, params, slot=slot)
        except QueueFullError as exc:
            raise ApiError(
                503, f"server busy: {exc}; retry later", kind="server_error", headers={"Retry-After": "1"}
            ) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    async def collect(request: Request, rid: str, reports: asyncio.Queue[RequestOutput]) -> RequestOutput:
        """Wait for the final report; a client that goes away cancels its request."""
        while True:
            try:
                out = await asyncio.wait_for(reports.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    await runner.abort(rid)
                    raise ApiError(499, "client disconnected") from None
                continue
            if out.finished:
                return out

    def token_str(token: int) -> str:
        return tokenizer.token_text(token) if tokenizer else str(token)

    def completion_logprobs(lps: tuple[TokenLogprobs, ...] | None) -> dict | None:
        if lps is None:
            return None
        offset, offsets = 0, []
        for lp in lps:
            offsets.append(offset)
            offset += len(token_str(lp.token))
        return {
            "tokens": [token_str(lp.token) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_str(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(lps: tuple[TokenLogprobs, ...] | None) -> dict | None:
        if lps is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            s = token_str(token)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

        return {
            "content": [
                entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
            ]
        }

    def usage(prompt_tokens: int, outs: list[RequestOutput]) -> dict:
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }

    def sse(obj: dict | str) -> bytes:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()

    async def stream(
        request: Request, rid: str, reports: asyncio.Queue[RequestOutput], chunk
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            while True:
                out = await reports.get()
                for c in out.outputs:
                    if c.delta_text or c.finish_reason is not None:
                        yield sse(chunk(c))
                if out.finished:
                    finished = True
                    yield sse("[DONE]")
                    return
        finally:
            if not finished:
                runner.abort_nowait(rid)

    # ------------------------------------------------------------- routes

    @app.get("/health")
    async def health() -> dict:
        busy = await runner.call(lambda: sum(1 for s in engine.slots() if s["busy"]))
        return {"status": "ok", "slots_idle": engine.ctx.n_seq_max - busy, "slots_processing": busy}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {"id": settings.model_name, "object": "model", "created": int(started), "owned_by": "rsmem"}
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = (
            body.prompt
            if isinstance(body.prompt, list) and isinstance(body.prompt[0], str)
            else [body.prompt]
        )
        params = sampling(body, body.max_tokens)
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "stream supports one prompt per request", param="prompt")
        token_lists = [encode(p) for p in prompts]  # all checked before any is queued
        created, slot = int(time.time()), slot_of(body)
        if body.stream:
            rid, reports = await submit(token_lists[0], params, slot)

            def chunk(c) -> dict:
                return {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": settings.model_name,
                    "choices": [
                        {
                            "index": c.index,
                            "text": c.delta_text,
                            "logprobs": None,
                            "finish_reason": c.finish_reason.value if c.finish_reason else None,
                        }
                    ],
                }

            return StreamingResponse(stream(request, rid, reports, chunk), media_type="text/event-stream")
        outs = []
        for tokens in token_lists:
            rid, reports = await submit(tokens, params, slot)
            outs.append(await collect(request, rid, reports))
        choices = []
        for k, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            echo = (
                (prompt if isinstance(prompt, str) else tokenizer.decode(prompt) if tokenizer else "")
                if body.echo
                else ""
            )
            for c in out.outputs:
                choice = {
                    "index": k * body.n + c.index,
                    "text": echo + c.text,
                    "logprobs": completion_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason.value if c.finish_reason else None,
                }
                if body.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        return JSONResponse(
            {
                "id": outs[0].request_id,
                "object": "text_completion",
                "created": created,
                "model": settings.model_name,
                "choices": choices,
                "usage": usage(sum(map(len, token_lists)), outs),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        template = settings.chat_template
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        try:
            prompt = template.render(messages)
        except Exception as exc:
            raise ApiError(400, f"the chat template failed: {exc}") from exc
        params = sampling(body, body.max_completion_tokens or body.max_tokens, template.stop)
        tokens = encode(prompt)
        rid, reports = await submit(tokens, params, slot_of(body))
        created = int(time.time())
        if body.stream:
            sent_role: set[int] = set()

            def chunk(c) -> dict:
                delta: dict[str, str] = {}
                if c.index not in sent_role:
                    sent_role.add(c.index)
                    delta["role"] = "assistant"
                if c.delta_text:
                    delta["content"] = c.delta_text
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": settings.model_name,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": c.finish_reason.value if c.finish_reason else None,
                        }
                    ],
                }

            return StreamingResponse(stream(request, rid, reports, chunk), media_type="text/event-stream")
        out = await collect(request, rid, reports)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason.value if c.finish_reason else None,
            }
            for c in out.outputs
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": settings.model_name,
                "choices": choices,
                "usage": usage(len(tokens), [out]),
            }
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        def snapshot() -> dict[str, float]:
            s = engine.stats
            return {
                "prompt": s.prompt_tokens,
                "cached": s.cached_prompt_tokens,
                "generated": s.generated_tokens,
                "seconds": s.decode_seconds,
                "steps": s.steps,
                "queue": len(engine.waiting),
                "running": len(engine.running),
                "active": engine.active_cells(),
                "used": engine.ctx.memory.used,
                "size": engine.ctx.memory.size,
                "finished": s.requests_finished,
            }

        m = await runner.call(snapshot)
        lines = [
            "# HELP rsmem_requests_total HTTP requests by path and status code.",
            "# TYPE rsmem_requests_total counter",
            *(f'rsmem_requests_total{{path="{p}",code="{c}"}} {n}' for (p, c), n in sorted(counts.items())),
            _metric(
                "rsmem_prompt_tokens_total", "counter", "Prompt tokens processed by the model.", m["prompt"]
            ),
            _metric(
                "rsmem_prompt_tokens_cached_total",
                "counter",
                "Prompt tokens skipped because a cached state covered them.",
                m["cached"],
            ),
            _metric("rsmem_generation_tokens_total", "counter", "Tokens generated.", m["generated"]),
            _metric(
                "rsmem_decode_seconds_total", "counter", "Seconds spent in model decode steps.", m["seconds"]
            ),
            _metric(
                "rsmem_tokens_per_second",
                "gauge",
                "Tokens processed per second of decode time.",
                (m["prompt"] + m["generated"]) / m["seconds"] if m["seconds"] else 0.0,
            ),
            _metric(
                "rsmem_requests_finished_total", "counter", "Requests finished (any reason).", m["finished"]
            ),
            _metric("rsmem_queue_length", "gauge", "Requests waiting for a slot.", m["queue"]),
            _metric("rsmem_requests_running", "gauge", "Requests holding slots.", m["running"]),
            _metric(
                "rsmem_memory_cells_active", "gauge", "Memory cells held by running requests.", m["active"]
            ),
            _metric(
                "rsmem_memory_cells_used", "gauge", "Memory cells in use, prompt cache included.", m["used"]
            ),
            _metric("rsmem_memory_cells_total", "gauge", "Memory cells (= parallel slots).", m["size"]),
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/slots")
    async def slots() -> list[dict]:
        return await runner.call(engine.slots)

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, action: str, request: Request) -> dict:
        if not 0 <= slot_id < engine.ctx.n_seq_max:
            raise ApiError(400, f"slot {slot_id} does not exist (slots 0 to {engine.ctx.n_seq_max - 1})")
        if action == "erase":
            t0 = time.perf_counter()
            n = await _slot_call(lambda: engine.slot_erase(slot_id))
            return {
                "id_slot": slot_id,
                "n_erased": n,
                "timings": {"erase_ms": (time.perf_counter() - t0) * 1e3},
            }
        if action not in ("save", "restore"):
            raise ApiError(400, f"unknown action {action!r}: use save, restore or erase", param="action")
        if settings.slot_save_path is None:
            raise ApiError(400, "slot save/restore is disabled: start the server with --slot-save-path")
        raw = await request.body()
        try:
            filename = SlotAction.model_validate_json(raw or b"{}").filename
        except ValueError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from exc
        if not filename or not SAFE_FILENAME.match(filename) or ".." in filename:
            raise ApiError(
                400,
                f"invalid filename {filename!r}: use letters, digits, '_', '-' and '.', "
                "no path separators or '..'",
                param="filename",
            )
        path = settings.slot_save_path / filename
        t0 = time.perf_counter()
        if action == "save":
            n_tokens, n_bytes = await _slot_call(lambda: engine.slot_save(slot_id, str(path)))
            return {
                "id_slot": slot_id,
                "filename": filename,
                "n_saved": n_tokens,
                "n_written": n_bytes,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
            }
        if not path.is_file():
            raise ApiError(400, f"no saved slot file {filename!r}", param="filename")
        n_tokens = await _slot_call(lambda: engine.slot_restore(slot_id, str(path)))
        return {
            "id_slot": slot_id,
            "filename": filename,
            "n_restored": n_tokens,
            "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3},
        }

    async def _slot_call(fn):
        try:
            return await runner.call(fn)
        except RuntimeError as exc:  # busy slot
            raise ApiError(409, str(exc)) from exc
        except (RsmemError, ValueError, OSError) as exc:
            raise ApiError(400, str(exc)) from exc

    return app


def _metric(name: str, kind: str, help_text: str, value: float) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} {value}"
