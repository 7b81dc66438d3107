"""A packed step: a flat list of tokens from many requests, and the inputs it is run with.

One step runs, for each scheduled request, a *chunk* of its tokens (:class:`SeqChunk`):
one token for a request that is decoding, part or all of the prompt for one that is
prefilling. The chunks' tokens are concatenated with no padding between them; request
``s`` owns tokens ``query_start[s]:query_start[s + 1]`` of the step. Its LoRA routing is
by token (a chunk is one segment under its adapter), its attention reads the request's
pages through its block table (:mod:`lora_graph.paging`).

A model declares which of the step inputs below its forward takes
(``PipelineModelWithKVCache._get_compile_input_types``); :class:`StepBuffer` builds them for every
step into one persistent device buffer (one host-to-device copy a step), so a captured
graph reads each step's inputs in place. All are int32:

- ``tokens`` ``[T]``: the token ids.
- ``positions`` ``[T]``: each token's position in its request.
- ``slot_mapping`` ``[T]``: where each token's K and V are written, as a flat index
  ``page * page_size + offset`` into the KV cache (padding tokens: 0, the scratch page).
- ``block_tables`` ``[S, P]``: each request's pages (``P`` = pages of ``max_seq_len``).
- ``seq_lens`` ``[S]``: each request's length after the step (what attention reads).
- ``query_start`` ``[S + 1]``: the requests' token offsets in the step.
- ``logits_index`` ``[S]``: the step index of each request's last token (its logits row).

``T`` and ``S`` are the step's width: its exact token and request counts when it runs
eagerly, or the capture bucket it is padded to (padding requests have no tokens and
length 0; padding tokens follow the last request's and belong to none).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lora_graph.routing import Routing

# every step input a model may declare, and its shape in terms of the step's width: "T"
# tokens, "S" requests, "P" pages per request
STEP_INPUTS: dict[str, tuple[str, ...]] = {
    "tokens": ("T",),
    "positions": ("T",),
    "slot_mapping": ("T",),
    "block_tables": ("S", "P"),
    "seq_lens": ("S",),
    "query_start": ("S+1",),
    "logits_index": ("S",),
}


# the buffer's own fields after the declared inputs: for the chunks whose token is fed from
# the device (``SeqChunk.fed_from``), that token's index in the step and its source row
_FEED: dict[str, tuple[str, ...]] = {"fed_dst": ("S",), "fed_src": ("S",)}


@dataclass(eq=False)
class SeqChunk:
    """One request's part of a step.

    Attributes:
        adapter: the routing key of its adapter (None: the base model).
        token_ids: the tokens this step computes (the request's tokens from ``start``).
        start: tokens of the request whose K and V are already in the cache (the position
            of the first token here).
        pages: its block table, covering at least ``start + len(token_ids)`` positions.
        owner: the caller's object for this request (the engine's sequence).
        fed_from: for a one-token chunk whose token is still on the device (the previous
            step sampled it and the host has not read it yet): its row in the ``fed_tokens``
            passed to :meth:`StepBuffer.fill`, which writes it in place of ``token_ids[0]``
            on the device. None: ``token_ids`` are the tokens.
    """

    adapter: str | None
    token_ids: Sequence[int]
    start: int = 0
    pages: Sequence[int] = ()
    owner: Any = None
    fed_from: int | None = None


@dataclass
class ModelInputs:
    """One step's inputs: the declared step inputs (device views of the
    :class:`StepBuffer`), its LoRA routing (None: base-only), and its chunks in step order
    (sorted by adapter, base last), one logits row each. ``width`` is ``(T, S)``;
    ``all_logits`` returns every token's logits (eager only)."""

    inputs: dict[str, Tensor]
    routing: Routing | None
    chunks: list[SeqChunk]
    width: tuple[int, int]
    all_logits: bool = False


