"""The one LoRA layer: a base linear plus, for rows routed to LoRA, ``expand(shrink(x))``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lora_graph import ops
from lora_graph.layout import SlotLayout
from lora_graph.targets import LoraTarget


@dataclass
class BoundInputs:
    """The routing :meth:`LoRAManager.bind_inputs` fans into every LoRA layer for one call:
    the triple ``(lora_ids, grouped_offsets, end)`` over the step's tokens (see
    :mod:`lora_graph.ops`) and the same triple over its requests (``segments``: group
    offsets and end counted in requests, for a per-segment target such as the LM head), or
    None for a base-only step, where no layer calls a LoRA op at all."""

    routing: tuple[Tensor, Tensor, Tensor] | None = None
    segments: tuple[Tensor, Tensor, Tensor] | None = None

    def clear(self) -> None:
        self.routing = None
        self.segments = None


class _SlotBlocks(nn.Module):
    """Per-slot views of one target/layer's A and B blocks (``_a_block``/``_b_block``:
    ``(offset, numel)`` in a flat slot)."""

    _a_block: tuple[int, int]
    _b_block: tuple[int, int]

    def bind_slots(self, slots: tuple[Tensor, ...]) -> None:
        """Take this layer's A and B views from each flat slot ``[numel]``."""
        (a_off, a_n), (b_off, b_n) = self._a_block, self._b_block
        self.a_slots = [s[a_off : a_off + a_n] for s in slots]
        self.b_slots = [s[b_off : b_off + b_n] for s in slots]


class LoRALinear(_SlotBlocks):
    """Wraps a base ``nn.Linear`` (fused or not) of one target family and layer.

    Forward: ``y = base(x)``; if routing is bound, ``y[t, slice_s] += x[t] @ A_s.T @ B_s.T``
    for the rows ``t`` the routing sends to LoRA, with each row's A and B taken from its
    group's slot (the scale is already in B). ``x`` is ``[..., in_features]``; rows are
    the flattened leading dims, in order.

    The layer holds, per slot, views of its own A and B blocks (:meth:`bind_slots`), so its
    forward reads no layer-specific constant: one compiled graph serves every layer.

    A ``per_segment`` target (an LM head) given a 2-D ``x`` ``[requests, in_features]`` is
    routed by request (``BoundInputs.segments``); given ``[B, T, in_features]``, by token.

    With kernels that have ``linear_delta`` (Triton) and at most ``DELTA_MAX_ROWS`` rows
    (decode), the base linear and the delta run in one op, the delta on a side stream
    overlapping the base GEMM, and are added after it (``y + d`` in float32, rounded once);
    otherwise shrink and expand run after the base linear, into its output.
    """

    def __init__(self, base: nn.Linear, *, target_name: str, target: LoraTarget, layer: int,
                 layout: SlotLayout, bound: BoundInputs, kernels: ops.Kernels | None = None) -> None:
        super().__init__()
        if base.in_features != target.in_features or base.out_features != target.out_features:
            raise ValueError(f"{target_name} layer {layer}: base linear {base.in_features}->{base.out_features} "
                             f"does not match the target {target.in_features}->{target.out_features}")
        self.base = base
        self.target_name = target_name
        self.layer = layer
        self.per_segment = target.per_segment
        self.num_slices = target.num_slices
        self.out_slices = list(target.out_slices)
        self.max_rank = layout.max_rank
        self._a_block = (layout.blocks[(target_name, layer)][0], target.num_slices * layout.max_rank * target.in_features)
        self._b_block = (layout.blocks[(target_name, layer)][1], target.out_features * layout.max_rank)
        self._bound = bound
        kernels = kernels or ops.Kernels(ops.lora_shrink, ops.lora_expand_)
        self._shrink, self._expand = kernels.shrink, kernels.expand
        self._linear_delta = kernels.linear_delta
        self.a_slots: list[Tensor] = []
        self.b_slots: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        routing = self._bound.routing
        if routing is None:
            return self.base(x)
        if self.per_segment and x.dim() == 2:
            routing = self._bound.segments
        x2 = x.reshape(-1, x.shape[-1])
        if self._linear_delta is not None and x2.shape[0] <= ops.DELTA_MAX_ROWS:
            y, buf = self._linear_delta(x2, self.base.weight, self.base.bias, self.a_slots, self.b_slots, 0, 0,
                                        self.num_slices, self.max_rank, self.out_slices, *routing)
            d = buf[: y.numel()].view(y.shape)
            return (y + d).to(y.dtype).view(*x.shape[:-1], y.shape[-1])
        y = self.base(x)
        y2 = y.view(-1, y.shape[-1])
        h = self._shrink(x2, self.a_slots, 0, self.num_slices, self.max_rank, *routing)
        self._expand(y2, h, self.b_slots, 0, self.out_slices, *routing)
        return y

    def extra_repr(self) -> str:
        return f"target={self.target_name}, layer={self.layer}, out_slices={self.out_slices}, max_rank={self.max_rank}"


class LoRAEmbedding(_SlotBlocks):
    """Wraps a base ``nn.Embedding`` (an ``embedding`` target).

    Forward: ``y = base(tokens)``; if routing is bound, ``y[t] += A[:, tokens[t]] @ B.T``
    for the tokens the routing sends to LoRA (PEFT's ``lora_embedding_A`` ``[r, vocab]``
    and ``lora_embedding_B`` ``[dim, r]``, scale folded into B). ``tokens`` is any shape of
    int64 ids; rows are its flattened elements, in order.
    """

    def __init__(self, base: nn.Embedding, *, target_name: str, target: LoraTarget, layer: int,
                 layout: SlotLayout, bound: BoundInputs, expand: Any = ops.lora_expand_) -> None:
        super().__init__()
        if base.num_embeddings != target.in_features or base.embedding_dim != target.out_features:
            raise ValueError(f"{target_name}: base embedding {base.num_embeddings}x{base.embedding_dim} does not match "
                             f"the target {target.in_features}x{target.out_features}")
        self.base = base
        self.target_name = target_name
        self.layer = layer
        self.vocab_size = target.in_features
        self.max_rank = layout.max_rank
        a_off, b_off = layout.blocks[(target_name, layer)]
        self._a_block = (a_off, target.in_features * layout.max_rank)
        self._b_block = (b_off, target.out_features * layout.max_rank)
        self._bound = bound
        self._expand = expand
        self.a_slots: list[Tensor] = []
        self.b_slots: list[Tensor] = []

    def forward(self, tokens: Tensor) -> Tensor:
        y = self.base(tokens)
        routing = self._bound.routing
        if routing is None:
            return y
        y2 = y.view(-1, y.shape[-1])
        h = ops.lora_embedding_shrink(tokens.reshape(-1), self.a_slots, 0, self.vocab_size, self.max_rank, *routing)
        self._expand(y2, h, self.b_slots, 0, [y.shape[-1]], *routing)
        return y

    def extra_repr(self) -> str:
        return f"target={self.target_name}, vocab_size={self.vocab_size}, max_rank={self.max_rank}"
