"""An OpenAI-compatible HTTP server over :class:`~lora_graph.engine.LLMEngine`.

FastAPI routes, uvicorn serving, FastAPI's server-sent events for ``stream: true``,
``prometheus_client`` for ``/metrics``. Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat
  template): ``model`` names the base model or a loaded adapter; ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (strings), ``stop_token_ids``,
  ``n``, ``ignore_eos``, ``stream`` and ``stream_options``. Streamed responses are OpenAI's
  chunk objects, then (only with ``stream_options: {"include_usage": true}``, as OpenAI
  and vLLM) a usage chunk with no choices, then ``[DONE]``. ``logprobs`` is refused (400).
- ``POST /v1/embeddings`` (an encoder, ``models/bert.py``): sentence embeddings of a text,
  texts or token-id lists, under the adapter ``model`` names; ``encoding_format`` float or
  base64. An encoder serves only this route; a decoder every other.
- ``GET /v1/models``: the base model and every loaded adapter.
- ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``: vLLM's payload
  (``lora_name``, ``lora_path``); loading needs ``allow_runtime_lora`` and a path under one
  of ``lora_roots``.
- ``GET /health`` (never needs the API key), ``GET /metrics`` (Prometheus text format).

Threading: one background thread (:class:`EngineLoop`) owns the engine and runs its steps;
HTTP handlers never touch the engine, they send it commands (run on that thread between
steps) and receive each request's tokens through an ``asyncio`` queue. A request is
validated before it is queued: a bad one is answered 400 with an OpenAI error body naming
the cause. A client that disconnects has its request aborted (pages and adapter hold
released).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import itertools
import json
import os
import queue
import re
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lora_graph.config import AdapterError
from lora_graph.engine import LLMEngine, Request, RequestOutput, SamplingParams, check_text

try:  # the "serve" extra
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from fastapi.sse import EventSourceResponse, format_sse_event
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        generate_latest,
    )
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException

    HAVE_SERVER_DEPS = True
except ImportError:  # pragma: no cover - exercised without the extra
    HAVE_SERVER_DEPS = False
    BaseModel = object  # type: ignore[assignment,misc]


class ClientGone(Exception):
    """The client closed its connection before its answer was complete (its requests are
    aborted; nothing is sent, and nothing is logged as an error)."""


class APIError(Exception):
    """An error answered as OpenAI's error body: ``{"error": {"message", "type", "param",
    "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status)
        if kind is None:  # a client's error (400, 405, 413, ...) or the server's
            kind = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }


# --------------------------------------------------------------------------------------
# the engine thread
# --------------------------------------------------------------------------------------


@dataclass
class _Watcher:
    """Where one engine request's tokens go: called on the engine thread."""

    on_token: Callable[[int], None]
    on_finish: Callable[[RequestOutput], None]


