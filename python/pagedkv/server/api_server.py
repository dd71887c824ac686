"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

    pagedkv serve [MODEL] [--host 127.0.0.1] [--port 8000] [engine flags] [--served-model-name NAME]
                  [--api-key KEY[,KEY...]] [--protect-metrics] [--max-request-body-bytes N]
                  [--max-json-nesting-depth N] [--enable-prompt-tokens-details] [--shutdown-timeout S]
                  [--enable-lora [--lora-modules NAME=PATH ...] [--max-loras N] [--max-lora-rank R]]

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streamed as server-sent events with `stream: true`), POST /v1/embeddings
(pagedkv.server.serving_embedding), GET /health,
GET /version, GET /metrics (Prometheus, vLLM's metric names), vLLM's
POST /tokenize and /detokenize, and the KV-cache page GET /dashboard
(pagedkv.server.dashboard). With $PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING=1,
vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter too (a
request's `model` names the base model or a LoRA adapter:
pagedkv.server.serving_models). Every error is an OpenAI error body
({"error": {"message", "type", "param", "code"}}), never a 5xx for a bad
request.

What guards the server, outermost first (plain ASGI middlewares, so
streaming passes through untouched):
- the API key(s), on every route but /health (and /metrics unless
  --protect-metrics), checked before the body is read;
- the drain: once SIGTERM came, 503 for every new request;
- the body: more than --max-request-body-bytes is a 413 (before reading it,
  when Content-Length says so), JSON nested deeper than
  --max-json-nesting-depth a 400.
A dead engine turns /health to 503 and stops the server with exit status 1
once the requests in flight have their answer (as vLLM does); SIGTERM drains:
in-flight requests get up to --shutdown-timeout seconds, then a final error
event, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedkv
from pagedkv.config import EngineArgs
from pagedkv.engine.cpu_binding import apply_frontend_binding
from pagedkv.engine.kv_advice import AdviceLog
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.make_engine import make_engine
from pagedkv.model.loader import LoadedModel
from pagedkv.server.api_key import APIKeyMiddleware, ASGIApp, Scope, error_response
from pagedkv.server.async_engine import AsyncEngine, EngineDeadError, EngineDraining
from pagedkv.server.dashboard import QUERY_KEY_PATHS, mount_dashboard
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedkv.server.serving import ServingOptions, engine_error
from pagedkv.server.serving_chat import OpenAIServingChat
from pagedkv.server.serving_completion import OpenAIServingCompletion
from pagedkv.server.serving_embedding import OpenAIServingEmbedding
from pagedkv.server.serving_models import (
    LoRAModulePath,
    OpenAIServingModels,
    load_lora_modules,
    parse_lora_module,
    runtime_lora_updating_allowed,
)
from pagedkv.server.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 500: "server_error", 503: "server_error"}
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(slots=True)
class ServerOptions:
    """`pagedkv serve`'s own settings (the engine's are EngineArgs)."""

    api_keys: tuple[str, ...] = ()  # any of them is accepted; none: no authentication
    protect_metrics: bool = False  # with api_keys: /metrics wants a key too
    max_request_body_bytes: int = 16 << 20
    max_json_nesting_depth: int = 64
    enable_prompt_tokens_details: bool = False
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    dashboard_interval_s: float = 0.5  # /dashboard/stream: seconds between snapshots
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's); None: $PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING
    allow_runtime_lora_updating: bool | None = None
    # Tool calling's "auto" choice (vLLM's --enable-auto-tool-choice / --tool-call-parser): both or neither.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.dashboard_interval_s <= 0:
            raise ValueError(f"dashboard_interval_s must be > 0, got {self.dashboard_interval_s}")
        if self.max_request_body_bytes < 1 or self.max_json_nesting_depth < 1 or self.shutdown_timeout < 0:
            raise ValueError(f"max_request_body_bytes and max_json_nesting_depth must be >= 1 and shutdown_timeout "
                             f">= 0, got {self.max_request_body_bytes}, {self.max_json_nesting_depth}, "
                             f"{self.shutdown_timeout}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")


