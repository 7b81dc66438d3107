"""The server's protocol: OpenAI's request bodies as pydantic models (unknown fields and
loose types refused), its error body (:class:`APIError`), and the message a body that
fails validation gets (:func:`validation_message`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

try:  # the "serve" extra
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    from pydantic import BaseModel, BeforeValidator, ConfigDict

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

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status)
        if kind is None:  # a client's error (400, 405, 413, ...) or the server's
            kind = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


# request fields of several accepted forms: a value of none of them is refused with all
# (pydantic reports the error of one form, e.g. "prompt.str: Input should be a valid string")
_UNION_FIELDS = {
    "prompt": "text, a list of token ids, a list of texts or a list of lists of token ids",
    "input": "text, a list of texts, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "text, a list of content parts, or null (an assistant's message only)",
}


def _path(loc: tuple[Any, ...] | list[Any]) -> str:
    """A location as the body spells it: ``messages[0].content``."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validation_message(error: dict[str, Any]) -> tuple[str, str | None]:
    """``(message, param)`` for pydantic's first validation error of a body: a field of
    several forms given none of them (named with all its forms, wherever it is nested), a
    body that is not a JSON object, JSON that does not parse, or the field and pydantic's
    message."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    message = error.get("msg", "invalid request")
    field_name = str(loc[0]) if loc else ""
    for i, p in enumerate(loc):
        if p in _UNION_FIELDS and i + 1 < len(loc) and not isinstance(loc[i + 1], int):
            return f"{_path(loc[: i + 1])} must be {_UNION_FIELDS[p]}", field_name
    where = _path(loc)
    if error.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    if not where and error.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the body must be a JSON object, sent with Content-Type: application/json", None
    if error.get("type") == "missing":
        if not where:  # (no body at all)
            return "the body is empty; send a JSON object (Content-Type: application/json)", None
        return f"{where} is required", field_name
    if where:
        message = f"{where}: {message}"
    return message, field_name or None


def _integral(value: Any) -> Any:
    """A float with an integer value (``4.0``) as that integer, as vLLM's lax models take
    it (clients computing a count in floating point send one); anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


if HAVE_SERVER_DEPS:
    # an integer field: an integral float taken (4.0), anything else strict ("4", 4.5, true)
    Int = Annotated[int, BeforeValidator(_integral)]

    class _Body(BaseModel):
        # loose types ("4" for 4, true for 1) are refused; unknown fields are kept in
        # model_extra for the field policy (fields.check_fields) to ignore or refuse
        model_config = ConfigDict(extra="allow", strict=True)

    class StreamOptions(_Body):
        include_usage: bool = False  # OpenAI's default (vLLM's is True once the field is given)
        continuous_usage_stats: bool = False

    JSON = dict[str, Any]

    class _Sampling(_Body):
        """The fields completions and chat share (fields.FIELDS says what each does)."""

        model: str
        max_tokens: Int | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: Int | None = None
        min_p: float | None = None
        seed: Int | None = None
        stop: str | list[str] | None = None
        stop_token_ids: list[Int] | None = None
        ignore_eos: bool | None = None
        n: Int | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        user: str | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        repetition_penalty: float | None = None
        logit_bias: dict[str, float] | None = None
        min_tokens: Int | None = None
        prompt_logprobs: Int | None = None
        response_format: JSON | None = None
        use_beam_search: bool | None = None
        length_penalty: float | None = None
        include_stop_str_in_output: bool | None = None
        skip_special_tokens: bool | None = None
        spaces_between_special_tokens: bool | None = None
        allowed_token_ids: list[Int] | None = None
        bad_words: list[str] | None = None
        logits_processors: Any = None
        truncate_prompt_tokens: Int | None = None
        guided_json: Any = None
        guided_regex: str | None = None
        guided_choice: list[str] | None = None
        guided_grammar: str | None = None
        guided_decoding_backend: str | None = None
        guided_whitespace_pattern: str | None = None
        structural_tag: Any = None
        priority: Int | None = None
        request_id: str | None = None
        return_tokens_as_token_ids: bool | None = None
        cache_salt: str | None = None
        kv_transfer_params: Any = None
        vllm_xargs: Any = None
        add_special_tokens: bool | None = None

    class CompletionBody(_Sampling):
        prompt: str | list[Int] | list[str] | list[list[Int]]
        logprobs: Int | None = None
        echo: bool | None = None
        best_of: Int | None = None
        suffix: str | None = None

    class ContentPart(_Body):
        type: str
        text: str | None = None

    class ChatMessage(_Body):
        role: str
        content: str | list[ContentPart] | None = None
        name: str | None = None
        tool_calls: list[JSON] | None = None
        tool_call_id: str | None = None

    class ChatBody(_Sampling):
        messages: list[ChatMessage]
        logprobs: bool | None = None
        top_logprobs: Int | None = None
        max_completion_tokens: Int | None = None
        tools: list[JSON] | None = None
        tool_choice: str | JSON | None = None
        parallel_tool_calls: bool | None = None
        functions: Any = None
        function_call: Any = None
        store: bool | None = None
        metadata: dict[str, str] | None = None
        service_tier: str | None = None
        modalities: list[str] | None = None
        audio: Any = None
        prediction: Any = None
        reasoning_effort: str | None = None
        verbosity: str | None = None
        web_search_options: Any = None
        prompt_cache_key: str | None = None
        safety_identifier: str | None = None
        add_generation_prompt: bool | None = None
        continue_final_message: bool | None = None
        chat_template_kwargs: JSON | None = None
        chat_template: str | None = None
        documents: Any = None
        mm_processor_kwargs: Any = None

    class LoadBody(_Body):
        lora_name: str
        lora_path: str

    class EmbeddingBody(_Body):
        model: str
        input: str | list[str] | list[Int] | list[list[Int]]
        encoding_format: Literal["float", "base64"] = "float"
        dimensions: Int | None = None
        user: str | None = None
        truncate_prompt_tokens: Int | None = None

    class UnloadBody(_Body):
        lora_name: str
        lora_int_id: Int | None = None

    class TokenizeBody(_Body):
        """vLLM's ``/tokenize``: a prompt, or chat messages through the template."""

        model: str | None = None
        prompt: str | None = None
        messages: list[ChatMessage] | None = None
        add_special_tokens: bool | None = None
        add_generation_prompt: bool = True
        continue_final_message: bool = False
        chat_template_kwargs: JSON | None = None

    class DetokenizeBody(_Body):
        model: str | None = None
        tokens: list[Int]
