"""The handlers of the server's routes (:class:`OpenAIServing`): completions and chat
(whole or streamed), embeddings, the model list, and runtime adapter loads and unloads.
Each takes a parsed body, talks to the engine only through its
:class:`~lora_graph.server.engine_loop.EngineLoop`, and returns a response or raises
:class:`~lora_graph.server.protocol.APIError`; none needs uvicorn to be tested."""

from __future__ import annotations

import asyncio
import base64
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import PlainTextResponse
from fastapi.sse import EventSourceResponse

from lora_graph.config import ADAPTER_NAME, AdapterError
from lora_graph.detokenize import Detokenizer
from lora_graph.engine import LLMEngine, Request, RequestOutput, check_text
from lora_graph.server.choices import Choice
from lora_graph.server.config import ServerConfig
from lora_graph.server.engine_loop import EngineLoop, EngineStopped, Watcher
from lora_graph.server.fields import CHAT, COMPLETIONS, check_extras, check_fields
from lora_graph.server.generation import Generation
from lora_graph.server.metrics import Metrics
from lora_graph.server.protocol import (
    APIError,
    ChatBody,
    ChatMessage,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    LoadBody,
    TokenizeBody,
    UnloadBody,
)
from lora_graph.server.sampling import (
    Grammars,
    check_best_of,
    field_of,
    logprobs_of,
    sampling_of,
    stops_of,
)
from lora_graph.server.security import path_under
from lora_graph.server.tools import check_tools


def _text_or_400(text: str, what: str, param: str) -> None:
    try:
        check_text(text, what)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