def parse_api_keys(values: list[str] | str | None) -> tuple[str, ...]:
    """Keys from --api-key (repeatable, each comma-separated, as vLLM accepts) or $PAGEDKV_API_KEY."""
    if isinstance(values, str):
        values = [values]
    return tuple(k.strip() for v in values or () for k in v.split(",") if k.strip())


def json_nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings do not count)."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


class RequestGuardMiddleware:
    """503 while draining; 413 for a body over the limit; 400 for JSON nested over the limit.

    The body is read here (at most limit + one chunk) and replayed to the app; later receive() calls go to
    the client again, so disconnects are still seen.
    """

    def __init__(self, app: ASGIApp, options: ServerOptions, is_draining: Callable[[], bool]) -> None:
        self.app, self.options, self.is_draining = app, options, is_draining

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.is_draining() and scope["path"] not in ("/health", "/metrics"):
            err = APIError("The server is shutting down.", 503, type="server_error", code="shutting_down")
            await error_response(err)(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body, error = await self._read_body(scope, receive)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Callable) -> tuple[bytes, APIError | None]:
        limit = self.options.max_request_body_bytes
        too_large = APIError(f"The request body is larger than the server's limit of {limit} bytes "
                             f"(--max-request-body-bytes).", 413, code="request_too_large")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            return b"", too_large if length.isdigit() else APIError("Content-Length is not a number.")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", APIError("The client disconnected.", 499, code="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        depth_limit = self.options.max_json_nesting_depth
        # Depth cannot exceed the number of opening brackets: most bodies need no scan at all.
        if body.count(b"[") + body.count(b"{") > depth_limit and json_nesting_depth(body) > depth_limit:
            return body, APIError(f"The request body nests JSON arrays/objects deeper than the server's limit of "
                                  f"{depth_limit} (--max-json-nesting-depth).", code="json_too_deep")
        return body, None


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


