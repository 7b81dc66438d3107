"""The security-relevant parts of the server, each in one place: the API key and the body
size limit (:class:`Guard`, an ASGI middleware run before any handler), and the
confinement of runtime adapter loads to ``--lora-root`` (:func:`path_under`)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from lora_graph.server.config import ServerConfig
from lora_graph.server.protocol import APIError


def path_under(path: str, roots: list[str]) -> bool:
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


class Guard:
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
        if scope["path"] != "/health" and (
            scope["path"] != "/metrics" or self.config.api_key_metrics
        ):
            error = key_error(headers.get("authorization", ""), self.config.api_key)
        length = headers.get("content-length", "")
        limit = self.config.max_request_bytes
        if error is None and length.isdigit() and int(length) > limit:
            error = APIError(413, f"the request body is over {limit} bytes")
        elif error is None and not length.isdigit():  # a chunked body, or none
            body = await read_body(receive, limit)
            if body is None:  # the client hung up
                return
            if len(body) > limit:
                error = APIError(413, f"the request body is over {limit} bytes")
            else:
                receive = replay_body(body, receive)
        if error is None:
            await self.app(scope, receive, send)
        else:
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def key_error(authorization: str, key: str | None) -> APIError | None:
    """The 401 for an ``Authorization`` header that does not carry ``Bearer KEY`` (None
    when it does, or when no key is set). The comparison takes the same time for every
    wrong key; the scheme's name is case-insensitive (RFC 9110, section 11.1)."""
    if key is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode()):
        return None
    return APIError(401, "missing or wrong API key (Authorization: Bearer KEY)")


async def read_body(receive: Callable, limit: int) -> bytes | None:
    """A body without a ``Content-Length``, read until it ends or passes ``limit`` bytes
    (then what was read, one chunk past the limit); None if the client hung up."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if len(body) > limit or not message.get("more_body", False):
            return bytes(body)


def replay_body(body: bytes, receive: Callable) -> Callable:
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
