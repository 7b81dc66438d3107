"""What a server serves and allows (the ``serve`` command's flags)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        strict_fields: answer 400 ``unknown field`` to a request field in no table of
            :mod:`lora_graph.server.fields` (default: ignore it, logging its name once).
        api_key_metrics: ``/metrics`` needs the API key too (default: open, as vLLM's).
        chat_template: a Jinja chat template used instead of the tokenizer's (``serve
            --chat-template FILE``; a model without one then serves chat).
    """

    model_name: str
    api_key: str | None = None
    allow_runtime_lora: bool = False
    lora_roots: list[str] = field(default_factory=list)
    default_max_tokens: int = 16
    max_request_bytes: int = 8 << 20
    strict_fields: bool = False
    api_key_metrics: bool = False
    chat_template: str | None = None