_PYDANTIC_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple) -> str:
    """pydantic's error location as the request's field path: without the leading 'body' and without the tags it
    inserts for the member of a union it tried (e.g. 'function-after[_valid_unicode(), str]', 'list[int]')."""
    parts = [str(p) for p in loc if p != "body"
             and not (isinstance(p, str) and ("[" in p or "(" in p or p in _PYDANTIC_TYPE_TAGS))]
    return ".".join(parts)


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first bad field (pydantic's location, without the leading 'body')."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                        code="invalid_json")
    message = "; ".join(f"{_field_path(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return APIError(message[:2000] or "invalid request", param=_field_path(first.get("loc", ()))[:200] or None)


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


def _add_routes(app: FastAPI, async_engine: AsyncEngine, metrics: ServerMetrics, models: OpenAIServingModels,
                options: ServerOptions) -> None:
    serving = ServingOptions(enable_prompt_tokens_details=options.enable_prompt_tokens_details,
                             tool_call_parser=options.tool_call_parser if options.enable_auto_tool_choice else None)
    completions = OpenAIServingCompletion(async_engine, models, serving)
    chat = OpenAIServingChat(async_engine, models, serving, executor=completions.executor,
                             tokenizer=completions.tokenizer)
    embeddings = OpenAIServingEmbedding(async_engine, models, serving, executor=completions.executor,
                                        tokenizer=completions.tokenizer)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.draining:
            return error_response(APIError("the server is shutting down", 503, type="server_error"))
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
        return ModelList(data=models.model_cards()).model_dump()

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        return models.model_card(model).model_dump()

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        completions.check_model(req.model)
        if req.messages is not None:
            ids = await chat.off_loop(chat.chat_prompt, req.messages, req.add_generation_prompt)
        elif req.prompt is not None and completions.tokenizer is not None:
            tok = completions.tokenizer
            ids = await completions.off_loop(lambda: tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            raise APIError("tokenize needs a prompt or messages (and a tokenizer).", param="prompt")
        return {"count": len(ids), "max_model_len": completions.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        completions.check_model(req.model)
        tok = completions.tokenizer
        if tok is None:
            raise APIError("detokenize needs a tokenizer.")
        size = len(tok)
        bad = next((t for t in req.tokens if t >= size), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of vocabulary [0, {size}).", param="tokens")
        return {"prompt": await completions.off_loop(tok.decode, req.tokens)}

    allow_lora_updating = options.allow_runtime_lora_updating
    if allow_lora_updating is None:
        allow_lora_updating = runtime_lora_updating_allowed()
    if allow_lora_updating:  # else the routes do not exist (404), as in vLLM without its variable
        _add_lora_routes(app, models)


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's runtime LoRA routes: 200 with a plain-text line, else an OpenAI error body."""
    logger.warning("runtime LoRA updating is on: clients with access to the API can load adapters from this "
                   "machine's files (POST /v1/load_lora_adapter)")

    async def answer(change: Awaitable[str]) -> Response:
        try:
            return PlainTextResponse(await change)
        except (EngineDeadError, EngineDraining) as e:
            raise engine_error(e) from e

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        return await answer(models.load_lora_adapter(req.lora_name, req.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        return await answer(models.unload_lora_adapter(req.lora_name, req.lora_int_id))


def build_app(args: EngineArgs, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              loaded: LoadedModel | None = None, engine: LLMEngine | None = None,
              log_interval_s: float = 10.0, options: ServerOptions | None = None,
              lora_modules: list[LoRAModulePath] | None = None) -> FastAPI:
    """Builds the engine (loading the model, or reusing `loaded`, a model already in memory; or takes `engine`)
    and returns the app. The engine thread starts with the app (its lifespan) and stops with it.

    The engine core runs in its own process (`args.engine_core` "auto" or "process"), unless it is given
    (`engine`, `loaded`) or asked for in this process ("inproc"): then on the server's engine thread.

    api_key: one key or several comma-separated (added to options.api_keys). lora_modules: LoRA adapters to
    serve (args.enable_lora), read by the engine here: ValueError naming the first that cannot run.
    """
    options = options or ServerOptions()
    if api_key:
        options = dataclasses.replace(options, api_keys=options.api_keys + parse_api_keys(api_key))
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (enable_lora=True)")
    engine = engine or make_engine(args, loaded, default_core="process")
    model_names = list(served_model_names or [str(args.model) if args.model else engine.model_name])
    try:
        loras = load_lora_modules(engine, lora_modules or [], model_names)
    except ValueError:
        engine.shutdown()  # a core process must not outlive the failed start
        raise
    metrics = ServerMetrics(model_names[0], engine.scheduler_config.max_model_len, log_interval_s,
                            cache_info=engine.cache_config.metrics_info(),
                            max_loras=engine.args.max_loras if engine.args.enable_lora else None,
                            speculative=engine.args.speculative_config is not None)
    metrics.advice_log = AdviceLog.for_engine(engine)
    async_engine = AsyncEngine(engine, metrics)
    root = str(engine.args.model) if engine.args.model else engine.model_name
    models = OpenAIServingModels(async_engine, model_names, root, engine.scheduler_config.max_model_len, loras)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s as %s", engine.model_name, ", ".join(model_names))
        if loras:
            logger.info("LoRA adapters: %s", ", ".join(f"{r.lora_name} ({r.lora_path})" for r in loras))
        try:
            yield
        finally:
            async_engine.shutdown()
            engine.shutdown()  # stops tensor-parallel workers (nothing to do on one device)
            logger.info("engine stopped")

    app = FastAPI(title="pagedkv OpenAI-compatible server", version=pagedkv.__version__, lifespan=lifespan)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, async_engine, metrics
    app.state.options, app.state.models = options, models
    _add_error_handlers(app)
    _add_routes(app, async_engine, metrics, models, options)
    mount_dashboard(app, async_engine, options.dashboard_interval_s)
    app.add_middleware(RequestGuardMiddleware, options=options, is_draining=lambda: async_engine.draining)
    if options.api_keys:  # added last: the outermost, so no body is read for an unauthenticated request
        open_paths = frozenset({"/health"} if options.protect_metrics else {"/health", "/metrics"})
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys, open_paths=open_paths,
                           query_key_paths=QUERY_KEY_PATHS)
    return app


class Server(uvicorn.Server):
    """uvicorn's server with pagedkv's shutdown: SIGTERM/SIGINT drain first, a dead engine stops it with 1.

    First signal: new requests get 503 and /health 503; the requests in
    flight get up to `shutdown_timeout` seconds; whatever is still running
    then ends with an error (a stream's last event) and the server stops.
    A second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.async_engine: AsyncEngine = app.state.async_engine
        self.shutdown_timeout = app.state.options.shutdown_timeout
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.async_engine.on_dead = self._engine_died

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not recorded for uvicorn to re-raise after serve(): pagedkv's own exit status stands.
        if self._drain_task is None and not self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)
        else:
            self.should_exit = self.force_exit = True

    def _start_drain(self, why: str) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain(why))

    async def drain(self, why: str = "shutdown") -> None:
        """Stops admitting, waits for the requests in flight (up to shutdown_timeout), ends the rest, stops."""
        engine = self.async_engine
        logger.info("%s: draining %d requests in flight (up to %.0f s; new requests get 503)", why,
                    engine.num_active, self.shutdown_timeout)
        engine.begin_drain()
        if not await engine.wait_idle(self.shutdown_timeout):
            logger.warning("%d requests still running after %.0f s: ending them", engine.num_active,
                           self.shutdown_timeout)
            engine.abort_all("the server is shutting down (the drain's --shutdown-timeout ran out)")
            await engine.wait_idle(5.0)
        await asyncio.sleep(0.1)  # the last events leave the sockets before uvicorn closes them
        self.should_exit = True

    def _engine_died(self, reason: str) -> None:
        """From the engine thread: answer what is in flight (already failed with 503), then exit 1."""
        logger.error("the engine is dead (%s): the server stops", reason)
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_after_dead)

    def _stop_after_dead(self) -> None:
        async def stop() -> None:
            await self.async_engine.wait_idle(5.0)
            self.should_exit = True

        asyncio.ensure_future(stop())


def serve(app: FastAPI, config: uvicorn.Config, sockets: list | None = None) -> int:
    """Runs `app` until it is stopped; returns the exit status (0, or 1 after the engine died)."""
    server = Server(config, app)
    app.state.server = server
    server.run(sockets=sockets)
    return server.exit_code


def run_server(args: EngineArgs, ns: argparse.Namespace) -> int:
    """`pagedkv serve`: builds the app and serves it until SIGINT/SIGTERM (drained) or the engine dies."""
    keys = parse_api_keys(ns.api_key) or parse_api_keys(os.environ.get("PAGEDKV_API_KEY"))
    options = ServerOptions(api_keys=keys, protect_metrics=ns.protect_metrics,
                            max_request_body_bytes=ns.max_request_body_bytes,
                            max_json_nesting_depth=ns.max_json_nesting_depth,
                            enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                            shutdown_timeout=ns.shutdown_timeout, dashboard_interval_s=ns.dashboard_interval,
                            enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser)
    if options.protect_metrics and not keys:
        raise ValueError("--protect-metrics needs --api-key (or $PAGEDKV_API_KEY)")
    lora_modules = [parse_lora_module(text) for text in ns.lora_modules or ()]
    app = build_app(args, served_model_names=ns.served_model_name, options=options, lora_modules=lora_modules)
    binding = getattr(app.state.engine, "cpu_binding", None)
    if binding is not None:
        apply_frontend_binding(binding)  # off the core's CPUs, when some are left
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            timeout_graceful_shutdown=5)
    return serve(app, config)
