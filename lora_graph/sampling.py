"""Drawing a request's next token from its logits (:func:`sample`), and the log-probabilities
reported with it (:func:`pack_logprobs`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lora_graph.requests import SamplingParams, TokenLogprob


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from float32 ``logits [vocab]``: argmax at temperature 0, else a draw
    from the temperature-scaled distribution restricted by top-k then top-p.

    The logits are shifted so their maximum is 0 before the division by the temperature,
    so no value overflows: the most likely token always keeps a positive probability.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False  # the most likely token always stays (top_p may round to 0 in float32)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pack_logprobs(logits: Tensor, tokens: Tensor, k: int) -> Tensor:
    """Log-probabilities of ``tokens`` under ``logits`` and the ``k`` most likely, packed
    for one copy to the host: float32 ``[R, 2 + 2k]`` = (the token's logprob, its rank
    (1: the most likely; 1 + the tokens more likely), the top ``k`` logprobs, their token
    ids as floats: exact below 2**24).

    Args:
        logits: ``[R, vocab]`` (any float dtype; the log-softmax is taken in float32).
        tokens: ``[R]`` integer token ids.
        k: how many top tokens (0: none).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.long().view(-1, 1))
    rank = (lp > chosen).sum(dim=1, keepdim=True).float() + 1
    if k == 0:
        return torch.cat((chosen, rank), dim=1)
    top = lp.topk(k, dim=-1)
    return torch.cat((chosen, rank, top.values, top.indices.float()), dim=1)


def unpack_logprob(packed: list[float], token: int, k: int, width: int) -> TokenLogprob:
    """One row of :func:`pack_logprobs` (packed with ``width`` top tokens) as a
    :class:`TokenLogprob` with the first ``k`` of them."""
    top = tuple((int(packed[2 + width + j]), packed[2 + j]) for j in range(k))
    return TokenLogprob(token, packed[0], int(packed[1]), top)


def token_logprob(logits: Tensor, token: int, k: int) -> TokenLogprob:
    """:class:`TokenLogprob` of ``token`` under float32 ``logits [vocab]`` (a row on the
    host), with the ``k`` most likely tokens."""
    return unpack_logprob(pack_logprobs(logits[None], torch.tensor([token]), k)[0].tolist(),
                          token, k, k)  # fmt: skip
