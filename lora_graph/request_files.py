"""The JSON-lines requests files of ``lora-graph generate`` and ``embed``: lines read and
decoded one by one (a bad line is that line's error alone), each parsed into a request,
and the results written back as JSON."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from lora_graph.detokenize import completion_text
from lora_graph.engine import Request, RequestOutput, SamplingParams, check_text
from lora_graph.launch import CliError


def read_request_lines(path: str) -> list[tuple[int, str | None, str | None]]:
    """The non-blank lines of a JSON-lines requests file as ``(line number, text, error)``.

    The file is split on ``\\n`` only (a JSON string may hold U+2028 or other characters
    ``str.splitlines`` would split on) and each line is decoded as UTF-8 on its own, so a
    line that is not UTF-8 is an error of that line alone; a UTF-8 byte-order mark at the
    start is skipped.

    Raises:
        CliError: if the file cannot be read.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise CliError(f"--requests {path}: {e.strerror or e}") from e
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise CliError(f"--requests {path}: the file is UTF-16; save it as UTF-8")
    lines: list[tuple[int, str | None, str | None]] = []
    for n, chunk in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            lines.append(
                (
                    n,
                    None,
                    f"line {n}: not valid UTF-8 (byte {chunk[e.start]:#04x} at column "
                    f"{e.start + 1})",
                )
            )
            continue
        if text.strip():
            lines.append((n, text, None))
    if not lines:
        raise CliError(f"--requests {path}: no requests in the file (one JSON object a line)")
    return lines


def parse_requests(
    lines: list[tuple[int, str | None, str | None]], tokenizer: Any, defaults: SamplingParams
) -> list[tuple[Request, Any, str | None]]:
    """Parse requests-file lines into ``(request, output id, error)`` entries in file order;
    a line that is not a valid request, or repeats an earlier id, carries an error naming
    its line. The engine sees each request as ``line-N`` (unique by construction); the
    output names it by its own ``id`` (``line-N`` when it has none, or ``line-N-noid`` if
    another line's ``id`` is ``line-N``)."""
    entries: list[tuple[Request, Any, str | None]] = []
    seen: set[str] = set()
    for n, line, error in lines:
        key = f"line-{n}"
        out_id: Any = key
        if error is not None or line is None:
            entries.append((Request(key, [], None), out_id, error))
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("a request must be a JSON object")
            if obj.get("id") is not None:
                if isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int)):
                    raise ValueError("id must be a string or an integer")
                out_id = obj["id"]  # as given: an integer id stays an integer
                if str(out_id) in seen:
                    raise ValueError(f"id {out_id!r} repeats an earlier request's id")
                seen.add(str(out_id))
            unknown = sorted(set(obj) - REQUEST_FIELDS)
            if unknown:
                raise ValueError(
                    f"unknown field {unknown[0]!r} (a request has: "
                    f"{', '.join(sorted(REQUEST_FIELDS))})"
                )
            request = request_from_json(obj, key, tokenizer, defaults)
            request.sampling.validate()
            entries.append((request, out_id, None))
        except (ValueError, TypeError, RecursionError, OverflowError) as e:
            entries.append((Request(key, [], None), out_id, f"line {n}: {e}"))
    # an id-less line's line-N must not name another line's request
    return [
        (r, f"{out_id}-noid" if out_id == r.id and out_id in seen else out_id, error)
        for r, out_id, error in entries
    ]


def int_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"{field} must be a list of integers")
    return value


# fmt: off
REQUEST_FIELDS = frozenset({"id", "prompt", "prompt_token_ids", "adapter", "max_new_tokens",
                             "temperature", "top_k", "top_p", "seed", "stop_token_ids",
                             "ignore_eos"})
# fmt: on


