"""What a completions or chat body asks of the engine: its :class:`~lora_graph.engine.
SamplingParams` (OpenAI's defaults for what it leaves out), its logprob counts, ``best_of``,
its stop strings, and its grammar (:class:`Grammars`, compiled off the event loop)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lora_graph.engine import LLMEngine, SamplingParams
from lora_graph.grammar import GrammarCompiler, GrammarError
from lora_graph.requests import MAX_LOGPROBS, MIN_TEMPERATURE
from lora_graph.server.protocol import APIError, ChatBody
from lora_graph.server.tools import call_schema

log = logging.getLogger(__name__)


def stops_of(body: Any) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
    return stops


def response_format(fmt: dict[str, Any]) -> tuple[str, Any]:
    """OpenAI's ``response_format`` as ``(compiler method, argument)``.

    Raises:
        APIError: 400 for another ``type`` or a ``json_schema`` without its ``schema``.
    """
    kind = fmt.get("type")
    if kind == "json_object":
        return "json", None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400, "response_format json_schema needs json_schema.schema (an object)",
                param="response_format",
            )  # fmt: skip
        return "json_schema", schema
    raise APIError(
        400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )  # fmt: skip


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) as the engine's pairs.

    Raises:
        APIError: 400 for a key that is not a token id.
    """
    out = []
    for key, value in (bias or {}).items():
        if not key.strip().lstrip("-").isdigit():
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias"
            )
        out.append((int(key), value))
    return tuple(out)


def sampling_of(
    body: Any, max_tokens: int | None, default_max_tokens: int, grammar: Any = None
) -> SamplingParams:
    """The request's sampling parameters, validated (400 naming the first bad one);
    a field left out (or null) takes OpenAI's default. ``max_tokens`` None: the
    server's ``default_max_tokens``.

    Raises:
        APIError: 400 naming the first bad field.
    """
    n = 1 if body.n is None else body.n
    if not 1 <= n <= 16:
        raise APIError(400, f"n must be in [1, 16], got {n}", param="n")
    limit = max_tokens_name(body)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{limit} must be at least 1, got {max_tokens}", param=limit)
    top_k = 0 if body.top_k in (None, -1) else body.top_k  # vLLM's -1: every token
    logprobs, prompt_logprobs = logprobs_of(body)
    temperature = 1.0 if body.temperature is None else body.temperature
    if 0 < temperature < MIN_TEMPERATURE:  # vLLM's rule (AutoGen sends 1e-5): raised to it
        log.warning("temperature %g raised to %g (below it sampling is unstable)",
                    temperature, MIN_TEMPERATURE)  # fmt: skip
        temperature = MIN_TEMPERATURE
    seed = body.seed  # vLLM takes any 64-bit integer, -1 as no seed; another negative wraps
    if seed == -1:
        seed = None
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise APIError(400, f"seed must be an integer in [-2**63, 2**64), got {seed}", param="seed")
    if seed is not None and seed < 0:
        seed %= 2**64
    s = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=logit_bias(body.logit_bias),
        min_tokens=body.min_tokens or 0,
        min_p=body.min_p or 0.0,
        grammar=grammar,
    )
    try:
        s.validate()
    except ValueError as e:
        message = str(e).replace("max_new_tokens", limit)  # (the body's name)
        raise APIError(400, message, param=field_of(str(e), body)) from e
    return s


def field_of(message: str, body: Any) -> str | None:
    """The request field an engine refusal names first (its message starts with the
    engine's name for it: ``stop_token_ids must be in ...``), as ``body`` spells it (on
    chat, ``messages`` for the prompt and ``top_logprobs`` for ``logprobs``); None if the
    message names no field of ``body``."""
    name = message.split(" ", 1)[0].split("'", 1)[0]
    chat = {"prompt": "messages", "logprobs": "top_logprobs"} if hasattr(body, "messages") else {}
    name = {"max_new_tokens": max_tokens_name(body), **chat}.get(name, name)
    return name if hasattr(body, name) else None


