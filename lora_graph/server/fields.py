"""The request-field policy, written once: every field of OpenAI's completions and
chat-completions requests and vLLM's extra fields, each with what this server does with it
(:data:`FIELDS`), and :func:`check_fields`, which applies it to a parsed body.

Kinds:

- ``served``: the field does what OpenAI's (or vLLM's) documentation says.
- ``ignored``: metadata that changes nothing in the output (``user``, ``metadata``); any
  well-typed value is accepted.
- ``no-op only``: accepted at the values listed (what the field does when left out);
  another value is a 400 naming the field and why.
- ``refused``: any value but null is a 400 naming the field and why.

A field in no table is ignored with one logged warning per field name, as vLLM does (so a
client built for another server still runs); ``--strict-fields`` (``ServerConfig.
strict_fields``) answers 400 ``unknown field`` instead. Types stay strict either way (a
declared field of the wrong type is a 400)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from lora_graph.server.protocol import APIError

SERVED, IGNORED, NOOP, REFUSED = "served", "ignored", "no-op only", "refused"
COMPLETIONS, CHAT = "completions", "chat"
BOTH = frozenset({COMPLETIONS, CHAT})

log = logging.getLogger("lora_graph.server")


@dataclass(frozen=True)
class Rule:
    """What the server does with one request field.

    Attributes:
        kind: ``served``, ``ignored``, ``no-op only`` or ``refused`` (module docstring).
        doc: what it does here (or why it is refused), one line of the README's table.
        endpoints: the routes whose body has it (``completions``, ``chat``).
        noop: for ``no-op only``, the accepted values.
        vllm: where this differs from vLLM (empty: it does not).
    """

    kind: str
    doc: str
    endpoints: frozenset[str] = BOTH
    noop: tuple[Any, ...] = ()
    vllm: str = ""


def _c(kind: str, doc: str, **kw: Any) -> Rule:
    return Rule(kind, doc, frozenset({COMPLETIONS}), **kw)


def _h(kind: str, doc: str, **kw: Any) -> Rule:
    return Rule(kind, doc, frozenset({CHAT}), **kw)


#: Every known request field of completions and chat, by name (OpenAI's, then vLLM's).
FIELDS: dict[str, Rule] = {
    # ---- OpenAI, both routes ---------------------------------------------------------
    "model": Rule(SERVED, "the base model's served name, or a loaded adapter's (else 404)"),
    "max_tokens": Rule(
        SERVED,
        "tokens to generate at most; left out: 16 on completions (OpenAI's default, "
        "`--default-max-tokens`), up to the context on chat",
    ),
    "temperature": Rule(SERVED, "0 is greedy; below 0.01 (but not 0) raised to 0.01, as vLLM"),
    "top_p": Rule(SERVED, "nucleus sampling, in (0, 1]"),
    "n": Rule(SERVED, "choices per prompt, 1-16; choice i draws with seed + i"),
    "seed": Rule(
        SERVED,
        "the request's own generator: the same seed, the same text; -1 is no seed "
        "(vLLM's), another negative seed (64-bit) wraps mod 2**64",
    ),
    "stop": Rule(
        SERVED,
        "up to 4 strings; the text is cut before the first one found (of several found "
        "in one token, the first listed, as vLLM), or after it with "
        "`include_stop_str_in_output`",
    ),
    "stream": Rule(SERVED, "server-sent events, OpenAI's chunk objects, then `[DONE]`"),
    "stream_options": Rule(SERVED, "`include_usage`: a last chunk with the usage and no choices"),
    "user": Rule(IGNORED, "an end-user id for the caller's own records"),
    "logprobs": Rule(
        SERVED,
        "completions: `k` in 0-20, each token's logprob and the top `k` (and the chosen "
        "token's); chat: `true`, with `top_logprobs`; of the logits the token was drawn from, "
        "after the adapter, before temperature and penalties (vLLM's default)",
    ),
    "presence_penalty": Rule(
        SERVED, "OpenAI's, in [-2, 2]: minus it for each token the output already has"
    ),
    "frequency_penalty": Rule(
        SERVED, "OpenAI's, in [-2, 2]: minus it times each token's count in the output"
    ),
    "logit_bias": Rule(SERVED, "token id (a string key) to a bias in [-100, 100] on its logit"),
    # ---- OpenAI, completions ---------------------------------------------------------
    "prompt": _c(SERVED, "text, token ids, or a list of either (one choice set each)"),
    "echo": _c(
        SERVED,
        "the prompt before the completion; with `logprobs` its tokens' too (the "
        "first `null`), as lm-evaluation-harness reads them",
    ),
    "best_of": _c(
        SERVED,
        "n to 16 candidates a prompt; the `n` with the highest cumulative logprob "
        "returned (TGI's and LoRAX's rule); not with `stream`",
        vllm="vLLM V1 dropped it",
    ),
    "suffix": _c(NOOP, "insertion needs a fill-in-the-middle model", noop=("",)),
    # ---- OpenAI, chat ----------------------------------------------------------------
    "messages": _h(SERVED, "through the model's chat template (or `--chat-template`)"),
    "max_completion_tokens": _h(SERVED, "as `max_tokens` (which wins if both are given)"),
    "top_logprobs": _h(SERVED, "0-20 most likely tokens a position (needs `logprobs: true`)"),
    "response_format": Rule(
        SERVED,
        "`json_object` (any JSON object) or `json_schema` (its `schema`), through "
        "xgrammar; a schema it refuses is a 400 naming why",
    ),
    "tools": _h(
        SERVED,
        "function tools, rendered by the chat template (a template that takes none: "
        "400); calls parsed from the Hermes / Qwen2.5 `<tool_call>` format",
    ),
    "tool_choice": _h(
        SERVED,
        "`none`, `auto` (default with tools), `required` or a named function: those two "
        "through structured output, the arguments following the function's schema",
    ),
    "parallel_tool_calls": _h(IGNORED, "meaningful only with tools"),
    "functions": _h(REFUSED, "deprecated by OpenAI for `tools`; not served"),
    "function_call": _h(REFUSED, "deprecated by OpenAI for `tool_choice`; not served"),
    "store": _h(NOOP, "nothing is stored for distillation or evals here", noop=(False,)),
    "metadata": _h(IGNORED, "tags for stored completions (nothing is stored)"),
    "service_tier": _h(NOOP, "one tier here", noop=("auto", "default")),
    "modalities": _h(NOOP, "text only", noop=(["text"],)),
    "audio": _h(REFUSED, "text only: no audio output"),
    "prediction": _h(REFUSED, "predicted outputs (speculative decoding) are not served"),
    "reasoning_effort": _h(REFUSED, "for reasoning models, which this server does not tune"),
    "verbosity": _h(REFUSED, "for reasoning models, which this server does not tune"),
    "web_search_options": _h(REFUSED, "no web search here"),
    "prompt_cache_key": _h(IGNORED, "a routing hint for OpenAI's prompt cache"),
    "safety_identifier": _h(IGNORED, "an end-user id for the caller's own records"),
    # ---- vLLM's extra sampling fields ------------------------------------------------
    "top_k": Rule(SERVED, "keep the k most likely tokens (0 or -1: all)"),
    "stop_token_ids": Rule(SERVED, "tokens that end the choice (kept in its tokens)"),
    "ignore_eos": Rule(SERVED, "generate past EOS"),
    "min_p": Rule(SERVED, "drop tokens under `min_p` times the top probability (sampling)"),
    "repetition_penalty": Rule(
        SERVED, "> 0, transformers' and vLLM's rule over the prompt's and the output's tokens"
    ),
    "min_tokens": Rule(
        SERVED,
        "EOS and `stop_token_ids` held back until this many tokens; stop strings looked "
        "for in the text after them (vLLM's rules)",
    ),
    "prompt_logprobs": Rule(
        SERVED, "`k`: each prompt token's logprob, rank and the top `k` (vLLM's shape)"
    ),
    "use_beam_search": Rule(NOOP, "beam search is not served", noop=(False,)),
    "length_penalty": Rule(NOOP, "only for beam search, which is not served", noop=(1,)),
    "include_stop_str_in_output": Rule(
        SERVED, "true: the text keeps the stop string (or stop token's text) that ended it"
    ),
    "skip_special_tokens": Rule(
        SERVED, "false: special tokens' text is kept (an ending EOS or stop token's still cut)"
    ),
    "spaces_between_special_tokens": Rule(NOOP, "the tokenizer's decoding", noop=(True,)),
    "allowed_token_ids": Rule(REFUSED, "not served yet"),
    "bad_words": Rule(REFUSED, "not served yet"),
    "logits_processors": Rule(REFUSED, "no code from requests is run"),
    "truncate_prompt_tokens": Rule(REFUSED, "not served for generation (embeddings: served)"),
    "guided_json": Rule(SERVED, "a JSON schema (object or text) the output follows"),
    "guided_regex": Rule(SERVED, "a regular expression the whole output matches"),
    "guided_choice": Rule(SERVED, "the output is one of these strings"),
    "guided_grammar": Rule(SERVED, "an EBNF grammar (xgrammar's, rule `root`)"),
    "guided_decoding_backend": Rule(NOOP, "xgrammar is the one backend", noop=("auto", "xgrammar")),
    "guided_whitespace_pattern": Rule(REFUSED, "JSON is written without free whitespace"),
    "structural_tag": Rule(REFUSED, "not served yet"),
    "priority": Rule(NOOP, "first come, first served", noop=(0,)),
    "request_id": Rule(IGNORED, "responses carry the server's own ids", vllm="vLLM uses it"),
    "return_tokens_as_token_ids": Rule(NOOP, "tokens are returned as text", noop=(False,)),
    "cache_salt": Rule(
        SERVED,
        "prefix-cache pages shared only among requests of the same salt (and adapter "
        "version); a non-empty string",
    ),
    "kv_transfer_params": Rule(REFUSED, "no disaggregated prefill here"),
    "vllm_xargs": Rule(REFUSED, "no custom extensions here"),
    "add_special_tokens": Rule(
        SERVED,
        "the tokenizer's special tokens (BOS) around the prompt; default: true on "
        "completions, false on chat (the template has them)",
    ),
    # ---- vLLM's extra chat fields ----------------------------------------------------
    "add_generation_prompt": _h(
        SERVED, "end the prompt with the template's assistant turn (default: true)"
    ),
    "continue_final_message": _h(
        SERVED, "render the last (assistant) message open, for the model to continue it"
    ),
    "chat_template_kwargs": _h(SERVED, "extra variables for the template (e.g. `enable_thinking`)"),
    "chat_template": _h(
        REFUSED,
        "a template from a request is not run; start the server with `--chat-template`",
        vllm="vLLM too, unless `--trust-request-chat-template`",
    ),
    "documents": _h(REFUSED, "not served"),
    "mm_processor_kwargs": _h(REFUSED, "text only"),
}

_warned: set[str] = set()


def check_extras(body: Any, *, strict: bool) -> None:
    """Refuse (``strict``) or log once and ignore the fields of ``body`` its model does
    not declare.

    Raises:
        APIError: 400 ``unknown field`` under ``strict``.
    """
    for name in getattr(body, "model_extra", None) or {}:
        if strict:
            raise APIError(400, f"unknown field {name!r}", param=name)
        if name not in _warned:
            _warned.add(name)
            log.warning("ignoring the unknown request field %r (and from now on)", name)


def check_fields(body: Any, endpoint: str, *, strict: bool) -> None:
    """Apply :data:`FIELDS` to a parsed body of ``endpoint`` (``completions`` or
    ``chat``): a no-op-only field at another value, or a refused field given, is refused;
    an unknown field (a field of no table, or of the other route's table) is refused under
    ``strict``, else logged once per name and ignored.

    Raises:
        APIError: 400 naming the field and why.
    """
    check_extras(body, strict=strict)
    for name in type(body).model_fields:
        rule = FIELDS.get(name)
        value = getattr(body, name)
        if rule is None or value is None:
            continue
        if rule.kind == REFUSED:
            raise APIError(400, f"{name} is not supported: {rule.doc}", param=name)
        if rule.kind == NOOP and not any(_same(value, v) for v in rule.noop):
            accepted = " or ".join(_json(v) for v in rule.noop) or "its default"
            raise APIError(
                400,
                f"{name} {_json(value)} is not supported ({rule.doc}); only {accepted} is",
                param=name,
            )


def _same(value: Any, noop: Any) -> bool:
    """``value == noop`` as JSON sees it (``True`` is not ``1``)."""
    numbers = (int, float)
    comparable = type(value) is type(noop) or (
        isinstance(value, numbers)
        and isinstance(noop, numbers)
        and not isinstance(value, bool)
        and not isinstance(noop, bool)
    )
    return comparable and value == noop


def _json(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def markdown_table() -> str:
    """The README's field table (a test keeps the README equal to it)."""
    rows = ["| field | route | here | notes |", "|---|---|---|---|"]
    for name, rule in FIELDS.items():
        route = "both" if rule.endpoints == BOTH else next(iter(rule.endpoints))
        kind = rule.kind
        if rule.kind == NOOP and rule.noop:
            kind += " (" + ", ".join(dict.fromkeys(_json(v) for v in rule.noop)) + ")"
        doc = rule.doc + (f"; vLLM: {rule.vllm}" if rule.vllm else "")
        rows.append(f"| `{name}` | {route} | {kind} | {doc} |")
    return "\n".join(rows)