def request_from_json(
    obj: dict[str, Any], rid: str, tokenizer: Any, defaults: SamplingParams
) -> Request:
    if "prompt_token_ids" in obj and "prompt" in obj:
        raise ValueError("give either 'prompt' or 'prompt_token_ids', not both")
    if "prompt_token_ids" in obj:
        ids = int_list(obj["prompt_token_ids"], "prompt_token_ids")
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError("prompt must be a string")
        check_text(obj["prompt"], "prompt")
        if tokenizer is None:
            raise ValueError("the model has no tokenizer; give prompt_token_ids")
        ids = tokenizer(obj["prompt"])["input_ids"]
    else:
        raise ValueError("a request needs 'prompt' or 'prompt_token_ids'")
    adapter = obj.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise ValueError("adapter must be a string or null")
    sampling = SamplingParams(
        max_new_tokens=obj.get("max_new_tokens", defaults.max_new_tokens),
        temperature=obj.get("temperature", defaults.temperature),
        top_k=obj.get("top_k", defaults.top_k),
        top_p=obj.get("top_p", defaults.top_p),
        seed=obj.get("seed", defaults.seed),
        stop_token_ids=tuple(
            int_list(obj.get("stop_token_ids", list(defaults.stop_token_ids)), "stop_token_ids")
        ),
        ignore_eos=obj.get("ignore_eos", defaults.ignore_eos),
    )
    return Request(rid, ids, adapter, sampling)


def output_json(
    out: RequestOutput, tokenizer: Any, request: Request, eos_token_ids: Collection[int]
) -> dict[str, Any]:
    """One output line: ``{"id", "adapter", "token_ids", "text", "finish_reason"}`` (``text``
    as a server streams it, :func:`~lora_graph.detokenize.completion_text`: after the
    prompt, without the EOS or stop token that ended it; None without a tokenizer), or
    ``{"id", "error"}``."""
    if out.error is not None:
        return {"id": out.id, "error": out.error}
    ends = request.sampling.stop_tokens(eos_token_ids)
    text = (
        completion_text(tokenizer, request.prompt_token_ids, out.token_ids, ends)
        if tokenizer is not None
        else None
    )
    return {
        "id": out.id,
        "adapter": out.adapter,
        "token_ids": out.token_ids,
        "text": text,
        "finish_reason": out.finish_reason,
    }


EMBED_FIELDS = frozenset({"id", "text", "input_ids", "adapter"})


def embed_row(
    obj: dict[str, Any],
    tokenizer: Any,
    known: set[str],
    limit: int,
    flag: str,
    truncate: bool,
    vocab: int,
) -> tuple[list[int], str | None]:
    """One ``embed`` request line's ``(token ids, adapter)``.

    Raises:
        ValueError: naming the field and the cause.
    """
    unknown = sorted(set(obj) - EMBED_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown field {unknown[0]!r} (a line has: {', '.join(sorted(EMBED_FIELDS))})"
        )
    if ("text" in obj) == ("input_ids" in obj):
        raise ValueError("give either 'text' or 'input_ids'")
    if "input_ids" in obj:
        ids = int_list(obj["input_ids"], "input_ids")
    elif not isinstance(obj["text"], str):
        raise ValueError("text must be a string")
    elif tokenizer is None:
        raise ValueError("the model has no tokenizer; give input_ids")
    else:
        check_text(obj["text"], "text")
        if truncate:  # as sentence-transformers: cut, then the closing special token
            ids = tokenizer(obj["text"], truncation=True, max_length=limit)["input_ids"]
        else:
            ids = tokenizer(obj["text"])["input_ids"]
    adapter = obj.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise ValueError("adapter must be a string or null")
    if adapter is not None and adapter not in known:
        raise ValueError(f"unknown adapter {adapter!r} (loaded: {sorted(known)})")
    if not 0 < len(ids) <= limit:
        hint = "" if "input_ids" in obj or truncate else "; --truncate cuts texts"
        raise ValueError(f"{len(ids)} tokens (1 to {limit}: {flag}{hint})")
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab})")
    return ids, adapter


def embed_entries(
    lines: list[tuple[int, str | None, str | None]], row: Any
) -> list[tuple[Any, tuple[list[int], str | None] | None, str | None]]:
    """``(id, row or None, error or None)`` for each line of an ``embed`` requests file."""
    entries: list[tuple[Any, tuple[list[int], str | None] | None, str | None]] = []
    seen: set[str] = set()
    for n, line, error in lines:
        out_id: Any = f"line-{n}"
        if error is not None or line is None:
            entries.append((out_id, None, error))
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("a line must be a JSON object")
            if obj.get("id") is not None:
                if isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int)):
                    raise ValueError("id must be a string or an integer")
                if str(obj["id"]) in seen:
                    raise ValueError(f"id {obj['id']!r} repeats an earlier line's id")
                seen.add(str(obj["id"]))
                out_id = obj["id"]
            entries.append((out_id, row(obj), None))
        except (ValueError, TypeError, RecursionError) as e:
            entries.append((out_id, None, f"line {n}: {e}"))
    return entries
