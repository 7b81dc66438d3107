"""The server's protocol: OpenAI's request bodies as pydantic models (unknown fields and
loose types refused), its error body (:class:`APIError`), and the message a body that
fails validation gets (:func:`validation_message`)."""

from __future__ import annotations

from typing import Any, Literal

try:  # the "serve" extra
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    from pydantic import BaseModel, ConfigDict, Field

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


# request fields of several accepted forms: a value of none of them is refused with all
# (pydantic reports the error of one form, e.g. "prompt.str: Input should be a valid string")
_UNION_FIELDS = {
    "prompt": "text or a list of token ids",
    "input": "text, a list of texts, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
}


def validation_message(error: dict[str, Any]) -> tuple[str, str | None]:
    """``(message, param)`` for pydantic's first validation error of a body: an unknown
    field, a field of several forms given none of them (named with all its forms), JSON
    that does not parse, or the field and pydantic's message."""
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    message = error.get("msg", "invalid request")
    field_name = where.split(".", 1)[0]
    if field_name in _UNION_FIELDS and where != field_name:  # one branch's error: say all
        message, where = f"{field_name} must be {_UNION_FIELDS[field_name]}", field_name
    elif error.get("type") == "extra_forbidden":
        message = f"unknown field {where!r}"
    elif error.get("type") == "json_invalid":
        message, where = "the body is not valid JSON", ""
    elif where:
        message = f"{where}: {message}"
    return message, where or None


if HAVE_SERVER_DEPS:

    class _Body(BaseModel):
        # unknown fields and loose types ("4" for 4, true for 1) are refused
        model_config = ConfigDict(extra="forbid", strict=True)

    class StreamOptions(_Body):
        include_usage: bool = False  # OpenAI's default (vLLM's is True once the field is given)

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
