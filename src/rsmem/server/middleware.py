"""ASGI middleware (plain ASGI, so a route can still see the client's ``http.disconnect``).

Outermost first: CORS (only with ``--cors-origin``), metrics, the shutdown gate, the API key, the body
limit. Each answers its own errors with OpenAI's error object.
"""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rsmem.server.errors import INVALID, SERVER, error_body, error_response
from rsmem.server.state import AppState

UNMATCHED = "other"  # the metrics label of every path that no route matches
CLIENT_GONE = 499  # the status counted for a request whose client left before its answer was complete


def route_label(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The template of the route a request goes to (``/slots/{slot_id}``), never the raw path: a path
    no route matches is ``other``, so clients cannot grow the metrics without bound."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        path = getattr(route, "path", None)
        if match is Match.FULL and path:
            return str(path)
        if match is Match.PARTIAL and partial is None and path:
            partial = str(path)  # the path exists, not with this method (405)
    return partial or UNMATCHED


class MetricsMiddleware:
    """Counts every answer by route template and status code (what ``/metrics`` reports).

    A request whose client went away before its answer was complete counts as 499, whether the answer
    had not started (a JSON answer: the route answers 499 itself) or was streaming (the 200 was sent
    with the stream's first event, then the stream was cut)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute], counts: Counter[tuple[str, int]]) -> None:
        self.app, self.routes, self.counts = app, routes, counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = route_label(self.routes, scope)
        status = 500  # what the client sees if the app raises before answering
        complete = gone = False

        async def watching_receive() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def counting_send(message: Message) -> None:
            nonlocal status, complete, gone
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            try:
                await send(message)
            except OSError:  # a server that reports the client's leaving on send (ASGI 2.4)
                gone = True
                raise

        try:
            await self.app(scope, watching_receive, counting_send)
        finally:
            self.counts[(label, CLIENT_GONE if gone and not complete else status)] += 1


class GateMiddleware:
    """Once a graceful shutdown began, new requests get 503 (the ones in flight go on)."""

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.state.accepting:
            body = error_body("the server is shutting down", SERVER, None, "shutting_down")
            response = JSONResponse(body, status_code=503, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class AuthMiddleware:
    """``Authorization: Bearer KEY`` (the scheme in any case) on every path but ``/health``; CORS
    preflights (OPTIONS) never need it, browsers send them without credentials."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or self.key is None
            or scope["method"] == "OPTIONS"
            or scope["path"] == "/health"
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        message = "invalid or missing API key (send 'Authorization: Bearer KEY')"
        response = error_response(401, message, "authentication_error", None, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body first; past ``limit`` bytes (declared or sent) the answer is 413.

    The route then reads the buffered body, and after it the client's own channel, so it can still
    see ``http.disconnect``.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self) -> Response:
        message = f"the request body exceeds the limit of {self.limit} bytes (--max-body-bytes)"
        return error_response(413, message, INVALID, None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


class ErrorObjectCORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with a refused preflight answered by an OpenAI error object."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        message = bytes(response.body).decode(errors="replace")
        return JSONResponse(
            error_body(message, INVALID, None, "cors_refused"),
            status_code=response.status_code,
            headers=headers,
        )
