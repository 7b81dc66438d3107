"""Tool calling on chat: ``tools`` rendered through the model's chat template, and the
calls read back from the output.

- ``tool_choice`` ``"none"``: the tools are in the prompt (vLLM's default), nothing is
  parsed.
- ``"auto"`` (the default with ``tools``): the model writes freely; calls in the Hermes /
  Qwen2.5 format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format
  of the templates that take ``tools``) are parsed from its text (:func:`parse_tool_calls`)
  into ``message.tool_calls``, the text around them is the content, and
  ``finish_reason`` is ``"tool_calls"``.
- ``"required"`` or a named function: the output is held by structured output to one call
  (:func:`call_schema`: ``{"name": ..., "arguments": ...}`` whose arguments follow the
  function's ``parameters`` schema) and returned as that call.

A template whose text never mentions ``tools`` cannot show them to the model: such a
request is refused by name.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from lora_graph.server.protocol import APIError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def check_tools(tools: list[dict[str, Any]], tool_choice: Any, template: str) -> str:
    """Validate ``tools`` and ``tool_choice`` against each other and the template; the
    mode: ``"none"``, ``"auto"``, ``"required"`` or the name of the function to call.

    Raises:
        APIError: 400 for a tool without a function name, a ``tool_choice`` naming no
            given tool or of an unknown form, or a template that takes no tools.
    """
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be a function tool", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}].function.name is missing", param="tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be an object",
                           param="tools")  # fmt: skip
        names.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise APIError(
                400, f"tool_choice names no given tool (given: {', '.join(names)})",
                param="tool_choice",
            )  # fmt: skip
        mode = str(name)
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise APIError(
            400, "tool_choice must be none, auto, required or {type: function, function: "
            "{name}}", param="tool_choice",
        )  # fmt: skip
    if "tools" not in template:
        raise APIError(
            400, "the model's chat template takes no tools (its text never uses `tools`); "
            "start the server with a --chat-template that does", param="tools",
        )  # fmt: skip
    return mode


def call_schema(tools: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """The JSON schema of one call: to the function ``mode`` names, or (``"required"``) to
    any of ``tools``."""
    options = []
    for t in tools:
        fn = t["function"]
        if mode in ("required", fn["name"]):
            # OpenAI's rule: parameters left out (or empty) is a function of none
            params = fn.get("parameters") or NO_PARAMETERS
            options.append({
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
            })  # fmt: skip
    return options[0] if len(options) == 1 else {"anyOf": options}


def _call(obj: Any) -> dict[str, Any] | None:
    """One call of OpenAI's shape from a parsed ``{"name", "arguments"}`` (``parameters``
    is taken for ``arguments`` too, as Llama 3's format writes it); None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool calls)`` of an output in the Hermes / Qwen2.5 format: each
    ``<tool_call>`` block whose body is a JSON object with a ``name`` is a call; the text
    outside the blocks is the content (None if only whitespace). A block that does not
    parse stays in the content, as written."""
    calls, kept, last = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept)
    return (content if content.strip() else None), calls


def forced_call(text: str) -> list[dict[str, Any]]:
    """The call of an output held to :func:`call_schema` (empty if it did not complete:
    the request ran out of tokens first); text after the call's JSON (the ending EOS's or
    stop string's, kept with ``skip_special_tokens: false`` and
    ``include_stop_str_in_output``) is not part of it."""
    try:
        call = _call(json.JSONDecoder().raw_decode(text.lstrip())[0])
    except json.JSONDecodeError:
        return []
    return [call] if call is not None else []
