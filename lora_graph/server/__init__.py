"""An OpenAI-compatible HTTP server over :class:`~lora_graph.engine.LLMEngine`.

FastAPI routes, uvicorn serving, FastAPI's server-sent events for ``stream: true``,
``prometheus_client`` for ``/metrics``. Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat
  template): ``model`` names the base model or a loaded adapter; ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (strings), ``stop_token_ids``,
  ``n``, ``ignore_eos``, ``stream`` and ``stream_options``. Streamed responses are OpenAI's
  chunk objects, then (only with ``stream_options: {"include_usage": true}``, as OpenAI
  and vLLM) a usage chunk with no choices, then ``[DONE]``. Every other field OpenAI's and
  vLLM's clients send: ``fields`` (served, no-op only, refused; unknown ones ignored).
- ``POST /v1/embeddings`` (an encoder, ``lora_graph/models/bert.py``): sentence embeddings of a
  text, texts or token-id lists, under the adapter ``model`` names; ``encoding_format`` float or
  base64. An encoder serves only this route; a decoder every other.
- ``GET /v1/models`` (the base model and every loaded adapter), ``GET /v1/models/{id}``;
  vLLM's ``POST /v1/tokenize`` and ``/v1/detokenize``; ``GET /version``.
- ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``: vLLM's payload
  (``lora_name``, ``lora_path``); loading needs ``allow_runtime_lora`` and a path under one
  of ``lora_roots``.
- ``GET /health`` (never needs the API key), ``GET /metrics`` (Prometheus text format;
  open unless ``api_key_metrics``).

Rooms: ``protocol`` (request bodies, the error body), ``fields`` (the field policy),
``logprobs`` (their response shapes), ``tools`` (tool calls), ``sampling`` (what a body
asks of the engine), ``generation`` (a request in flight and its answer),
``config`` (:class:`ServerConfig`), ``security`` (API key, body limit, ``--lora-root``
confinement), ``engine_loop`` (the engine thread), ``metrics``, ``choices`` (a choice's
text and stop strings), ``handlers`` (every route's handler), ``app`` (middleware, error
handlers, routes, :func:`run_server`).

Threading: one background thread (:class:`EngineLoop`) owns the engine and runs its steps;
HTTP handlers never touch the engine, they send it commands (run on that thread between
steps) and receive each request's tokens through an ``asyncio`` queue. A request is
validated before it is queued: a bad one is answered 400 with an OpenAI error body naming
the cause. A client that disconnects has its request aborted (pages and adapter hold
released).
"""

from __future__ import annotations

from typing import Any

from lora_graph.server.config import ServerConfig
from lora_graph.server.engine_loop import EngineLoop
from lora_graph.server.protocol import HAVE_SERVER_DEPS, APIError

if HAVE_SERVER_DEPS:
    from lora_graph.server.app import create_app, run_server
    from lora_graph.server.metrics import Metrics
else:  # pragma: no cover - exercised without the "serve" extra

    def create_app(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        raise ImportError("the server needs: pip install 'lora_graph[serve]'")

    run_server = create_app  # type: ignore[assignment]
    Metrics = None  # type: ignore[assignment,misc]


__all__ = [
    "HAVE_SERVER_DEPS",
    "APIError",
    "EngineLoop",
    "Metrics",
    "ServerConfig",
    "create_app",
    "run_server",
]
