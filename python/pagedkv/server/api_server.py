"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

    pagedkv serve [MODEL] [--host 127.0.0.1] [--port 8000] [engine flags] [--served-model-name NAME]
                  [--api-key KEY]

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streamed as server-sent events with `stream: true`), GET /health,
GET /version, GET /metrics (Prometheus, vLLM's metric names), and vLLM's
POST /tokenize and /detokenize. Every error is an OpenAI error body
({"error": {"message", "type", "param", "code"}}); with an API key, every
/v1 route wants `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedkv
from pagedkv.engine.llm_engine import EngineArgs, LLMEngine, LoadedModel
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagedkv.server.serving_chat import OpenAIServingChat
from pagedkv.server.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]
_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                 500: "server_error", 503: "server_error"}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.response_body(), status_code=e.status_code)


class APIKeyMiddleware:
    """401 for a /v1 request without `Authorization: Bearer <key>` (a plain ASGI middleware: streaming passes
    through untouched, and the key is checked before the body is even read)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                err = APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", 401,
                               type="invalid_request_error", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first bad field (pydantic's location, without the leading 'body')."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                        code="invalid_json")
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    return APIError(message or "invalid request", param=".".join(loc) or None)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), exc.status_code,
                                       type=_STATUS_TYPES.get(exc.status_code, "invalid_request_error")))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(f"internal server error: {exc!r}", 500, type="server_error"))


def _add_routes(app: FastAPI, async_engine: AsyncEngine, metrics: ServerMetrics, model_names: list[str]) -> None:
    completions = OpenAIServingCompletion(async_engine, model_names)
    chat = OpenAIServingChat(async_engine, model_names)
    engine = async_engine.engine
    root = str(engine.args.model) if engine.args.model else engine.model_name

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return error_response(APIError(async_engine.dead_reason or "the engine is not running", 503,
                                           type="server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedkv.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        cards = [ModelCard(id=name, root=root, max_model_len=completions.max_model_len) for name in model_names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        completions.check_model(model)
        return ModelCard(id=model, root=root, max_model_len=completions.max_model_len).model_dump()

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        completions.check_model(req.model)
        if req.messages is not None:
            ids = chat.chat_prompt(req.messages, req.add_generation_prompt)
        elif req.prompt is not None and completions.tokenizer is not None:
            ids = completions.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError("tokenize needs a prompt or messages (and a tokenizer).", param="prompt")
        return {"count": len(ids), "max_model_len": completions.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        completions.check_model(req.model)
        if completions.tokenizer is None:
            raise APIError("detokenize needs a tokenizer.")
        return {"prompt": completions.tokenizer.decode(req.tokens)}



def build_app(args: EngineArgs, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              loaded: LoadedModel | None = None, engine: LLMEngine | None = None,
              log_interval_s: float = 10.0) -> FastAPI:
    """Builds the engine (loading the model, or reusing `loaded`, a model already in memory; or takes `engine`)
    and returns the app. The engine thread starts with the app (its lifespan) and stops with it.
    """
    engine = engine or LLMEngine(args, loaded)
    model_names = list(served_model_names or [str(args.model) if args.model else engine.model_name])
    metrics = ServerMetrics(model_names[0], engine.scheduler_config.max_model_len, log_interval_s)
    async_engine = AsyncEngine(engine, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s as %s", engine.model_name, ", ".join(model_names))
        try:
            yield
        finally:
            async_engine.shutdown()
            engine.shutdown()  # stops tensor-parallel workers (nothing to do on one device)
            logger.info("engine stopped")

    app = FastAPI(title="pagedkv OpenAI-compatible server", version=pagedkv.__version__, lifespan=lifespan)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, async_engine, metrics
    _add_error_handlers(app)
    _add_routes(app, async_engine, metrics, model_names)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def run_server(args: EngineArgs, ns: argparse.Namespace) -> int:
    """`pagedkv serve`: builds the app and runs uvicorn until SIGINT/SIGTERM (uvicorn handles both)."""
    import uvicorn

    api_key = ns.api_key or os.environ.get("PAGEDKV_API_KEY") or None
    app = build_app(args, served_model_names=ns.served_model_name, api_key=api_key)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found: make
    # that an exit with status 0 rather than a KeyboardInterrupt traceback or death by SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    # Streams still open at shutdown get a few seconds, then are cut; the lifespan then stops the engine.
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, timeout_graceful_shutdown=5)
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