def max_tokens_name(body: Any) -> str:
    """The field a body gave its token limit in: chat's ``max_completion_tokens`` when it
    came alone, else ``max_tokens``."""
    alone = getattr(body, "max_tokens", None) is None
    return (
        "max_completion_tokens"
        if alone and getattr(body, "max_completion_tokens", None) is not None
        else "max_tokens"
    )


def logprobs_of(body: Any) -> tuple[int | None, int | None]:
    """``(logprobs, prompt_logprobs)`` the engine computes for a body: completions'
    ``logprobs: k``, chat's ``logprobs: true`` with ``top_logprobs: k``; with
    completions' ``echo`` the prompt's too; vLLM's ``prompt_logprobs: k``.

    Raises:
        APIError: 400 for a count outside [0, 20], or chat's ``top_logprobs`` without
            ``logprobs``.
    """
    chat = isinstance(body, ChatBody)
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs: true", param="top_logprobs"
            )  # fmt: skip
        k = (body.top_logprobs or 0) if body.logprobs else None
    else:
        k = body.logprobs
    name = "top_logprobs" if chat else "logprobs"
    for field_name, value in ((name, k), ("prompt_logprobs", body.prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(
                400, f"{field_name} must be in [0, {MAX_LOGPROBS}], got {value}",
                param=field_name,
            )  # fmt: skip
    prompt = body.prompt_logprobs
    if not chat and body.echo and k is not None:
        prompt = k if prompt is None else max(k, prompt)
    return k, prompt


def check_best_of(body: Any, best_of: int) -> None:
    """Refuse a ``best_of`` below ``n``, above 16, or with ``stream``.

    Raises:
        APIError: 400 naming ``best_of``.
    """
    n = body.n or 1
    if not n <= best_of <= 16:
        raise APIError(
            400, f"best_of must be in [n, 16] (n is {n}), got {best_of}", param="best_of"
        )
    if body.stream:
        raise APIError(
            400, "best_of cannot be streamed: its choices are picked once all are done",
            param="best_of",
        )  # fmt: skip


class Grammars:
    """The server's grammar compiler for one tokenizer and engine, built at the first
    structured request (xgrammar's import and tokenizer scan take a moment)."""

    def __init__(self, tokenizer: Any, engine: LLMEngine) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self._compiler: GrammarCompiler | None = None

    async def of(self, body: Any, tool_mode: str | None = None) -> Any:
        """The compiled grammar a body asks for (None: free output): ``response_format``
        ``json_object`` / ``json_schema``, or vLLM's ``guided_json``, ``guided_regex``,
        ``guided_choice``, ``guided_grammar`` (one of them). Compiled on a worker thread,
        so a long schema never stalls other requests or the engine.

        Raises:
            APIError: 400 for two of them, a malformed ``response_format``, or a grammar
                the library refuses (its cause named); 400 without xgrammar installed.
        """
        asked = []
        fmt = body.response_format
        if fmt is not None and fmt.get("type") != "text":
            asked.append(("response_format", response_format(fmt)))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "ebnf")):  # fmt: skip
            if getattr(body, name) is not None:
                asked.append((name, (kind, getattr(body, name))))
        if tool_mode not in (None, "none", "auto"):  # one call, its arguments by its schema
            asked.append(("tool_choice", ("json_schema", call_schema(body.tools, tool_mode))))
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(
                400, f"give one of {' and '.join(n for n, _ in asked)}, not both",
                param=asked[1][0],
            )  # fmt: skip
        name, (kind, spec) = asked[0]
        try:
            compiler = await asyncio.to_thread(self.compiler)
            return await asyncio.to_thread(
                getattr(compiler, kind), *(() if spec is None else (spec,))
            )
        except ImportError as e:
            raise APIError(
                400, "structured output needs xgrammar: pip install 'lora_graph[serve]'",
                param=name,
            ) from e  # fmt: skip
        except GrammarError as e:
            raise APIError(400, str(e), param=name) from e

    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # (a race builds two: the same, harmless)
            self._compiler = GrammarCompiler(
                self.tokenizer, self.engine.vocab_size, sorted(self.engine.eos_token_ids)
            )
        return self._compiler
