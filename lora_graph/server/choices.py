"""One choice of a completion as it streams: its tokens, the text emitted so far, and the
stop strings that end it (cut from the text, or kept with vLLM's
``include_stop_str_in_output``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_graph.detokenize import Detokenizer
from lora_graph.engine import RequestOutput, TokenLogprob
from lora_graph.server.protocol import APIError


@dataclass
class Choice:
    """One of a request's ``n`` choices, served by the engine request ``request_id``.

    Its text is its tokens decoded after its prompt (``detok``: a SentencePiece word keeps
    its leading space); the EOS or stop token that ends it (``stop_tokens``: the engine's
    rule) adds no text, and stop strings count once more than ``min_tokens`` tokens are
    out, in text after those (vLLM's rules; of several found at once, the first listed).
    With ``include_stop`` (vLLM's ``include_stop_str_in_output``) the text keeps the stop
    string that ended it, and the stop token's text.
    """

    index: int
    request_id: str
    stops: list[str]
    detok: Detokenizer
    stop_tokens: frozenset[int] = frozenset()
    min_tokens: int = 0
    include_stop: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    finish_reason: str | None = None
    done: bool = False  # its text is final
    engine_done: bool = False  # its engine request finished
    refused: bool = False  # another choice of its request was refused: never served
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one a token, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, if asked
    logprobs_sent: int = 0  # of ``logprobs``, in parts sent
    text_offset: int = 0  # the next token's logprobs text_offset (token texts sent so far)
    started: bool = False  # its first part was sent
    tool_sent: int = 0  # characters of its text streamed as content (with tools)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (with its first token)

    def on_token(self, token: int) -> str:
        """Take a generated token; return the text it newly emits. A stop string ends the
        choice (``finish_reason`` ``"stop"``, the string cut, or kept with
        ``include_stop``); text that may be the start of a stop string (unless it is kept
        anyway), or an incomplete character, is held back until it is not."""
        self.tokens.append(token)
        if token in self.stop_tokens and not self.include_stop:  # the engine ends on it
            return ""
        start = len(self.detok.text)
        if not self.detok.add(token):
            return ""
        full = self.detok.text
        if len(self.tokens) > self.min_tokens:
            # each stop string ending in this token's text (vLLM's window, stop by stop);
            # its start is never emitted, unless it is kept: then it may have been
            floor = 0 if self.include_stop else len(self.text)
            for stop in self.stops:  # (vLLM's order: the first of the list found)
                at = full.find(stop, max(floor, start - len(stop) + 1))
                if at >= 0:
                    self.finish_reason = "stop"
                    self.done = True
                    return self._emit(full[: at + len(stop) if self.include_stop else at])
        return self._emit(full[: len(full) - self._held_back(full)])

    def _held_back(self, full: str) -> int:
        """How many final characters of ``full`` may be the start of a stop string (none
        when a stop string is kept: its start is returned either way)."""
        if self.include_stop:
            return 0
        longest = max((len(s) - 1 for s in self.stops), default=0)
        for k in range(min(longest, len(full)), 0, -1):
            if any(s.startswith(full[-k:]) for s in self.stops):
                return k
        return 0

    def _emit(self, upto: str) -> str:
        """Emit the text up to the end of ``upto`` (a prefix of ``detok.text``)."""
        new = upto[len(self.text) :]
        self.text += new
        return new

    def on_finish(self, out: RequestOutput) -> str:
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
        self.detok.finish()
        return self._emit(self.detok.text)
