"""The handlers of the server's routes (:class:`OpenAIServing`): completions and chat
(whole or streamed), embeddings, the model list, and runtime adapter loads and unloads.
Each takes a parsed body, talks to the engine only through its
:class:`~lora_graph.server.engine_loop.EngineLoop`, and returns a response or raises
:class:`~lora_graph.server.protocol.APIError`; none needs uvicorn to be tested."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event

from lora_graph.config import ADAPTER_NAME, AdapterError
from lora_graph.engine import LLMEngine, Request, RequestOutput, SamplingParams, check_text
from lora_graph.server.choices import Choice
from lora_graph.server.config import ServerConfig
from lora_graph.server.engine_loop import EngineLoop, Watcher
from lora_graph.server.metrics import Metrics
from lora_graph.server.protocol import (
    APIError,
    ChatBody,
    ClientGone,
    CompletionBody,
    EmbeddingBody,
    LoadBody,
    UnloadBody,
)
from lora_graph.server.security import path_under


def _text_or_400(text: str, what: str, param: str) -> None:
    try:
        check_text(text, what)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


def _stops_of(body: Any) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
    return stops


def _sse(data: Any) -> bytes:  # FastAPI's SSE wire format
    return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data))


class _Generation:
    """One completion or chat request in flight: its choices, the queue their engine
    events arrive on, and how its answer is shaped."""

    def __init__(self, serving: OpenAIServing, http: HTTPRequest, body: Any, chat: bool) -> None:
        self.serving = serving
        self.http = http
        self.body = body
        self.chat = chat
        self.choices: list[Choice] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_len = 0
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self._checked = time.monotonic()

    async def next_event(self) -> tuple[int, str, Any]:
        """The next ``(choice index, "token" | "finish", value)``; raises
        :class:`ClientGone` if the client went away (checked at least every half second,
        also while tokens keep coming)."""
        while True:
            now = time.monotonic()
            if now - self._checked >= 0.5:
                self._checked = now
                if await self.http.is_disconnected():
                    raise ClientGone
            try:
                return await asyncio.wait_for(self.events.get(), timeout=0.5)
            except TimeoutError:
                continue

    def advance(self, choice: Choice, event: str, value: Any) -> str:
        """Apply one event to ``choice``; return the text it newly emits."""
        if event == "token":
            self.serving.metrics.generation_tokens.inc()
            return choice.on_token(value, self.serving.tokenizer)
        return choice.on_finish(value, self.serving.tokenizer)

    def piece(self, c: Choice, text: str, first: bool = False) -> dict[str, Any]:
        finish = c.finish_reason if c.done else None
        out: dict[str, Any] = {"index": c.index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            out["delta"] = {"content": text}
            if first:
                out["delta"]["role"] = "assistant"
        else:
            out["text"] = text
        return out

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.tokens) for c in self.choices)
        return {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": completion,
            "total_tokens": self.prompt_len + completion,
        }

    def envelope(self, kind: str, choices: list[dict], usage: dict | None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
        }
        if usage is not None:
            data["usage"] = usage
        return data

    async def whole(self) -> Response:
        """Wait for every choice; the whole answer (499, unread, if the client left)."""
        try:
            while not all(c.done for c in self.choices):
                index, event, value = await self.next_event()
                c = self.choices[index]
                if not c.done:
                    self.advance(c, event, value)
                    if c.done:  # a stop string: the engine request is no longer needed
                        self.serving.abort([c])
        except ClientGone:
            self.serving.abort(self.choices)
            return Response(status_code=499)  # (nginx's "client closed request"; unread)
        except asyncio.CancelledError:
            self.serving.abort(self.choices)
            raise
        out = [self.piece(c, c.text) for c in self.choices]
        if self.chat:  # a whole answer is a message, not a delta
            for o in out:
                o["message"] = {"role": "assistant", "content": o.pop("delta")["content"]}
        kind = "chat.completion" if self.chat else "text_completion"
        return JSONResponse(self.envelope(kind, out, self.usage()))

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent chunks as tokens arrive; then (only when the request asked for it,
        as OpenAI and vLLM: a client reading ``chunk.choices[0]`` would fail on it) a usage
        chunk with no choices; then ``[DONE]``. An error is an error event, then
        ``[DONE]``."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        options = self.body.stream_options
        try:
            if self.chat:
                for c in self.choices:
                    yield _sse(self.envelope(kind, [self.piece(c, "", first=True)], None))
            while not all(c.done for c in self.choices):
                index, event, value = await self.next_event()
                c = self.choices[index]
                if c.done:
                    continue
                try:
                    text = self.advance(c, event, value)
                except APIError as e:
                    yield _sse(e.body())  # an error event, then the stream ends as usual
                    self.serving.abort(self.choices)
                    yield _sse("[DONE]")
                    return
                if c.done and event == "token":  # a stop string ended it
                    self.serving.abort([c])
                if text or c.done:
                    yield _sse(self.envelope(kind, [self.piece(c, text)], None))
            if options is not None and options.include_usage:
                yield _sse(self.envelope(kind, [], self.usage()))
            yield _sse("[DONE]")
        except ClientGone:
            self.serving.abort(self.choices)  # (the stream just ends: nobody reads it)
        except (asyncio.CancelledError, GeneratorExit):
            self.serving.abort(self.choices)
            raise


class OpenAIServing:
    """Every route's handler over one engine.

    Args:
        engine: the engine (used only on the engine thread, through ``loop``).
        tokenizer: the model's tokenizer (text in and out, the chat template).
        config: what the server serves and allows.
        metrics: where requests and tokens are counted.
        loop: the running :class:`EngineLoop` (it starts with the app).
    """

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: Any,
        config: ServerConfig,
        metrics: Metrics,
        loop: Callable[[], EngineLoop],
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.loop = loop
        self.loading: set[str] = set()  # adapter names being read by a runtime load

    async def on_engine(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between two steps; its result."""
        return await asyncio.wrap_future(self.loop().call(fn))

    def abort(self, choices: list[Choice]) -> None:
        """Abort the engine requests of ``choices`` that have not finished."""
        pending = [c.request_id for c in choices if not c.engine_done]
        loop = self.loop()
        if pending and loop.alive:

            def abort() -> None:
                for request_id in pending:
                    loop.abort(request_id)

            loop.call(abort)

    # ---- checks -------------------------------------------------------------------------
    def adapter_of(self, model: str) -> str | None:
        """The adapter ``model`` names (None: the base model).

        Raises:
            APIError: 400 naming what is served, for any other name.
        """
        if model == self.config.model_name:
            return None
        if not self.engine.is_lora(model):
            known = [self.config.model_name, *self.engine.list_loras()]
            raise APIError(
                400, f"the model {model!r} does not exist (served: {', '.join(known)})",
                param="model",
            )  # fmt: skip
        return model

    def sampling_of(self, body: Any, max_tokens: int | None) -> SamplingParams:
        """The request's sampling parameters, validated (400 naming the first bad one)."""
        if body.logprobs not in (None, False) or getattr(body, "top_logprobs", None):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if not 1 <= body.n <= 16:
            raise APIError(400, f"n must be in [1, 16], got {body.n}", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
            )
        s = SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else self.config.default_max_tokens,
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

    def _generates(self) -> None:
        if self.engine.is_encoder:
            raise APIError(
                400, f"the model {self.config.model_name!r} is an encoder; use /v1/embeddings",
                param="model",
            )  # fmt: skip

    # ---- generation ---------------------------------------------------------------------
    async def _submit(
        self, gen: _Generation, prompt_ids: list[int], adapter: str | None, sampling: Any
    ) -> None:
        """Queue the generation's ``n`` engine requests; their events arrive on its queue
        as ``(choice index, "token", id)`` and ``(choice index, "finish", RequestOutput)``.

        Raises:
            APIError: 400 if the engine refuses a request (none is then served), 503 if the
                engine is not running.
        """
        aloop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        stops = _stops_of(gen.body)
        n = gen.body.n
        gen.choices = [Choice(i, f"{base}-{i}", stops) for i in range(n)]
        gen.prompt_len = len(prompt_ids)

        def put(item: Any) -> None:
            aloop.call_soon_threadsafe(gen.events.put_nowait, item)

        def finished(c: Choice, out: RequestOutput) -> None:  # engine thread
            c.engine_done = True
            if c.refused:
                return
            # a stop string ends a choice by aborting its engine request: count it a stop
            stopped = out.error == "aborted" and c.finish_reason == "stop"
            self.metrics.observe_finished(out, "stop" if stopped else None)
            put((c.index, "finish", out))

        def submit_all() -> None:
            loop = self.loop()
            submitted: list[str] = []
            try:
                for c in gen.choices:
                    s = sampling
                    if n > 1 and sampling.seed is not None:  # choice i draws with seed + i
                        s = SamplingParams(
                            **{**sampling.__dict__, "seed": (sampling.seed + c.index) % 2**64}
                        )
                    watcher = Watcher(
                        functools.partial(lambda i, t: put((i, "token", t)), c.index),
                        functools.partial(finished, c),
                    )
                    loop.submit(Request(c.request_id, list(prompt_ids), adapter, s), watcher)
                    submitted.append(c.request_id)
            except ValueError:
                for c in gen.choices:
                    c.refused = True  # not counted as served requests
                for request_id in submitted:
                    loop.abort(request_id)
                raise
            self.metrics.prompt_tokens.inc(len(prompt_ids) * n)

        try:
            await self.on_engine(submit_all)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except RuntimeError as e:
            raise APIError(503, str(e)) from e

    async def _generate(
        self,
        http: HTTPRequest,
        body: Any,
        prompt_ids: list[int],
        max_tokens: int | None,
        chat: bool,
    ) -> Any:
        limit = self.engine.max_seq_len
        if len(prompt_ids) >= limit:  # (a text prompt is read up to 64 characters a position)
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens or more; at most {limit - 1} fit "
                "(max_seq_len)",
                param="messages" if chat else "prompt",
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        adapter = self.adapter_of(body.model)
        sampling = self.sampling_of(body, max_tokens)
        gen = _Generation(self, http, body, chat)
        await self._submit(gen, prompt_ids, adapter, sampling)
        if not body.stream:
            return await gen.whole()
        return EventSourceResponse(gen.stream())

    # ---- routes -------------------------------------------------------------------------
    async def completions(self, http: HTTPRequest, body: CompletionBody) -> Any:
        """``POST /v1/completions``: ``prompt`` as text or token ids."""
        self._generates()
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if not isinstance(body.prompt, str):
            return await self._generate(http, body, list(body.prompt), body.max_tokens, False)
        _text_or_400(body.prompt, "prompt", "prompt")
        text = body.prompt[: 64 * self.engine.max_seq_len]
        try:  # off the event loop: a long prompt must not stall other connections
            prompt_ids = await asyncio.to_thread(lambda: self.tokenizer(text)["input_ids"])
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
            raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from e
        return await self._generate(http, body, prompt_ids, body.max_tokens, False)

    async def chat(self, http: HTTPRequest, body: ChatBody) -> Any:
        """``POST /v1/chat/completions``: the messages through the chat template."""
        self._generates()
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(
                400,
                f"the model {self.config.model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        messages = [m.template_dict() for m in body.messages]
        for i, m in enumerate(messages):
            for key, value in m.items():
                _text_or_400(value, f"messages[{i}].{key}", "messages")
        try:
            prompt_ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise APIError(400, f"the chat template refused the messages: {e}") from e
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        return await self._generate(http, body, list(prompt_ids), max_tokens, True)

    async def embeddings(self, body: EmbeddingBody) -> dict[str, Any]:
        """``POST /v1/embeddings``: sentence embeddings of an encoder
        (``lora_graph/models/bert.py``), each input under the adapter ``model`` names;
        ``encoding_format`` ``"base64"`` is the float32 vector's little-endian bytes (what
        the ``openai`` client asks for by default)."""
        if not self.engine.is_encoder:
            raise APIError(
                400, f"the model {self.config.model_name!r} does not serve embeddings (an "
                "encoder does: bert)", param="model",
            )  # fmt: skip
        adapter = self.adapter_of(body.model)
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported", param="dimensions")
        rows = await self._embedding_rows(body.input)
        try:
            vectors = await self.on_engine(
                lambda: self.engine.embed([(ids, adapter) for ids in rows])
            )
        except ValueError as e:
            raise APIError(400, str(e).replace("row ", "input ", 1), param="input") from e
        tokens = sum(len(ids) for ids in rows)
        self.metrics.prompt_tokens.inc(tokens)
        data = []
        for i, v in enumerate(vectors):
            vec: Any = v.tolist()
            if body.encoding_format == "base64":
                vec = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": vec})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    async def _embedding_rows(self, raw: Any) -> list[list[int]]:
        """The token ids of each input (a text, texts, token ids, lists of token ids)."""
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]  # one text, or one list of token ids
        if not raw:
            raise APIError(400, "input is empty", param="input")
        for i, x in enumerate(raw):
            if isinstance(x, str):
                _text_or_400(x, f"input {i}" if len(raw) > 1 else "input", "input")
        try:  # off the event loop
            return await asyncio.to_thread(
                lambda: [x if isinstance(x, list) else self.tokenizer(x)["input_ids"] for x in raw]
            )
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
            raise APIError(400, f"the input cannot be tokenized: {e}", param="input") from e

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the base model, then every loaded adapter (its parent)."""
        names = await self.on_engine(self.engine.list_loras)
        created = int(time.time())
        base = self.config.model_name
        parents = {base: None, **dict.fromkeys(names, base)}
        data = [
            {"id": n, "object": "model", "created": created, "owned_by": "lora_graph",
             "root": n, "parent": parent}
            for n, parent in parents.items()
        ]  # fmt: skip
        return {"object": "list", "data": data}

    def _check_load(self, body: LoadBody) -> None:
        """Refuse a runtime load that is off, unnamed, or outside ``--lora-root``."""
        if not self.config.allow_runtime_lora:
            raise APIError(400, "runtime adapter loading is off (start with --allow-runtime-lora)")
        if not self.engine.supports_lora:
            raise APIError(400, "this server was started without LoRA support")
        if body.lora_name == self.config.model_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        if not ADAPTER_NAME.fullmatch(body.lora_name):
            raise APIError(
                400,
                f"lora_name {body.lora_name[:80]!r} must be 1-64 letters, digits, '.', '_' or '-'",
                param="lora_name",
            )
        if not path_under(body.lora_path, self.config.lora_roots):
            raise APIError(
                400,
                f"lora_path {body.lora_path!r} is not under an allowed --lora-root",
                param="lora_path",
            )
        if body.lora_name in self.loading:
            raise APIError(
                400, f"an adapter named {body.lora_name!r} is being loaded", param="lora_name"
            )

    async def load_lora(self, body: LoadBody) -> PlainTextResponse:
        """``POST /v1/load_lora_adapter`` (vLLM's payload): the files are read on a worker
        thread while the engine keeps stepping; the name check and the add run as one
        step on the engine thread, so of concurrent loads of one name one succeeds."""
        self._check_load(body)
        name = body.lora_name
        taken = APIError(
            400, f"an adapter named {name!r} is already loaded; unload it first", param="lora_name"
        )
        engine = self.engine

        def add(read: Any) -> Any:  # on the engine thread: checked and added as one
            if engine.is_lora(name):
                raise taken
            return engine.add_lora(read)

        self.loading.add(name)  # (no await since the check above: one load of a name at a time)
        start = time.perf_counter()
        try:
            if await self.on_engine(lambda: engine.is_lora(name)):
                raise taken  # before its files are read
            read = await asyncio.to_thread(engine.read_lora, body.lora_path, name=name)
            status = await self.on_engine(lambda: add(read))
        except (AdapterError, ValueError, OSError) as e:
            message = str(e)
            if not message.startswith(f"adapter {name!r}"):
                message = f"adapter {name!r}: {message}"
            raise APIError(400, message) from e
        finally:
            self.loading.discard(name)
        self.metrics.adapter_load.observe(time.perf_counter() - start)
        return PlainTextResponse(
            f"Success: LoRA adapter '{name}' added successfully ({status.name.lower()})."
        )

    async def unload_lora(self, body: UnloadBody) -> PlainTextResponse:
        """``POST /v1/unload_lora_adapter``: requests running on it finish on it; requests
        queued for it are answered 400."""
        if not self.config.allow_runtime_lora:
            raise APIError(400, "runtime adapter loading is off (start with --allow-runtime-lora)")
        name = body.lora_name
        if not await self.on_engine(lambda: self.engine.is_lora(name)):
            raise APIError(400, f"no adapter named {name!r} is loaded", param="lora_name")
        await self.on_engine(lambda: self.engine.remove_lora(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def health(self) -> PlainTextResponse:
        """``GET /health``: 200 while the engine thread runs, else 503."""
        if not self.loop().alive:
            return PlainTextResponse("engine stopped", status_code=503)
        return PlainTextResponse("ok")
