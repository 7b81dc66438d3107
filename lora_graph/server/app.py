"""The FastAPI app: middleware (:class:`~lora_graph.server.security.Guard`), error handlers
that answer OpenAI's error body, and one line a route, each calling its handler in
:class:`~lora_graph.server.handlers.OpenAIServing`; and :func:`run_server`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_graph import distributed
from lora_graph.config import package_version
from lora_graph.engine import LLMEngine
from lora_graph.server.config import ServerConfig
from lora_graph.server.engine_loop import EngineLoop
from lora_graph.server.handlers import OpenAIServing
from lora_graph.server.metrics import Metrics
from lora_graph.server.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    LoadBody,
    TokenizeBody,
    UnloadBody,
    validation_message,
)
from lora_graph.server.security import Guard


def _error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _http_error_message(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not parse a body ("There was an error parsing the body"), said."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at {cause.start})"
        )
    if isinstance(cause, RecursionError):
        return "the body's JSON nests too deeply"
    if isinstance(cause, ValueError):  # e.g. an integer of too many digits
        return f"the body is not valid JSON ({cause})"
    return str(exc.detail)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(Exception)
    async def internal_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors()[0] if exc.errors() else {})
        return _error(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return _error(APIError(exc.status_code, _http_error_message(exc)))


def create_app(engine: LLMEngine, tokenizer: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine`` (the package docstring). The engine thread starts
    with the app (its lifespan) and stops with it: requests still in flight then are
    aborted and told so (``finish_reason`` ``"abort"``).

    Raises:
        ImportError: without the ``serve`` extra (fastapi, uvicorn, prometheus_client).
    """
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = EngineLoop(engine, on_step=lambda: metrics.observe_engine(engine))
        app.state.engine_loop = loop
        metrics.observe_engine(engine)
        # a dead tensor-parallel worker: the requests in flight fail naming it, then the
        # process ends
        forget = distributed.on_worker_death(loop.fail_all)
        loop.start()
        try:
            yield
        finally:
            forget()
            await asyncio.to_thread(loop.stop)

    # no /docs, /redoc or /openapi.json: every route but /health and /metrics is behind the
    # API key (/metrics too with api_key_metrics)
    app = FastAPI(
        title="lora_graph", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_middleware(Guard, config=config)
    _add_error_handlers(app)
    serving = OpenAIServing(engine, tokenizer, config, metrics, lambda: app.state.engine_loop)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody) -> Any:
        return await serving.completions(http, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody) -> Any:
        return await serving.chat(http, body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingBody) -> dict[str, Any]:
        return await serving.embeddings(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return await serving.model(model_id)

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        return await serving.detokenize(body)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": package_version()}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadBody) -> PlainTextResponse:
        return await serving.load_lora(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadBody) -> PlainTextResponse:
        return await serving.unload_lora(body)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return serving.health()

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = generate_latest(metrics.registry).decode()
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    return app


def _cut_off(loop: EngineLoop) -> None:
    """The grace period's end: abort what is in flight (each response completed with
    ``finish_reason`` "abort"); if the engine thread does not take the abort within 2 s
    (stuck in a step: a tensor-parallel worker that stopped), fail the requests instead, so
    each client still gets a complete answer (an error) rather than a cut connection."""
    try:
        loop.call(loop.abort_all).result(timeout=2.0)
    except Exception:  # noqa: BLE001 - the timeout, or an engine already failed
        loop.fail_all("the server shut down while the engine was stuck in a step")


def run_server(
    app: FastAPI, *, host: str, port: int, grace: float, log_level: str = "info"
) -> None:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM. On the signal the server stops
    accepting; requests in flight get ``grace`` seconds to finish, then are aborted, so each
    one's response still ends properly (``finish_reason`` ``"abort"``, and a stream's usage
    chunk and ``[DONE]``); the process then exits. A second signal during the grace period
    ends it at once (the same abort: complete answers, not cut connections); a third
    Ctrl-C forces uvicorn's exit, cutting whatever is still open."""
    import uvicorn

    started = threading.Lock()  # held once the grace period's end has begun

    def cut_off(loop: EngineLoop) -> None:
        if started.acquire(blocking=False):
            _cut_off(loop)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            loop: EngineLoop | None = getattr(app.state, "engine_loop", None)
            if loop is not None and not self.should_exit:
                timer = threading.Timer(grace, cut_off, args=(loop,))
                timer.daemon = True
                timer.start()
            elif loop is not None and not started.locked():
                threading.Thread(target=cut_off, args=(loop,), daemon=True).start()
                logging.getLogger("uvicorn.error").info(
                    "Aborting the requests in flight (CTRL+C again to force quit)"
                )
                return
            super().handle_exit(sig, frame)

    # the responses cut off at `grace` need a moment to be written before uvicorn closes them
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(grace + 5),
    )
    _Server(config).run()
