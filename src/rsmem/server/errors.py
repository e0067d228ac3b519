"""Every error the server answers is OpenAI's error object::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

This module builds those objects and installs the handlers that turn every exception FastAPI or
Starlette raises (404, 405, body parse errors, validation errors, anything unexpected) into one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rsmem.errors import InvalidRequestError
from rsmem.server.schemas import INVALID_TEXT

log = logging.getLogger("rsmem.server")

INVALID = "invalid_request_error"
SERVER = "server_error"

# engine field names (SamplingParams / add_request) -> the JSON field a client sends
JSON_FIELDS = {"repetition_penalty": "repeat_penalty", "slot": "id_slot"}
# a refusal naming one of these server limits also names the flag that sets it
LIMIT_FLAGS = {"prompt": "--max-prompt-tokens", "max_tokens": "--max-tokens-limit"}


class ApiError(Exception):
    """An error answer: status, OpenAI error fields, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, kind: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, kind: str = INVALID, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return ApiError(status, message, kind=kind, param=param, code=code).response()


def invalid_request(exc: InvalidRequestError) -> ApiError:
    """A request the engine refused: 400 naming the JSON field (and the server flag of a limit)."""
    param = JSON_FIELDS.get(exc.param or "", exc.param)
    message = exc.named(param) if param else exc.detail
    flag = LIMIT_FLAGS.get(exc.param or "")
    if flag and "limit" in exc.detail:
        message += f" ({flag})"
    return ApiError(400, message, param=param)


def failed_generation(message: str, kind: str | None) -> ApiError:
    """A request that failed while generating: 400 when its own parameters or state were at fault
    (``error_kind`` "request"), 500 when the model failed (``error_kind`` "model")."""
    if kind == "request":
        return ApiError(400, message, kind=INVALID, code="generation_failed")
    return ApiError(500, message, kind=SERVER, code="generation_failed")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(InvalidRequestError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return invalid_request(exc).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        message, code = f"no such endpoint: {method} {path}", "not_found"
    elif exc.status_code == 405:
        message, code = f"method {method} is not allowed on {path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    kind = SERVER if exc.status_code >= 500 else INVALID
    body = error_body(message, kind, None, code)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Body, query and path validation: 400 naming the first bad field (OpenAI answers 400, not 422)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":
        return error_response(400, f"invalid JSON body: {err.get('msg')}")
    if err.get("type") == INVALID_TEXT:  # a model-level check: its path is in the error's context
        return error_response(400, str(err.get("msg")), param=str(err.get("ctx", {}).get("path")))
    loc = json_path(p for p in err.get("loc", ()) if p not in ("body", "query", "path"))
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return error_response(400, f"{loc or 'body'}: {err.get('msg')}{more}", param=loc or None)


def json_path(parts: Iterable[object]) -> str:
    """A pydantic location as a JSON path: ``messages[0].role``."""
    path = ""
    for p in parts:
        path += f"[{p}]" if isinstance(p, int) else f".{p}" if path else str(p)
    return path


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: one log line with the traceback on the server, no traceback to the client."""
    log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal server error ({type(exc).__name__})", kind=SERVER)
