"""Log-probabilities in OpenAI's and vLLM's response shapes, from the engine's
:class:`~lora_graph.requests.TokenLogprob` entries (float32 log-softmax of the logits a token
was drawn from: after the adapter, before temperature and logits processing, vLLM's
default ``raw_logprobs``).

- Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``; ``top_logprobs`` maps token text to logprob for the ``k`` most likely
  and the chosen token (vLLM's: up to ``k + 1`` entries); with ``echo`` the prompt's tokens
  come first, the first with ``null`` logprob and top.
- Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
- vLLM's ``prompt_logprobs: k``: a list over the prompt's tokens, ``null`` first, then
  ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and the ``k``
  most likely.
"""

from __future__ import annotations

from typing import Any

from lora_graph.requests import TokenLogprob


def token_text(tokenizer: Any, token: int) -> str:
    """One token's text, decoded alone, with the leading spaces a SentencePiece decoder
    strips from a text's start put back from its piece (``"▁the"`` is ``" the"``, as the
    completion's text has it), as vLLM's ``convert_ids_list_to_tokens`` does."""
    text = str(tokenizer.decode([token]))
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str) and piece.startswith("▁"):
        missing = (len(piece) - len(piece.lstrip("▁"))) - (len(text) - len(text.lstrip(" ")))
        text = " " * max(0, missing) + text
    return text


def completion_logprobs(
    tokenizer: Any, entries: list[TokenLogprob | None], tokens: list[int], offset: int
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object for ``tokens`` (``entries[i]`` the
    logprobs of ``tokens[i]``, None for a prompt's first token); ``text_offset`` counts
    from ``offset`` characters into the choice's text, one token's text after another."""
    texts = [token_text(tokenizer, t) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    top: list[dict[str, float] | None] = []
    for e in entries:
        if e is None:
            top.append(None)
            continue
        d = {token_text(tokenizer, t): lp for t, lp in e.top}
        d.setdefault(token_text(tokenizer, e.token), e.logprob)
        top.append(d)
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob if e is not None else None for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: ``{"content": [...]}``, one entry a token."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def vllm_prompt_logprobs(
    tokenizer: Any, entries: list[TokenLogprob | None]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else token id (a
    string, as JSON keys are) to ``{"logprob", "rank", "decoded_token"}`` for the token
    and the most likely ones."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {
            str(e.token): {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": token_text(tokenizer, e.token),
            }
        }
        for rank, (t, lp) in enumerate(e.top, start=1):
            d.setdefault(
                str(t), {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, t)}
            )
        out.append(d)
    return out
