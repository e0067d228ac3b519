"""The OpenAI-compatible HTTP app: route modules over one :class:`~rsmem.server.state.AppState`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from rsmem.server import routes_admin, routes_openai
from rsmem.server.errors import install_error_handlers
from rsmem.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    ErrorObjectCORSMiddleware,
    GateMiddleware,
    MetricsMiddleware,
)
from rsmem.server.runner import EngineRunner
from rsmem.server.state import AppState, ServerSettings


def create_app(runner: EngineRunner, settings: ServerSettings) -> FastAPI:
    """The app; its lifespan starts the runner's engine thread and stops it at shutdown."""
    state = AppState(runner, settings, runner.engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="rsmem", version="0.1.0", lifespan=lifespan)
    app.state.rsmem = state
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)
    install_error_handlers(app)
    # add_middleware wraps: the last added runs first (outermost)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(GateMiddleware, state=state)
    # the routes whose templates label the metrics (included routers' own routes carry the paths)
    routes = [*app.router.routes, *routes_openai.router.routes, *routes_admin.router.routes]
    app.add_middleware(MetricsMiddleware, routes=routes, counts=state.counts)
    if settings.cors_origins:
        app.add_middleware(
            ErrorObjectCORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
