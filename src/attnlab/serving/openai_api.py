"""An OpenAI-compatible HTTP API over the engine (FastAPI; the ``serve`` extra).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer
has a chat template), both with ``stream: true`` as server-sent events; ``POST
/v1/embeddings`` (when an encoder is served, :mod:`attnlab.serving.embeddings`); ``GET
/v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Every field of a request is honoured or refused (:mod:`attnlab.serving.protocol`).
Errors are OpenAI error objects ``{"error": {"message", "type", "param", "code"}}``: 400
for a bad request (naming the field), 401 for a wrong API key, 404 for an unknown path or
model, 405 for a wrong method, 429 when the queue is full, 500 when a request failed
inside the engine (it alone; the engine goes on), 503 when the engine has stopped. A
client that disconnects aborts its request, which frees its KV blocks.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run
# time, and `Request` is imported inside build_app (FastAPI is an optional extra).

import time
from collections.abc import AsyncIterator
from typing import Any

from attnlab.serving.async_engine import AsyncEngine
from attnlab.serving.chat_handlers import ChatRoutes
from attnlab.serving.engine_client import EngineProcess
from attnlab.serving.protocol import APIError

__all__ = ["APIError", "build_app"]


class _BearerAuth:
    """``Authorization: Bearer KEY`` on ``/v1/``, as plain ASGI middleware.

    Not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` wraps ``receive``,
    and behind it ``request.is_disconnected()`` never saw a client leave, so a
    non-streaming request whose client hung up generated all its tokens.
    """

    def __init__(self, app: Any, *, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if given != self.expected:
                from fastapi.responses import JSONResponse

                err = APIError(401, "invalid API key", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncEngine | EngineProcess | None,
    *,
    model_name: str,
    api_key: str | None = None,
    default_chat_max_tokens: int | None = None,
    embeddings: Any = None,
) -> Any:
    """The FastAPI application serving ``engine`` under the name ``model_name``.

    Args:
        engine: the engine in a thread of this process (:class:`AsyncEngine`) or in its
            own process (:class:`~attnlab.serving.engine_client.EngineProcess`), started
            and stopped with the app; or None for a server of embeddings only.
        model_name: the model id clients pass as ``model``.
        api_key: when set, ``Authorization: Bearer <api_key>`` is required on ``/v1/``.
        default_chat_max_tokens: ``max_tokens`` of a chat request that gives none
            (default: the rest of the context).
        embeddings: an :class:`~attnlab.serving.embeddings.EmbeddingService` to serve
            ``POST /v1/embeddings`` (its model id is listed beside ``model_name``).

    Raises:
        ImportError: FastAPI is missing (install the ``serve`` extra).
    """
    try:
        from contextlib import asynccontextmanager

        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response
        from starlette.exceptions import HTTPException
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]'"
        ) from e

    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if engine is not None:
            engine.start()
        if embeddings is not None:
            embeddings.start()
        try:
            yield
        finally:
            if engine is not None:
                engine.shutdown()
            if embeddings is not None:
                embeddings.shutdown()

    app = FastAPI(title="attnlab", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        what = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed"}
        err = APIError(exc.status_code, what.get(exc.status_code, str(exc.detail)))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        err = APIError(422, f"the request is not valid: {exc.errors()}")
        return JSONResponse(err.body(), status_code=422)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "attnlab"}

    names = ([model_name] if engine is not None else []) + (
        [embeddings.model_name] if embeddings is not None else []
    )

    @app.get("/health")
    async def health() -> Response:
        if engine is not None and not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in names:
            raise APIError(
                404, f"unknown model {model_id!r}", param="model", code="model_not_found"
            )
        return card(model_id)

    if engine is not None:
        _generation_routes(app, engine, model_name, default_chat_max_tokens)
    if embeddings is not None:
        embeddings.add_routes(app)
    return app


def _generation_routes(
    app: Any,
    engine: AsyncEngine | EngineProcess,
    model_name: str,
    default_chat_max_tokens: int | None,
) -> None:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/metrics`` of the engine."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse, Response

    routes = ChatRoutes(engine, model_name, default_chat_max_tokens)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await engine.metrics_text()
        except RuntimeError as e:
            raise APIError(503, f"the engine has stopped: {e}", code="engine_stopped") from None
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routes.completions(request)  # type: ignore[no-any-return]

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await routes.chat(request)  # type: ignore[no-any-return]
