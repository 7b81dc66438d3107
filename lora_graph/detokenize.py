"""Generated tokens to text, one token at a time, as vLLM and TGI detokenize.

Decoding the generated tokens alone is wrong for SentencePiece tokenizers (Llama 2,
Mistral, Phi-3): their decoder strips the leading space of a text's first word, so a
completion starting with ``"▁word"`` would read ``"word"``. Each new token is therefore
decoded in a short window that starts a few tokens earlier (the prompt's last tokens for
the first ones), and its text is what the window's text adds to that of the window without
it (``detokenize_incrementally`` in vLLM and TGI). A window ending in an incomplete UTF-8
character (a byte-fallback token) waits for the rest. Each token costs one decode of a few
tokens, whatever the output's length.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

CONTEXT = 5  # prompt tokens decoded before the first generated one (vLLM's offset)
MAX_PENDING = 8  # tokens a window waits for the rest of a character (UTF-8: 4 bytes at most)


class Detokenizer:
    """The text of one request's generated tokens, ``text``, as they arrive.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompt_ids: the request's prompt tokens (its last :data:`CONTEXT` are read).
        skip_special_tokens: decode with ``skip_special_tokens`` (the default: special
            tokens such as EOS have no text), as vLLM's ``SamplingParams`` field.
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[max(0, len(prompt_ids) - CONTEXT) :])
        # a context cut inside a character loses its first bytes (a byte-fallback decoder
        # blanks a whole run of byte tokens when one is invalid: the output's too)
        while len(self.ids) > 1 and self._decode(self.ids).startswith("\ufffd"):
            self.ids.pop(0)
        self.prefix = 0  # the window: ids[prefix:], whose ids[prefix:read] are decoded
        self.read = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token: int) -> str:
        """Take a generated token; return the text it completes (possibly ``""``: an
        incomplete character, or a token without text), appended to ``text``."""
        self.ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text held back at the end (an incomplete character, as ``"\\ufffd"``)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if after == before and not final:
            # a token without text (a skipped special; EOS under ignore_eos): it leaves the
            # window, which it would only lengthen (every later decode reading it again)
            self.ids.pop()
            return ""
        pending = len(self.ids) - self.read  # tokens of a character still incomplete
        incomplete = len(after) <= len(before) or after.endswith("\ufffd")
        if not final and incomplete and pending < MAX_PENDING:
            return ""  # (past MAX_PENDING: bytes that make no character, as U+FFFD)
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new


def completion_text(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    stop_tokens: Collection[int] = (),
) -> str:
    """The text of a finished request's ``token_ids`` after ``prompt_ids``, as streamed
    (:class:`Detokenizer`); a last token in ``stop_tokens`` (the EOS or stop token that
    ended it) adds no text, as in vLLM's output."""
    ids = list(token_ids)
    if ids and ids[-1] in stop_tokens:
        ids.pop()
    detok = Detokenizer(tokenizer, prompt_ids)
    for token in ids:
        detok.add(token)
    detok.finish()
    return detok.text
