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
    the triple ``(lora_ids, grouped_offsets, end)`` (see :mod:`lora_graph.ops`), or None for
    a base-only step, where no layer calls a LoRA op at all."""

    routing: tuple[Tensor, Tensor, Tensor] | None = None

    def clear(self) -> None:
        self.routing = None


class LoRALinear(nn.Module):
    """Wraps a base ``nn.Linear`` (fused or not) of one target family and layer.

    Forward: ``y = base(x)``; if routing is bound, ``y[t, slice_s] += x[t] @ A_s.T @ B_s.T``
    for the rows ``t`` the routing sends to LoRA, with each row's A and B taken from its
    group's slot (the scale is already in B). ``x`` is ``[..., in_features]``; rows are
    the flattened leading dims, in order.

    The layer holds, per slot, views of its own A and B blocks (:meth:`bind_slots`), so its
    forward reads no layer-specific constant: one compiled graph serves every layer.
    """

    def __init__(self, base: nn.Linear, *, target_name: str, target: LoraTarget, layer: int,
                 layout: SlotLayout, bound: BoundInputs, kernels: tuple[Any, Any] = (ops.lora_shrink, ops.lora_expand_)) -> None:
        super().__init__()
        if base.in_features != target.in_features or base.out_features != target.out_features:
            raise ValueError(f"{target_name} layer {layer}: base linear {base.in_features}->{base.out_features} "
                             f"does not match the target {target.in_features}->{target.out_features}")
        self.base = base
        self.target_name = target_name
        self.layer = layer
        self.num_slices = target.num_slices
        self.out_slices = list(target.out_slices)
        self.max_rank = layout.max_rank
        self._a_block = (layout.blocks[(target_name, layer)][0], target.num_slices * layout.max_rank * target.in_features)
        self._b_block = (layout.blocks[(target_name, layer)][1], target.out_features * layout.max_rank)
        self._bound = bound
        self._shrink, self._expand = kernels
        self.a_slots: list[Tensor] = []
        self.b_slots: list[Tensor] = []

    def bind_slots(self, slots: tuple[Tensor, ...]) -> None:
        """Take this layer's A and B views from each flat slot ``[numel]``."""
        (a_off, a_n), (b_off, b_n) = self._a_block, self._b_block
        self.a_slots = [s[a_off : a_off + a_n] for s in slots]
        self.b_slots = [s[b_off : b_off + b_n] for s in slots]

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        routing = self._bound.routing
        if routing is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        h = self._shrink(x2, self.a_slots, 0, self.num_slices, self.max_rank, *routing)
        self._expand(y2, h, self.b_slots, 0, self.out_slices, *routing)
        return y

    def extra_repr(self) -> str:
        return f"target={self.target_name}, layer={self.layer}, out_slices={self.out_slices}, max_rank={self.max_rank}"
