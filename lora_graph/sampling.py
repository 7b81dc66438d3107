"""Drawing a request's next token from its logits (:func:`sample`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lora_graph.requests import SamplingParams


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
