"""One choice of a completion as it streams: its tokens, the text emitted so far, and the
stop strings that end it (cut from the text, never returned)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lora_graph.engine import RequestOutput, TokenLogprob
from lora_graph.server.protocol import APIError


@dataclass
class Choice:
    """One of a request's ``n`` choices, served by the engine request ``request_id``."""

    index: int
    request_id: str
    stops: list[str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    finish_reason: str | None = None
    done: bool = False  # its text is final
    engine_done: bool = False  # its engine request finished
    refused: bool = False  # another choice of its request was refused: never served
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one a token, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, if asked
    logprobs_sent: int = 0  # of ``logprobs``, in parts sent
    chars_sent: int = 0  # of the text (echo included), in parts sent
    started: bool = False  # its first part was sent
    tool_sent: int = 0  # characters of its text streamed as content (with tools)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (with its first token)

    def on_token(self, token: int, tokenizer: Any) -> str:
        """Take a generated token; return the text it newly emits. A stop string ends the
        choice (``finish_reason`` ``"stop"``, the string cut); text that may be the start
        of a stop string, or an incomplete character, is held back until it is not."""
        self.tokens.append(token)
        full = tokenizer.decode(self.tokens, skip_special_tokens=True)
        for stop in self.stops:
            at = full.find(stop)
            if at >= 0:
                full = full[:at]
                self.finish_reason = "stop"
                self.done = True
                break
        else:
            if full.endswith("\ufffd"):  # an incomplete character: wait for the rest
                return ""
            full = full[: len(full) - self._held_back(full)]
        return self._emit(full)

    def _held_back(self, full: str) -> int:
        """How many final characters of ``full`` may be the start of a stop string."""
        longest = max((len(s) - 1 for s in self.stops), default=0)
        for k in range(min(longest, len(full)), 0, -1):
            if any(s.startswith(full[-k:]) for s in self.stops):
                return k
        return 0

    def _emit(self, full: str) -> str:
        if not full.startswith(self.text):
            return ""
        new, self.text = full[len(self.text) :], full
        return new

    def on_finish(self, out: RequestOutput, tokenizer: Any) -> str:
        """Take the engine request's end; return the text it newly emits (what was held
        back). An aborted request ends as ``"abort"``.

        Raises:
            APIError: 400 for a request whose adapter version was unloaded before it ran,
                500 for another engine error (NaN logits, an adapter that cannot be read).
        """
        if self.done:
            return ""
        self.done = True
        if out.error is not None:
            if out.error == "aborted":
                self.finish_reason = "abort"
            elif "was unloaded" in out.error:  # queued when its adapter was unloaded
                raise APIError(400, out.error, param="model")
            else:
                raise APIError(500, out.error)
        else:
            self.finish_reason = out.finish_reason
        full = tokenizer.decode(self.tokens, skip_special_tokens=True)
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return new
