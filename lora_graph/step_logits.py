"""What the engine does with a step's logits before and after the device samples: the
rows that process their logits (penalties, ``logit_bias``, ``min_tokens``, a grammar's
mask), the per-row flags and greedy tokens read back (:class:`InFlight`), the greedy rows'
packed logprobs, the prompt logprobs a step computed, and each read token's logprob.

Every function here touches only the rows whose requests ask; a step where none asks
runs none of it (the decode path of a plain batch is the argmax and the NaN check)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lora_graph.grammar import allocate_bitmask, apply_bitmask
from lora_graph.pipeline import PipelineModel
from lora_graph.requests import RequestState, TokenLogprob
from lora_graph.sampling import (
    Staging,
    pack_logprobs,
    process_logits,
    token_logprob,
    unpack_logprob,
)
from lora_graph.step import ModelInputs

NAN_ROW = "the model produced NaN logits for this request"  # its numerics (a half overflow)
MASKED_ROW = (
    "no token is allowed for this request (its grammar, min_tokens and stop tokens leave none)"
)


@dataclass(eq=False)
class InFlight:
    """A step whose sampled tokens the host has not read yet (asynchronous scheduling):
    ``rows[j]`` is the logits row of ``seqs[j]``; ``device`` holds ``[2, S]`` (flags:
    :func:`row_error`; greedy token) per row on the step's device, ``host`` its copy,
    complete once ``done`` (a CUDA event; None on the CPU) has passed; ``hot`` the float32
    logits of the rows that sample at a temperature (read at once), ``raw_hot`` those of
    them before processing (their logprobs); ``logprobs`` the greedy rows' packed
    log-probabilities on the host (:func:`pack_logprobs` with ``logprobs_k`` top tokens),
    row ``logprob_rows[row]`` for logits row ``row``."""

    seqs: list[RequestState]
    rows: list[int]
    device: Tensor
    host: Tensor
    done: torch.cuda.Event | None
    hot: dict[int, Tensor]
    logprobs: Tensor | None = None
    logprob_rows: dict[int, int] | None = None
    logprobs_k: int = 0
    read: bool = False  # its tokens were read back (once)
    raw_hot: dict[int, Tensor] = field(default_factory=dict)


def row_error(flag: int) -> str | None:
    """The error of a row read back with ``flag`` (bit 1: NaN logits; bit 2: every token
    masked), None for a row that samples."""
    return NAN_ROW if flag & 1 else (MASKED_ROW if flag else None)


def process_rows(
    logits: Tensor,
    width: int,
    processed: list[tuple[int, RequestState]],
    eos: set[int],
    staging: Staging,
) -> Tensor:
    """``logits[:width]`` as float32 with the rows ``processed`` (``(row, request)``, each
    asking for penalties, a bias, ``min_tokens`` or a grammar) processed; every other row
    is the step's own, bit for bit. A grammar's mask is filled on the host (its matcher)
    and applied on the device; a row whose grammar allows only its stop tokens while
    ``min_tokens`` holds them back gets its stops (else no token would be allowed)."""
    index = staging(torch.tensor([i for i, _ in processed]))
    histories = [(s.request.sampling, s.request.prompt_token_ids, s.generated)
                 for _, s in processed]  # fmt: skip
    rows_in = logits[index]
    new = process_logits(rows_in, histories, eos, staging)
    free = None
    if any(len(s.generated) < s.request.sampling.min_tokens for _, s in processed):
        free = process_logits(rows_in, histories, eos, staging, hold_stops=False)
    held = [j for j, (_, s) in enumerate(processed)
            if s.matcher is not None and not s.matcher.is_terminated()]  # fmt: skip
    if held:
        mask = allocate_bitmask(len(processed), new.shape[1])
        for j in held:
            processed[j][1].matcher.fill_next_token_bitmask(mask, j)
        mask = staging(mask)
        new = apply_bitmask(new, mask)
        free = apply_bitmask(free, mask) if free is not None else None
    if free is not None:
        new = torch.where(torch.isneginf(new).all(dim=-1, keepdim=True), free, new)
    return logits[:width].float().index_copy(0, index, new)


def queue_logprobs(step: InFlight, logits: Tensor, staging: Staging, buffer: Tensor) -> None:
    """Pack the log-probabilities of the greedy rows whose requests ask for them (from
    the unprocessed ``logits``), and queue their copy into ``buffer`` (pinned on CUDA); a
    row sampled at a temperature gets them from its logits on the host, at read-back."""
    want = [
        (row, k)
        for row, s in zip(step.rows, step.seqs, strict=True)
        if (k := s.request.sampling.logprobs) is not None and row not in step.hot
    ]
    if not want:
        return
    k = max(k for _, k in want)
    index = staging(torch.tensor([row for row, _ in want]))
    packed = pack_logprobs(logits[index], step.device[1][index], k)
    host = buffer[: packed.numel()].view(packed.shape)
    host.copy_(packed, non_blocking=host.is_pinned())
    step.logprobs, step.logprobs_k = host, k
    step.logprob_rows = {row: j for j, (row, _) in enumerate(want)}


def record_prompt_logprobs(pipeline: PipelineModel, inputs: ModelInputs) -> None:
    """Record the prompt-token log-probabilities a step computed, for the requests that
    ask: the token at position ``p + 1`` of a prompt under the logits at ``p``, those rows'
    logits taken from the step's hidden states (:meth:`PipelineModel.logits_at`; the step
    itself ran as any other, captured or not). A prompt computed again after a preemption
    writes the same values again."""
    rows, targets, owners = [], [], []
    offset = 0
    for c in inputs.chunks:
        seq = c.owner
        k = seq.request.sampling.prompt_logprobs
        prompt = seq.request.prompt_token_ids
        if k is not None:
            for p in range(c.start, min(c.start + len(c.token_ids), len(prompt) - 1)):
                rows.append(offset + p - c.start)
                targets.append(prompt[p + 1])
                owners.append((seq, p + 1, k))
        offset += len(c.token_ids)
    if not rows:
        return
    width = max(k for _, _, k in owners)
    logits = pipeline.logits_at(inputs, rows)
    packed = pack_logprobs(logits, torch.tensor(targets).to(logits.device), width)
    for values, token, (seq, position, k) in zip(packed.tolist(), targets, owners,
                                                 strict=True):  # fmt: skip
        seq.prompt_logprobs[position] = unpack_logprob(values, token, k, width)


def grammar_refuses(seq: RequestState, token: int) -> bool:
    """Advance ``seq``'s grammar matcher by ``token``; whether it refused it (the mask
    allows only tokens it accepts; a finished grammar takes nothing more)."""
    matcher = seq.matcher
    return matcher is not None and not matcher.is_terminated() and not matcher.accept_token(token)


def logprob_of(step: InFlight, row: int, token: int, k: int | None) -> TokenLogprob | None:
    """The read ``token``'s log-probability at logits ``row`` of ``step`` (None if its
    request did not ask)."""
    if k is None:
        return None
    if row in step.hot:
        return token_logprob(step.raw_hot.get(row, step.hot[row]), token, k)
    assert step.logprobs is not None and step.logprob_rows is not None
    packed = step.logprobs[step.logprob_rows[row]].tolist()
    return unpack_logprob(packed, token, k, step.logprobs_k)
