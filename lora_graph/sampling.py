"""Drawing a request's next token from its logits (:func:`sample`), and the log-probabilities
reported with it (:func:`pack_logprobs`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lora_graph.requests import SamplingParams, TokenLogprob


def generator_seed(seed: int) -> int:
    """The seed a request's ``torch.Generator`` takes for its ``seed`` in [0, 2**64): the
    CPU generator (Mersenne Twister) keeps only 32 bits of a seed, so seeds that share
    their low 32 bits drew the same tokens; a seed below 2**32 is kept as it is, a larger
    one is mixed down to 32 bits (SplitMix64's finaliser), so seeds that differ only in
    their high bits draw differently."""
    if seed < 2**32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from float32 ``logits [vocab]``: argmax at temperature 0, else a draw
    from the temperature-scaled distribution restricted by min-p, then top-k, then top-p.

    Raises:
        ValueError: if no token has a finite logit (every one masked).

    The logits are shifted so their maximum is 0 before the division by the temperature,
    so no value overflows: the most likely token always keeps a positive probability.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    if not bool(torch.isfinite(logits).any()):
        raise ValueError("no token is allowed (every logit is masked)")
    logits = (logits - logits.max()) / float(params.temperature)  # (an int may pass int64)
    if params.min_p > 0:  # (the most likely token has probability ratio 1: always kept)
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
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


def process_logits(
    logits: Tensor,
    histories: list[tuple[SamplingParams, list[int], list[int]]],
    stop: set[int],
    to_device: Callable[[Tensor], Tensor] | None = None,
    *,
    hold_stops: bool = True,
) -> Tensor:
    """The logits of rows whose requests ask for logits processing (:attr:`SamplingParams.
    processes_logits`), processed as :class:`SamplingParams` says (vLLM's order:
    ``logit_bias`` and ``min_tokens``, then the repetition, frequency and presence
    penalties), on ``logits``' device.

    Args:
        logits: ``[R, vocab]``, one row each of ``histories`` (not changed).
        histories: per row, ``(sampling, prompt token ids, generated token ids)``.
        stop: EOS ids (``min_tokens`` holds them back unless ``ignore_eos``).
        to_device: moves a host tensor to ``logits``' device (the engine's pinned staging,
            which does not make the host wait for the device; default: ``Tensor.to``).
        hold_stops: apply ``min_tokens`` (False: the same processing without it, for a row
            whose other constraints allow only its stop tokens).

    Returns:
        float32 ``[R, vocab]``.
    """
    out = logits.float().clone()
    device, (rows, vocab) = out.device, out.shape
    put = to_device or (lambda t: t.to(device))
    bias_rows, bias_ids, bias_values, masked_rows, masked_ids = [], [], [], [], []
    for i, (s, _, generated) in enumerate(histories):
        for token, value in s.logit_bias:
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(float(value))
        if hold_stops and len(generated) < s.min_tokens:
            held = set(s.stop_token_ids) | (set() if s.ignore_eos else stop)
            masked_rows += [i] * len(held)
            masked_ids += sorted(held)
    if bias_rows:
        index = put(torch.tensor([bias_rows, bias_ids]))
        out.index_put_((index[0], index[1]), put(torch.tensor(bias_values)), accumulate=True)
    if masked_rows:
        index = put(torch.tensor([masked_rows, masked_ids]))
        out.index_put_((index[0], index[1]), torch.tensor(float("-inf")))

    def counts(tokens: list[list[int]]) -> Tensor:
        """``[R, vocab]`` float32: how often each token occurs in each row's list."""
        width = max(1, max(map(len, tokens)))
        ids = torch.zeros(rows, width, dtype=torch.long)
        weight = torch.zeros(rows, width)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            weight[i, : len(t)] = 1
        c = torch.zeros(rows, vocab, device=device)
        return c.scatter_add_(1, put(ids), put(weight))

    def per_row(name: str) -> Tensor:
        return put(torch.tensor([float(getattr(s, name)) for s, _, _ in histories]))[:, None]

    if any(s.repetition_penalty != 1.0 for s, _, _ in histories):
        seen = counts([p + g for _, p, g in histories]) > 0
        penalty = per_row("repetition_penalty")
        penalized = torch.where(out > 0, out / penalty, out * penalty)
        out = torch.where(seen, penalized, out)
    if any(s.frequency_penalty or s.presence_penalty for s, _, _ in histories):
        occurs = counts([g for _, _, g in histories])
        frequency, presence = per_row("frequency_penalty"), per_row("presence_penalty")
        out = out - frequency * occurs - presence * (occurs > 0).float()
    return out


class Staging:
    """Pinned host buffers for a step's small host-to-device inputs (row indices, penalty
    histories, grammar bitmasks), two used in turn by step parity: a copy from pageable
    memory would make the host wait for everything queued before it (the step's forward),
    which is what asynchronous scheduling avoids. A buffer is reused two steps later,
    after that step's read-back has waited for its copies. Off CUDA: plain ``.to``.

    Args:
        device: where the steps run.
        words: 4-byte words a step may stage (more falls back to a fresh pinned copy).
    """

    def __init__(self, device: torch.device, words: int) -> None:
        self.device = device
        pin = device.type == "cuda"
        self._buffers = [torch.empty(words, dtype=torch.int32, pin_memory=True)
                         for _ in range(2)] if pin else []  # fmt: skip
        self._turn = 0
        self._used = 0

    def begin(self, step: int) -> None:
        """Start staging step number ``step``."""
        self._turn, self._used = step % 2, 0

    def __call__(self, t: Tensor) -> Tensor:
        """``t`` (a host tensor of 4- or 8-byte elements) on the device, queued without
        waiting."""
        if not self._buffers:
            return t.to(self.device)
        t = t.contiguous()
        words = t.view(-1).view(torch.int32)
        n = words.numel()
        buffer = self._buffers[self._turn]
        if self._used + n > buffer.numel():
            return t.pin_memory().to(self.device, non_blocking=True)
        staged = buffer[self._used : self._used + n]
        self._used += -(-n // 4) * 4  # 16-byte aligned
        staged.copy_(words)
        return staged.to(self.device, non_blocking=True).view(t.dtype).view(t.shape)