class EngineLoop:
    """Runs ``engine`` on one background thread: steps while anything is unfinished, and
    between steps runs the commands other threads send (:meth:`call`).

    Args:
        engine: the engine; no other thread may use it once :meth:`start` is called.
        on_step: called on the engine thread after each step (metrics).
    """

    def __init__(self, engine: LLMEngine, on_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = queue.SimpleQueue()
        self._watchers: dict[str, _Watcher] = {}
        self._stop = threading.Event()
        self._on_step = on_step
        self._thread = threading.Thread(target=self._run, name="lora-graph-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight (each request finishes with ``error="aborted"``) and end
        the thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.call(self.abort_all).result(timeout)
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; its result (or exception) comes
        back through the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine is not running"))
            return future
        self._commands.put((fn, future))
        return future

    def submit(self, request: Request, watcher: _Watcher) -> None:
        """Queue ``request`` (engine thread only, inside a :meth:`call`).

        Raises:
            ValueError: the engine's validation message, if the request is refused.
        """
        self.engine.add_request(request)
        refused = self.engine.finished.get(request.id)
        if refused is not None and refused.error is not None:
            del self.engine.finished[request.id]
            raise ValueError(refused.error)
        self._watchers[request.id] = watcher

    def abort(self, request_id: str) -> None:
        """Abort a request (engine thread only); its watcher hears the ``aborted`` finish."""
        self.engine.abort_request(request_id)
        self._deliver_finished()

    def abort_all(self) -> None:
        """Abort every request in flight (engine thread only)."""
        for request_id in list(self._watchers):
            self.engine.abort_request(request_id)
        self._deliver_finished()

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting up to 50 ms for one if ``block``); return
        whether any ran."""
        ran = False
        while True:
            try:
                fn, future = self._commands.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return ran
            block = False
            ran = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                ran = self._run_commands(block=not self.engine.has_unfinished())
                if ran and self._on_step is not None:  # an abort or a load changed the state
                    self._on_step()
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                for request_id, token in self.engine.step():
                    watcher = self._watchers.get(request_id)
                    if watcher is not None:
                        watcher.on_token(token)
                self._deliver_finished()
                if self._on_step is not None:
                    self._on_step()
        except BaseException as e:  # noqa: BLE001 - a fault of the engine: fail every request
            self.error = e
            for request_id, watcher in list(self._watchers.items()):
                watcher.on_finish(RequestOutput(request_id, None, error=f"engine failed: {e!r}"))
            self._watchers.clear()
            while True:
                try:
                    _, future = self._commands.get_nowait()
                except queue.Empty:
                    break
                future.set_exception(RuntimeError(f"engine failed: {e!r}"))

    def _deliver_finished(self) -> None:
        for request_id in [i for i in self.engine.finished if i in self._watchers]:
            out = self.engine.finished.pop(request_id)
            self._watchers.pop(request_id).on_finish(out)


# --------------------------------------------------------------------------------------
# request bodies (unknown fields are refused)
# --------------------------------------------------------------------------------------

if HAVE_SERVER_DEPS:

    class _Body(BaseModel):
        # unknown fields and loose types ("4" for 4, true for 1) are refused
        model_config = ConfigDict(extra="forbid", strict=True)

    class StreamOptions(_Body):
        include_usage: bool = True

    class _Sampling(_Body):
        model: str
        max_tokens: int | None = Field(default=None)
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        seed: int | None = None
        stop: str | list[str] | None = None
        stop_token_ids: list[int] = Field(default_factory=list)
        ignore_eos: bool = False
        n: int = 1
        stream: bool = False
        stream_options: StreamOptions | None = None
        logprobs: Any = None
        user: str | None = None

    class CompletionBody(_Sampling):
        prompt: str | list[int]
        echo: bool = False

    class TextPart(_Body):
        type: Literal["text"]
        text: str

    class ChatMessage(_Body):
        role: Literal["system", "user", "assistant", "tool", "developer"]
        content: str | list[TextPart]
        name: str | None = None

        def template_dict(self) -> dict[str, Any]:
            """The message as a chat template sees it (text parts joined)."""
            content = self.content
            if not isinstance(content, str):
                content = "".join(part.text for part in content)
            out: dict[str, Any] = {"role": self.role, "content": content}
            if self.name is not None:
                out["name"] = self.name
            return out

    class ChatBody(_Sampling):
        messages: list[ChatMessage]
        top_logprobs: int | None = None
        max_completion_tokens: int | None = None

    class LoadBody(_Body):
        lora_name: str
        lora_path: str

    class EmbeddingBody(_Body):
        model: str
        input: str | list[str] | list[int] | list[list[int]]
        encoding_format: Literal["float", "base64"] = "float"
        dimensions: int | None = None
        user: str | None = None

    class UnloadBody(_Body):
        lora_name: str
        lora_int_id: int | None = None


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lora_graph_requests",
            "Finished engine requests (each of a request's n choices counts)",
            ["adapter", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "lora_graph_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "lora_graph_generation_tokens", "Generated tokens", registry=r
        )
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(
            "lora_graph_time_to_first_token_seconds", "Arrival to first token", buckets=buckets,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "lora_graph_inter_token_latency_seconds", "Between tokens of a request",
            buckets=buckets, registry=r,
        )  # fmt: skip
        self.running = Gauge("lora_graph_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("lora_graph_requests_waiting", "Requests waiting", registry=r)
        self.kv_pages_used = Gauge("lora_graph_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge("lora_graph_kv_pages_total", "KV cache pages", registry=r)
        self.slot_hits = Counter(
            "lora_graph_lora_slot_hits", "Adapter activations that found it in a slot", registry=r
        )
        self.slot_misses = Counter(
            "lora_graph_lora_slot_misses", "Adapter activations that copied it in", registry=r
        )
        self.slot_evictions = Counter(
            "lora_graph_lora_slot_evictions", "Adapters evicted from a slot", registry=r
        )
        self._slot_counts = (0, 0, 0)
        self.adapter_load = Histogram(
            "lora_graph_adapter_load_seconds", "Runtime adapter loads", buckets=buckets,
            registry=r,
        )  # fmt: skip

    def observe_engine(self, engine: LLMEngine) -> None:
        """Gauges from the engine's state (engine thread)."""
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        pages = engine.pages
        self.kv_pages_total.set(pages.capacity)
        self.kv_pages_used.set(pages.capacity - pages.num_free)
        manager = engine.pipeline.manager
        if manager is not None:
            now = (manager.slots.hits, manager.slots.loads, manager.slots.evictions)
            for counter, new, old in zip(
                (self.slot_hits, self.slot_misses, self.slot_evictions),
                now,
                self._slot_counts,
                strict=True,
            ):
                if new > old:
                    counter.inc(new - old)
            self._slot_counts = now

    def observe_finished(self, out: RequestOutput, outcome: str | None = None) -> None:
        outcome = outcome or out.finish_reason or ("aborted" if out.error == "aborted" else "error")
        self.requests.labels(out.adapter or "base", outcome).inc()
        times = out.token_times
        if out.arrival_time is not None and times:
            self.ttft.observe(times[0] - out.arrival_time)
        for a, b in itertools.pairwise(times):
            self.itl.observe(b - a)


# --------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    """What the server serves and allows.

    Attributes:
        model_name: the name ``model`` takes for the base model (and ``/v1/models`` lists).
        api_key: if set, every route but ``/health`` needs ``Authorization: Bearer KEY``.
        allow_runtime_lora: whether ``/v1/load_lora_adapter`` may load adapters.
        lora_roots: directories runtime loads may read from (resolved, symlinks followed).
        default_max_tokens: ``max_tokens`` when a request gives none.
        max_request_bytes: larger request bodies are refused (413): before they are read
            when their ``Content-Length`` says so, else once the bytes read pass it.
    """

    model_name: str
    api_key: str | None = None
    allow_runtime_lora: bool = False
    lora_roots: list[str] = field(default_factory=list)
    default_max_tokens: int = 16
    max_request_bytes: int = 8 << 20


@dataclass
class _Choice:
    index: int
    request_id: str
    stops: list[str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    finish_reason: str | None = None
    done: bool = False  # its text is final
    engine_done: bool = False  # its engine request finished
    refused: bool = False  # another choice of its request was refused: never served


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# request fields of several accepted forms: a value of none of them is refused with all
# (pydantic reports the error of one form, e.g. "prompt.str: Input should be a valid string")
_UNION_FIELDS = {
    "prompt": "text or a list of token ids",
    "input": "text, a list of texts, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
}


def _path_under(path: str, roots: list[str]) -> bool:
    """Whether ``path`` and, for a directory, every entry in it (symlinks resolved) lie under
    one of ``roots`` (resolved); a path with ``..`` never does. A path that cannot be
    resolved is not under them. (A file swapped between this check and the load is not
    caught: the roots must not be writable by whoever may call the API.)"""
    bases = [Path(os.path.realpath(root)) for root in roots]

    def inside(p: str) -> bool:
        real = Path(os.path.realpath(p))
        return any(real == base or base in real.parents for base in bases)

    try:
        if ".." in Path(path).parts or not inside(path):
            return False
        if os.path.isdir(path):
            return all(inside(entry.path) for entry in os.scandir(path))
        return True
    except (OSError, ValueError):  # a NUL byte, a loop of links, no permission
        return False


class _Guard:
    """ASGI middleware: the API key, checked before the body is read, and the body size
    limit (a plain ASGI wrapper, so a handler still sees its client hang up). A body with a
    ``Content-Length`` over the limit is refused unread; one without (``Transfer-Encoding:
    chunked``) is read here up to the limit, refused as soon as it passes it, and else
    handed on whole."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = None
        key = self.config.api_key
        if scope["path"] != "/health" and key is not None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            # (an auth scheme's name is case-insensitive: RFC 9110, section 11.1)
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.encode(), key.encode()
            ):
                error = APIError(401, "missing or wrong API key (Authorization: Bearer KEY)")
        length = headers.get("content-length", "")
        limit = self.config.max_request_bytes
        if error is None and length.isdigit() and int(length) > limit:
            error = APIError(413, f"the request body is over {limit} bytes")
        elif error is None and not length.isdigit():  # a chunked body, or none
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client hung up
                    return
                body += message.get("body", b"")
                if len(body) > limit:
                    error = APIError(413, f"the request body is over {limit} bytes")
                    break
                if not message.get("more_body", False):
                    receive = _replay(bytes(body), receive)
                    break
        if error is None:
            await self.app(scope, receive, send)
        else:
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def _replay(body: bytes, receive: Callable) -> Callable:
    """An ASGI ``receive`` that first gives ``body`` whole, then what ``receive`` gives (a
    client's hang-up)."""
    given = False

    async def replay() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(engine: LLMEngine, tokenizer: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine`` (module docstring). The engine thread starts
    with the app (its lifespan) and stops with it: requests still in flight then are
    aborted and told so (``finish_reason`` ``"abort"``).

    Raises:
        ImportError: without the ``serve`` extra (fastapi, uvicorn, prometheus_client).
    """
    if not HAVE_SERVER_DEPS:
        raise ImportError("the server needs: pip install 'lora_graph[serve]'")
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = EngineLoop(engine, on_step=lambda: metrics.observe_engine(engine))
        app.state.engine_loop = loop
        metrics.observe_engine(engine)
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    # no /docs, /redoc or /openapi.json: every route but /health is behind the API key
    app = FastAPI(
        title="lora_graph", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    app.add_middleware(_Guard, config=config)

    def engine_loop() -> EngineLoop:
        return app.state.engine_loop

    async def on_engine(fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(engine_loop().call(fn))

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        field_name = where.split(".", 1)[0]
        if field_name in _UNION_FIELDS and where != field_name:  # one branch's error: say all
            message, where = f"{field_name} must be {_UNION_FIELDS[field_name]}", field_name
        elif first.get("type") == "extra_forbidden":
            message = f"unknown field {where!r}"
        elif first.get("type") == "json_invalid":
            message, where = "the body is not valid JSON", ""
        elif where:
            message = f"{where}: {message}"
        return JSONResponse(APIError(400, message, param=where or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        cause = exc.__cause__  # FastAPI's "There was an error parsing the body": say why
        if isinstance(cause, UnicodeDecodeError):
            message = (
                f"the body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at "
                f"{cause.start})"
            )
        elif isinstance(cause, RecursionError):
            message = "the body's JSON nests too deeply"
        elif isinstance(cause, ValueError):  # e.g. an integer of too many digits
            message = f"the body is not valid JSON ({cause})"
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    def text_or_400(text: str, what: str, param: str) -> None:
        try:
            check_text(text, what)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def adapter_of(model: str) -> str | None:
        if model == config.model_name:
            return None
        manager = engine.pipeline.manager
        if manager is None or not manager.is_lora(model):
            known = [config.model_name, *(manager.loras if manager is not None else [])]
            raise APIError(
                400, f"the model {model!r} does not exist (served: {', '.join(known)})",
                param="model",
            )  # fmt: skip
        return model

    def sampling_of(body: Any, max_tokens: int | None) -> SamplingParams:
        if body.logprobs not in (None, False) or getattr(body, "top_logprobs", None):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if not 1 <= body.n <= 16:
            raise APIError(400, f"n must be in [1, 16], got {body.n}", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
            )
        s = SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else config.default_max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
        )
        try:
            s.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return s

    def stops_of(body: Any) -> list[str]:
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
        return stops

    async def run(
        prompt_ids: list[int],
        adapter: str | None,
        sampling: SamplingParams,
        n: int,
        stops: list[str],
    ) -> tuple[list[_Choice], asyncio.Queue]:
        """Queue ``n`` engine requests; their events arrive on the returned queue as
        ``(choice index, "token", id)`` and ``(choice index, "finish", RequestOutput)``."""
        events: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        choices = [_Choice(i, f"{base}-{i}", stops) for i in range(n)]

        def put(item: Any) -> None:
            aloop.call_soon_threadsafe(events.put_nowait, item)

        def finished(c: _Choice, out: RequestOutput) -> None:  # engine thread
            c.engine_done = True
            if c.refused:
                return
            # a stop string ends a choice by aborting its engine request: count it a stop
            stopped = out.error == "aborted" and c.finish_reason == "stop"
            metrics.observe_finished(out, "stop" if stopped else None)
            put((c.index, "finish", out))

        def submit_all() -> None:
            loop = engine_loop()
            submitted: list[str] = []
            try:
                for c in choices:
                    s = sampling
                    if n > 1 and sampling.seed is not None:  # choice i draws with seed + i
                        seed = (sampling.seed + c.index) % 2**64
                        s = SamplingParams(**{**sampling.__dict__, "seed": seed})
                    watcher = _Watcher(
                        lambda t, i=c.index: put((i, "token", t)),
                        lambda out, c=c: finished(c, out),
                    )
                    loop.submit(Request(c.request_id, list(prompt_ids), adapter, s), watcher)
                    submitted.append(c.request_id)
            except ValueError:
                for c in choices:
                    c.refused = True  # not counted as served requests
                for request_id in submitted:
                    loop.abort(request_id)
                raise
            metrics.prompt_tokens.inc(len(prompt_ids) * n)

        try:
            await on_engine(submit_all)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except RuntimeError as e:
            raise APIError(503, str(e)) from e
        return choices, events

    def abort_all(choices: list[_Choice]) -> None:
        pending = [c.request_id for c in choices if not c.engine_done]
        if pending and engine_loop().alive:

            def abort() -> None:
                for request_id in pending:
                    engine_loop().abort(request_id)

            engine_loop().call(abort)

    def advance(choice: _Choice, event: str, value: Any) -> str:
        """Apply one event to ``choice``; return the text it newly emits."""
        if event == "token":
            choice.tokens.append(value)
            metrics.generation_tokens.inc()
            full = tokenizer.decode(choice.tokens, skip_special_tokens=True)
            for stop in choice.stops:
                at = full.find(stop)
                if at >= 0:  # the stop string ends the choice; it is not returned
                    full = full[:at]
                    choice.finish_reason = "stop"
                    choice.done = True
                    break
            else:
                if full.endswith("\ufffd"):  # an incomplete character: wait for the rest
                    return ""
                # hold back a tail that may be the start of a stop string
                hold = max((len(s) - 1 for s in choice.stops), default=0)
                keep = next(
                    (
                        k
                        for k in range(min(hold, len(full)), 0, -1)
                        if any(s.startswith(full[-k:]) for s in choice.stops)
                    ),
                    0,
                )
                full = full[: len(full) - keep]
            if not full.startswith(choice.text):
                return ""
            new, choice.text = full[len(choice.text) :], full
            return new
        out: RequestOutput = value
        if choice.done:
            return ""
        choice.done = True
        if out.error is not None:
            if out.error == "aborted":
                choice.finish_reason = "abort"
            elif "was unloaded" in out.error:  # queued when its adapter was unloaded
                raise APIError(400, out.error, param="model")
            else:
                raise APIError(500, out.error)
        else:
            choice.finish_reason = out.finish_reason
        full = tokenizer.decode(choice.tokens, skip_special_tokens=True)
        new = full[len(choice.text) :] if full.startswith(choice.text) else ""
        choice.text = full
        return new

    async def next_event(events: asyncio.Queue, http: HTTPRequest, state: dict) -> Any:
        """The next event; raises :class:`ClientGone` if the client went away (checked at
        least every half second, also while tokens keep coming)."""
        while True:
            now = time.monotonic()
            if now - state.setdefault("checked", now) >= 0.5:
                state["checked"] = now
                if await http.is_disconnected():
                    raise ClientGone
            try:
                return await asyncio.wait_for(events.get(), timeout=0.5)
            except TimeoutError:
                continue

    def usage(prompt_len: int, choices: list[_Choice]) -> dict[str, int]:
        completion = sum(len(c.tokens) for c in choices)
        return {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
        }

    async def serve(
        http: HTTPRequest,
        body: Any,
        prompt_ids: list[int],
        max_tokens: int | None,
        chat: bool,
    ) -> Any:
        limit = engine.pipeline.max_seq_len
        if len(prompt_ids) >= limit:  # (a text prompt is read up to 64 characters a position)
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens or more; at most {limit - 1} fit "
                "(max_seq_len)",
                param="messages" if chat else "prompt",
            )
        adapter = adapter_of(body.model)
        sampling = sampling_of(body, max_tokens)
        stops = stops_of(body)
        choices, events = await run(prompt_ids, adapter, sampling, body.n, stops)
        watch: dict[str, float] = {}
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"

        def piece(index: int, text: str, finish: str | None, first: bool = False) -> dict:
            out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
            if chat:
                out["delta"] = {"content": text}
                if first:
                    out["delta"]["role"] = "assistant"
            else:
                out["text"] = text
            return out

        if not body.stream:
            try:
                while not all(c.done for c in choices):
                    index, event, value = await next_event(events, http, watch)
                    c = choices[index]
                    if not c.done:
                        advance(c, event, value)
                        if c.done:  # a stop string: the engine request is no longer needed
                            abort_all([c])
            except ClientGone:
                abort_all(choices)
                return Response(status_code=499)  # (nginx's "client closed request"; unread)
            except asyncio.CancelledError:
                abort_all(choices)
                raise
            out_choices = [piece(c.index, c.text, c.finish_reason) for c in choices]
            if chat:  # a whole answer is a message, not a delta
                for o in out_choices:
                    o["message"] = {"role": "assistant", "content": o.pop("delta")["content"]}
            return JSONResponse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": body.model,
                    "choices": out_choices,
                    "usage": usage(len(prompt_ids), choices),
                }
            )

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        # OpenAI and vLLM send the usage chunk (no choices) only when asked for it: a client
        # reading chunk.choices[0] of every chunk would fail on it
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def sse(data: Any) -> bytes:  # FastAPI's SSE wire format
            return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data))

        async def stream() -> AsyncIterator[bytes]:
            def chunk(choice_list: list[dict], use: dict | None = None) -> bytes:
                data: dict[str, Any] = {
                    "id": rid,
                    "object": chunk_kind,
                    "created": created,
                    "model": body.model,
                    "choices": choice_list,
                }
                if use is not None:
                    data["usage"] = use
                return sse(data)

            try:
                if chat:
                    for c in choices:
                        yield chunk([piece(c.index, "", None, first=True)])
                while not all(c.done for c in choices):
                    index, event, value = await next_event(events, http, watch)
                    c = choices[index]
                    if c.done:
                        continue
                    try:
                        text = advance(c, event, value)
                    except APIError as e:
                        yield sse(e.body())  # an error event, then the stream ends as usual
                        abort_all(choices)
                        yield sse("[DONE]")
                        return
                    if c.done and event == "token":  # a stop string ended it
                        abort_all([c])
                    if text or c.done:
                        yield chunk([piece(c.index, text, c.finish_reason if c.done else None)])
                if include_usage:
                    yield chunk([], usage(len(prompt_ids), choices))
                yield sse("[DONE]")
            except ClientGone:
                abort_all(choices)  # (the stream just ends: nobody reads it)
            except (asyncio.CancelledError, GeneratorExit):
                abort_all(choices)
                raise

        return EventSourceResponse(stream())

    def generates() -> None:
        if hasattr(engine.pipeline, "embed"):
            raise APIError(
                400, f"the model {config.model_name!r} is an encoder; use /v1/embeddings",
                param="model",
            )  # fmt: skip

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingBody) -> dict[str, Any]:
        """Sentence embeddings of an encoder (``models/bert.py``), each input under the
        adapter ``model`` names; ``encoding_format`` ``"base64"`` is the float32 vector's
        little-endian bytes (what the ``openai`` client asks for by default)."""
        pipe = engine.pipeline
        if not hasattr(pipe, "embed"):
            raise APIError(
                400, f"the model {config.model_name!r} does not serve embeddings (an "
                "encoder does: bert)", param="model",
            )  # fmt: skip
        adapter = adapter_of(body.model)
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported", param="dimensions")
        raw = body.input
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]  # one text, or one list of token ids
        if not raw:
            raise APIError(400, "input is empty", param="input")
        for i, x in enumerate(raw):
            if isinstance(x, str):
                text_or_400(x, f"input {i}" if len(raw) > 1 else "input", "input")
        try:  # off the event loop
            rows = await asyncio.to_thread(
                lambda: [x if isinstance(x, list) else tokenizer(x)["input_ids"] for x in raw]
            )
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
            raise APIError(400, f"the input cannot be tokenized: {e}", param="input") from e
        try:
            vectors = await on_engine(lambda: pipe.embed([(ids, adapter) for ids in rows]))
        except ValueError as e:
            raise APIError(400, str(e).replace("row ", "input ", 1), param="input") from e
        tokens = sum(len(ids) for ids in rows)
        metrics.prompt_tokens.inc(tokens)
        data = []
        for i, v in enumerate(vectors):
            vec: Any = v.tolist()
            if body.encoding_format == "base64":
                vec = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": vec})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody) -> Any:
        generates()
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if isinstance(body.prompt, str):
            text_or_400(body.prompt, "prompt", "prompt")
            limit = engine.pipeline.max_seq_len
            try:  # off the event loop: a long prompt must not stall other connections
                prompt_ids = await asyncio.to_thread(
                    lambda: tokenizer(body.prompt[: 64 * limit])["input_ids"]
                )
            except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
                raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from e
        else:
            prompt_ids = list(body.prompt)
        return await serve(http, body, prompt_ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody) -> Any:
        generates()
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(
                400,
                f"the model {config.model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        messages = [m.template_dict() for m in body.messages]
        for i, m in enumerate(messages):
            for key, value in m.items():
                text_or_400(value, f"messages[{i}].{key}", "messages")
        try:
            prompt_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise APIError(400, f"the chat template refused the messages: {e}") from e
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        return await serve(http, body, list(prompt_ids), max_tokens, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        manager = engine.pipeline.manager
        names = await on_engine(lambda: list(manager.loras) if manager is not None else [])
        created = int(time.time())
        parents = {config.model_name: None, **dict.fromkeys(names, config.model_name)}
        data = [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "lora_graph",
                "root": n,
                "parent": parent,
            }  # fmt: skip
            for n, parent in parents.items()
        ]
        return {"object": "list", "data": data}

    loading: set[str] = set()  # adapter names being read by a runtime load

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadBody) -> PlainTextResponse:
        if not config.allow_runtime_lora:
            raise APIError(400, "runtime adapter loading is off (start with --allow-runtime-lora)")
        manager = engine.pipeline.manager
        if manager is None:
            raise APIError(400, "this server was started without LoRA support")
        if body.lora_name == config.model_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        if not _NAME.fullmatch(body.lora_name):
            raise APIError(
                400,
                f"lora_name {body.lora_name[:80]!r} must be 1-64 letters, digits, '.', '_' or '-'",
                param="lora_name",
            )
        name = body.lora_name
        if not _path_under(body.lora_path, config.lora_roots):
            raise APIError(
                400,
                f"lora_path {body.lora_path!r} is not under an allowed --lora-root",
                param="lora_path",
            )
        if name in loading:
            raise APIError(400, f"an adapter named {name!r} is being loaded", param="lora_name")
        taken = APIError(
            400, f"an adapter named {name!r} is already loaded; unload it first", param="lora_name"
        )

        def add(read: Any) -> Any:  # on the engine thread: checked and added as one
            if manager.is_lora(name):
                raise taken
            return manager.add_adapter(read)

        loading.add(name)  # (no await since the check above: one load of a name at a time)
        start = time.perf_counter()
        try:
            if await on_engine(lambda: manager.is_lora(name)):
                raise taken  # before its files are read
            # the files are read on a worker thread: the engine keeps stepping meanwhile
            read = await asyncio.to_thread(manager.read_adapter, body.lora_path, name=name)
            status = await on_engine(lambda: add(read))
        except (AdapterError, ValueError, OSError) as e:
            message = str(e)
            if not message.startswith(f"adapter {name!r}"):
                message = f"adapter {name!r}: {message}"
            raise APIError(400, message) from e
        finally:
            loading.discard(name)
        metrics.adapter_load.observe(time.perf_counter() - start)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully ({status.name.lower()})."
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadBody) -> PlainTextResponse:
        if not config.allow_runtime_lora:
            raise APIError(400, "runtime adapter loading is off (start with --allow-runtime-lora)")
        manager = engine.pipeline.manager
        if manager is None or not await on_engine(lambda: manager.is_lora(body.lora_name)):
            raise APIError(400, f"no adapter named {body.lora_name!r} is loaded", param="lora_name")
        await on_engine(lambda: manager.unload_adapter(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if not engine_loop().alive:
            return PlainTextResponse("engine stopped", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST
        )

    return app


def run_server(
    app: FastAPI, *, host: str, port: int, grace: float, log_level: str = "info"
) -> None:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM. On the signal the server stops
    accepting; requests in flight get ``grace`` seconds to finish, then are aborted, so each
    one's response still ends properly (``finish_reason`` ``"abort"``, and a stream's usage
    chunk and ``[DONE]``); the process then exits."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                loop: EngineLoop | None = getattr(app.state, "engine_loop", None)
                if loop is not None:
                    timer = threading.Timer(grace, lambda: loop.call(loop.abort_all))
                    timer.daemon = True
                    timer.start()
            super().handle_exit(sig, frame)

    # the responses cut off at `grace` need a moment to be written before uvicorn closes them
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace + 5
    )
    _Server(config).run()


__all__ = ["APIError", "EngineLoop", "Metrics", "ServerConfig", "create_app", "run_server"]