ROLES = ("system", "developer", "user", "assistant", "tool")


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
        self.grammars = Grammars(tokenizer, engine)

    async def on_engine(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between two steps; its result.

        Raises:
            APIError: 503 if the engine is not running (every route answers alike).
        """
        try:
            return await asyncio.wrap_future(self.loop().call(fn))
        except EngineStopped as e:
            raise APIError(503, str(e)) from e

    def check_running(self) -> None:
        """Raises APIError 503 if the engine is not running (routes that do not call it)."""
        if not self.loop().alive:
            raise APIError(503, "the engine is not running")

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
            APIError: 404 ``model_not_found`` naming what is served, for any other name
                (OpenAI's and vLLM's answer).
        """
        if model == self.config.model_name:
            return None
        if not self.engine.is_lora(model):
            known = [self.config.model_name, *self.engine.list_loras()]
            raise APIError(
                404, f"the model {model!r} does not exist (served: {', '.join(known)})",
                param="model", code="model_not_found",
            )  # fmt: skip
        return model

    def _generates(self) -> None:
        if self.engine.is_encoder:
            raise APIError(
                400, f"the model {self.config.model_name!r} is an encoder; use /v1/embeddings",
                param="model",
            )  # fmt: skip

    # ---- generation ---------------------------------------------------------------------
    async def _submit(
        self, gen: Generation, prompts: list[list[int]], adapter: str | None, sampling: list[Any]
    ) -> None:
        """Queue the generation's engine requests, ``n`` a prompt (``sampling[p]`` for
        prompt ``p``); their events arrive on its queue as ``(choice index, "token", id)``
        and ``(choice index, "finish", RequestOutput)``; choice ``p * n + i`` is prompt
        ``p``'s ``i``-th (OpenAI's order).

        Raises:
            APIError: 400 if the engine refuses a request (none is then served), 503 if the
                engine is not running.
        """
        aloop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        stops = stops_of(gen.body)
        skip_special = gen.body.skip_special_tokens is not False  # (None: vLLM's true)
        include_stop = bool(gen.body.include_stop_str_in_output)
        n = gen.n

        def choice(i: int) -> Choice:
            s = sampling[i // n]
            detok = Detokenizer(self.tokenizer, prompts[i // n], skip_special)
            ends = s.stop_tokens(self.engine.eos_token_ids)
            return Choice(i, f"{base}-{i}", stops, detok, ends, s.min_tokens, include_stop)

        gen.choices = [choice(i) for i in range(n * len(prompts))]
        gen.prompts = prompts

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
                    p, i = divmod(c.index, n)
                    s = sampling[p]
                    if n > 1 and s.seed is not None:  # choice i draws with seed + i
                        s = replace(s, seed=(s.seed + i) % 2**64)
                    watcher = Watcher(
                        functools.partial(lambda i, *t: put((i, "token", t)), c.index),
                        functools.partial(finished, c),
                    )
                    request = Request(c.request_id, list(prompts[p]), adapter, s,
                                      cache_salt=gen.body.cache_salt)  # fmt: skip
                    loop.submit(request, watcher)
                    submitted.append(c.request_id)
            except ValueError:
                for c in gen.choices:
                    c.refused = True  # not counted as served requests
                for request_id in submitted:
                    loop.abort(request_id)
                raise
            self.metrics.prompt_tokens.inc(sum(map(len, prompts)) * n)

        try:
            await self.on_engine(submit_all)
        except ValueError as e:
            raise APIError(400, str(e), param=field_of(str(e), gen.body)) from e
        except RuntimeError as e:
            raise APIError(503, str(e)) from e

    async def _generate(
        self,
        http: HTTPRequest,
        body: Any,
        prompts: list[list[int]],
        max_tokens: int | None,
        chat: bool,
        prompt_texts: list[str | None] | None = None,
        tool_mode: str | None = None,
    ) -> Any:
        """Serve ``prompts`` (one for chat; ``prompt_texts`` as given, for ``echo``);
        ``max_tokens`` None: the server's default on completions, up to the context on
        chat (OpenAI's and vLLM's defaults)."""
        limit, vocab = self.engine.max_seq_len, self.engine.vocab_size
        where = "messages" if chat else "prompt"
        for k, ids in enumerate(prompts):
            which = f"{where}[{k}]" if len(prompts) > 1 else "the prompt"
            if not ids:
                raise APIError(400, f"{which} is empty (no tokens)", param=where)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:  # (before anything decodes them)
                raise APIError(
                    400, f"{which}'s token ids must be in [0, {vocab}), got {bad}", param=where
                )
            if len(ids) >= limit:  # (a text prompt is read up to 64 characters a position)
                which += " (the messages through the chat template)" if chat else ""
                raise APIError(
                    400,
                    f"{which} has {len(ids)} tokens or more; at most {limit - 1} fit (max_seq_len)",
                    param=where,
                )
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        adapter = self.adapter_of(body.model)
        grammar = await self.grammars.of(body, tool_mode)
        # vLLM's prompt scoring: echo with max_tokens 0 returns the prompt (and its
        # logprobs) alone; one token is generated and dropped
        echo_only = not chat and bool(body.echo) and max_tokens == 0
        if echo_only:
            max_tokens = 1
        sampling = [
            sampling_of(
                body,
                max_tokens if max_tokens is not None or not chat else limit - len(ids),
                self.config.default_max_tokens,
                grammar,
            )
            for ids in prompts
        ]
        gen = Generation(self, http, body, chat)
        gen.tool_mode = tool_mode
        gen.n = gen.returned = body.n or 1
        best_of = None if chat else body.best_of
        if best_of is not None and best_of != gen.n:
            check_best_of(body, best_of)
            gen.n = best_of  # sampled; the `returned` of each prompt's with the best sum kept
            # every candidate reports its tokens' logprobs, for the ranking
            sampling = [replace(s, logprobs=s.logprobs or 0) for s in sampling]
        gen.logprobs, gen.prompt_logprobs = logprobs_of(body)
        gen.echo_only = echo_only
        if not chat and body.echo:
            gen.echo = True
            if gen.prompt_logprobs is not None and body.prompt_logprobs is None:
                gen.prompt_logprobs = None  # (asked through echo: not vLLM's field)
        gen.prompt_texts = prompt_texts or [None] * len(prompts)
        await self._submit(gen, prompts, adapter, sampling)
        if not body.stream:
            return await gen.whole()
        return EventSourceResponse(gen.stream())

    async def _tokenize(
        self, text: str, param: str, add_special_tokens: bool, *, whole: bool = False
    ) -> list[int]:
        """Token ids of ``text`` (off the event loop: a long text must not stall other
        connections). Unless ``whole``, read 64 characters a position past ``max_seq_len``
        first: if those are already too many tokens, the length check refuses them ("N
        tokens or more"); if not (tokens that long: runs of spaces or symbols), all of it.

        Raises:
            APIError: 400 for text no tokenizer can encode.
        """
        _text_or_400(text, param, param.split("[", 1)[0])

        def ids_of(part: str) -> list[int]:
            return list(self.tokenizer(part, add_special_tokens=add_special_tokens)["input_ids"])

        cut = text if whole else text[: 64 * self.engine.max_seq_len]
        try:
            ids = await asyncio.to_thread(ids_of, cut)
            if len(cut) < len(text) and len(ids) < self.engine.max_seq_len:
                ids = await asyncio.to_thread(ids_of, text)  # (it was cut silently before)
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
            raise APIError(400, f"{param} cannot be tokenized: {e}", param=param) from e
        return ids

    async def _prompts_of(self, body: CompletionBody) -> tuple[list[list[int]], list[str | None]]:
        """A completions ``prompt`` as token ids (text, token ids, or a list of either),
        and each prompt's text as given (None for token ids)."""
        raw: Any = body.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise APIError(400, "prompt is empty", param="prompt")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        out = []
        for k, p in enumerate(raw):
            where = f"prompt[{k}]" if len(raw) > 1 else "prompt"
            out.append(list(p) if isinstance(p, list) else await self._tokenize(p, where, add))
        return out, [p if isinstance(p, str) else None for p in raw]

    # ---- routes -------------------------------------------------------------------------
    async def completions(self, http: HTTPRequest, body: CompletionBody) -> Any:
        """``POST /v1/completions``: ``prompt`` as text or token ids, or a list of either
        (one choice set each)."""
        check_fields(body, COMPLETIONS, strict=self.config.strict_fields)
        self._generates()
        prompts, texts = await self._prompts_of(body)
        return await self._generate(http, body, prompts, body.max_tokens, False, texts)

    def _messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as the chat template sees them (text parts joined).

        Raises:
            APIError: 400 naming a message of an unknown role, a non-text part, content
                missing from a message that needs it, or text no tokenizer can encode.
        """
        out = []
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise APIError(
                    400, f"messages[{i}].role {m.role[:40]!r} is not one of {', '.join(ROLES)}",
                    param="messages",
                )  # fmt: skip
            content = m.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(
                            400, f"messages[{i}].content[{j}] is a {part.type[:40]!r} part; "
                            "this model takes text parts only", param="messages",
                        )  # fmt: skip
                content = "".join(part.text or "" for part in content)
            if content is None and m.role != "assistant" and m.role != "tool":
                raise APIError(
                    400, f"messages[{i}].content is missing or null; only an assistant's "
                    "message may leave it out", param="messages",
                )  # fmt: skip
            d: dict[str, Any] = {"role": m.role, "content": content or ""}
            for key in ("name", "tool_call_id"):
                if getattr(m, key) is not None:
                    d[key] = getattr(m, key)
            if m.tool_calls is not None:
                d["tool_calls"] = m.tool_calls
            for key, value in d.items():
                if isinstance(value, str):
                    _text_or_400(value, f"messages[{i}].{key}", "messages")
            out.append(d)
        return out

    def _template(self) -> str:
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise APIError(
                400,
                f"the model {self.config.model_name!r} has no chat template; use /v1/completions "
                "or start the server with --chat-template FILE",
                param="messages",
            )
        return template

    async def _render(self, body: Any, *, whole: bool = False) -> list[int]:
        """The chat prompt's token ids: the messages through the template, with
        ``add_generation_prompt`` / ``continue_final_message`` / ``chat_template_kwargs``
        (vLLM's), tokenized with ``add_special_tokens`` (default false: the template has
        them); ``whole``: see :meth:`_tokenize`."""
        template = self._template()
        messages = self._messages(body.messages)
        add_generation = body.add_generation_prompt
        cont = bool(body.continue_final_message)
        if cont and add_generation:
            raise APIError(
                400, "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )  # fmt: skip
        if cont and (not messages or messages[-1]["role"] != "assistant"):
            raise APIError(
                400, "continue_final_message needs a final assistant message to continue",
                param="continue_final_message",
            )  # fmt: skip
        kwargs = dict(body.chat_template_kwargs or {})
        taken = {"add_generation_prompt", "continue_final_message", "messages", "tokenize",
                 "chat_template", "conversation", "tools"} & set(kwargs)  # fmt: skip
        if taken:
            raise APIError(
                400, f"chat_template_kwargs may not set {sorted(taken)[0]!r}",
                param="chat_template_kwargs",
            )  # fmt: skip
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=(not cont) if add_generation is None else add_generation,
                continue_final_message=cont,
                tokenize=False,
                tools=getattr(body, "tools", None) or None,
                **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise APIError(400, f"the chat template refused the messages: {e}") from e
        add = bool(body.add_special_tokens)
        return await self._tokenize(text, "the rendered chat prompt", add, whole=whole)

    async def chat(self, http: HTTPRequest, body: ChatBody) -> Any:
        """``POST /v1/chat/completions``: the messages through the chat template."""
        check_fields(body, CHAT, strict=self.config.strict_fields)
        self._generates()
        tool_mode = None
        if body.tools:
            tool_mode = check_tools(body.tools, body.tool_choice, self._template())
        elif body.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        prompt_ids = await self._render(body)
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        return await self._generate(http, body, [prompt_ids], max_tokens, True, tool_mode=tool_mode)

    async def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        """``POST /tokenize`` (and ``/v1/tokenize``), vLLM's: a ``prompt``'s token ids, or
        chat ``messages`` through the template; ``{"count", "max_model_len", "tokens"}``
        (503 with the engine stopped, as every route but ``/metrics``)."""
        self.check_running()
        check_extras(body, strict=self.config.strict_fields)
        if body.model is not None:
            self.adapter_of(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", param="prompt")
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await self._tokenize(body.prompt, "prompt", add, whole=True)
        else:
            tokens = await self._render(body, whole=True)
        return {"count": len(tokens), "max_model_len": self.engine.max_seq_len, "tokens": tokens}

    async def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        """``POST /detokenize`` (and ``/v1/detokenize``), vLLM's: ``{"prompt": text}``."""
        self.check_running()
        check_extras(body, strict=self.config.strict_fields)
        if body.model is not None:
            self.adapter_of(body.model)
        vocab = self.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

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
        check_extras(body, strict=self.config.strict_fields)
        adapter = self.adapter_of(body.model)
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported", param="dimensions")
        rows = await self._embedding_rows(body.input)
        if body.truncate_prompt_tokens is not None:
            rows = self._truncate(rows, body.truncate_prompt_tokens)
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

    def _truncate(self, rows: list[list[int]], k: int) -> list[list[int]]:
        """vLLM's ``truncate_prompt_tokens``: each input cut to its last ``k`` tokens
        (``-1``: ``max_seq_len``), the tokenizer's special tokens at its ends kept (vLLM
        truncates on the left, then adds them)."""
        limit = self.engine.max_seq_len
        if k == -1:
            k = limit
        if not 1 <= k <= limit:
            raise APIError(
                400, f"truncate_prompt_tokens must be -1 or in [1, {limit}], got {k}",
                param="truncate_prompt_tokens",
            )  # fmt: skip
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        out = []
        for ids in rows:
            if len(ids) <= k:
                out.append(ids)
                continue
            head = 1 if ids and ids[0] in special else 0
            tail = 1 if len(ids) > head and ids[-1] in special else 0
            if head + tail >= k:
                raise APIError(
                    400, f"truncate_prompt_tokens {k} leaves no room for text",
                    param="truncate_prompt_tokens",
                )  # fmt: skip
            body = ids[head : len(ids) - tail]
            out.append(ids[:head] + body[len(body) - (k - head - tail) :] + ids[len(ids) - tail :])
        return out

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

    async def model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}``: one entry of :meth:`models` (404 for another name)."""
        for entry in (await self.models())["data"]:
            if entry["id"] == model_id:
                return entry
        self.adapter_of(model_id)  # raises the 404
        raise AssertionError("unreachable")

    def _check_load(self, body: LoadBody) -> None:
        """Refuse a runtime load that is off, unnamed, or outside ``--lora-root``."""
        check_extras(body, strict=self.config.strict_fields)
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
        check_extras(body, strict=self.config.strict_fields)
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