class StepBuffer:
    """The persistent device buffer of a model's step inputs and its pinned staging twin.

    Args:
        types: the step inputs the model takes, name to shape (entries of
            :data:`STEP_INPUTS`).
        max_tokens: ``T`` of the widest step.
        max_seqs: ``S`` of the widest step.
        max_pages: ``P``, pages of one request's block table.
        page_size: positions per KV cache page.
        device: where the step runs.

    Raises:
        ValueError: for a name not in :data:`STEP_INPUTS`, or a shape other than its own.
    """

    def __init__(self, types: dict[str, tuple[str, ...]], *, max_tokens: int, max_seqs: int,
                 max_pages: int, page_size: int, device: torch.device) -> None:  # fmt: skip
        unknown = [n for n in types if n not in STEP_INPUTS]
        if unknown:
            raise ValueError(f"unknown step inputs {unknown} (known: {', '.join(STEP_INPUTS)})")
        wrong = [n for n, dims in types.items() if tuple(dims) != STEP_INPUTS[n]]
        if wrong:
            raise ValueError(
                "step inputs declared with another shape: "
                + ", ".join(f"{n} {tuple(types[n])} (is {STEP_INPUTS[n]})" for n in wrong)
            )
        self.names = tuple(types)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.max_pages, self.page_size = max_pages, page_size
        size = {"T": max_tokens, "S": max_seqs, "S+1": max_seqs + 1, "P": max_pages}
        self._start: dict[str, int] = {}
        total = 0
        # the declared inputs, then the fed tokens' step indices and source rows (``fed_from``)
        for name, dims in [*((n, STEP_INPUTS[n]) for n in self.names), *_FEED.items()]:
            self._start[name] = total
            numel = int(np.prod([size[d] for d in dims]))
            total += -(-numel // 4) * 4  # each field on a 16-byte boundary
        pin = device.type == "cuda"
        self._device = torch.zeros(max(total, 1), dtype=torch.int32, device=device)
        self._staging = torch.zeros(max(total, 1), dtype=torch.int32, pin_memory=pin)
        self._host = self._staging.numpy()
        self._staged = torch.cuda.Event() if pin else None

    @property
    def buffer(self) -> Tensor:
        """The flat int32 device buffer every input is a view of (tensor parallelism sends
        it to the other ranks whole)."""
        return self._device

    def views(self, width: tuple[int, int]) -> dict[str, Tensor]:
        """The device views of every step input at width ``(T, S)``: always the same
        addresses for one width, so a graph captured on them reads later steps in place."""
        t, s = width
        size = {"T": t, "S": s, "S+1": s + 1, "P": self.max_pages}
        out = {}
        for name in self.names:
            shape = [size[d] for d in STEP_INPUTS[name]]
            start = self._start[name]
            out[name] = self._device[start : start + int(np.prod(shape))].view(*shape)
        return out

    def fill(
        self,
        chunks: Sequence[SeqChunk],
        width: tuple[int, int],
        fed_tokens: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Write a step's inputs, padded to ``width``, and copy them to the device; then,
        on the device, each chunk's token that has a ``fed_from`` row is taken from
        ``fed_tokens`` (integer ``[R]`` on the step's device; no host sync).

        Raises:
            ValueError: if the chunks do not fit ``width`` or the buffer, a chunk's pages
                do not cover its tokens, or a chunk has a ``fed_from`` but no one-token
                chunk, no ``fed_tokens`` or no ``tokens`` input to take it.
        """
        t, s = width
        n = sum(len(c.token_ids) for c in chunks)
        if n > t or len(chunks) > s or t > self.max_tokens or s > self.max_seqs:
            raise ValueError(
                f"a step of {n} tokens from {len(chunks)} requests does not fit width {width} "
                f"(at most {self.max_tokens} tokens, {self.max_seqs} requests)"
            )
        if self._staged is not None:
            self._staged.synchronize()  # the last copy must have left the staging buffer
        h = self._host
        want = set(self.names)

        def field_(name: str, numel: int) -> np.ndarray:
            return h[self._start[name] : self._start[name] + numel]

        page, p = self.page_size, self.max_pages
        lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, len(chunks))
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        query_start = np.full(s + 1, n, dtype=np.int32)
        query_start[: len(chunks)] = np.cumsum(lens) - lens
        seq_lens = np.zeros(s, dtype=np.int32)
        seq_lens[: len(chunks)] = starts + lens
        # every request's pages, in a [S, P] table (the step's input, or a scratch table)
        if "block_tables" in want:
            tables = field_("block_tables", s * p).reshape(s, p)
        else:
            tables = np.empty((s, p), dtype=np.int32)
        tables[...] = 0
        paged = "block_tables" in want or "slot_mapping" in want  # (an encoder has no pages)
        for i, c in enumerate(chunks):
            held = len(c.pages)
            if paged and (held * page < seq_lens[i] or held > p):
                raise ValueError(
                    f"chunk {i}: {held} pages of {page} do not hold {seq_lens[i]} positions "
                    f"(at most {p} pages a request)"
                )
            tables[i, : min(held, p)] = c.pages[:p]
        # per token: its request, its position, where its K and V go
        owner = np.repeat(np.arange(len(chunks)), lens)
        pos = np.arange(n) - np.repeat(query_start[: len(chunks)] - starts, lens)
        fed = [(i, c.fed_from) for i, c in enumerate(chunks) if c.fed_from is not None]
        if fed and (fed_tokens is None or "tokens" not in want):
            missing = "fed_tokens" if fed_tokens is None else "tokens input"
            raise ValueError(f"a chunk's token is fed from the device, but there is no {missing}")
        if any(lens[i] != 1 for i, _ in fed):
            raise ValueError("only a one-token chunk can have its token fed from the device")
        if fed:
            field_("fed_dst", len(fed))[...] = [query_start[i] for i, _ in fed]
            field_("fed_src", len(fed))[...] = [row for _, row in fed]
        if "tokens" in want:
            tokens = field_("tokens", t)
            tokens[...] = 0
            tokens[:n] = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        if "positions" in want:
            positions = field_("positions", t)
            positions[...] = 0
            positions[:n] = pos
        if "slot_mapping" in want:
            slots = field_("slot_mapping", t)
            slots[...] = 0
            slots[:n] = tables[owner, pos // page] * page + pos % page
        if "seq_lens" in want:
            field_("seq_lens", s)[...] = seq_lens
        if "query_start" in want:
            field_("query_start", s + 1)[...] = query_start
        if "logits_index" in want:
            last = field_("logits_index", s)
            last[...] = 0
            last[: len(chunks)] = query_start[1 : len(chunks) + 1] - 1
        self._device.copy_(self._staging, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        views = self.views(width)
        if fed:
            assert fed_tokens is not None  # (refused above)
            k = len(fed)
            dst, src = (self._device[self._start[f] : self._start[f] + k].long() for f in _FEED)
            views["tokens"].index_copy_(0, dst, fed_tokens.index_select(0, src).to(torch.int32))
        return views


__all__ = ["STEP_INPUTS", "ModelInputs", "SeqChunk", "StepBuffer"]
