"""The one LoRA layer: a base linear plus, for rows routed to LoRA, ``expand(shrink(x))``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lora_graph import ops
from lora_graph.layout import SlotLayout
from lora_graph.targets import LoraTarget


@dataclass
class BoundInputs:
    """What :meth:`LoRAManager.bind_inputs` fans into every LoRA layer for one call.

    ``routing`` is the triple ``(lora_ids, grouped_offsets, end)`` (see :mod:`lora_graph.ops`)
    and ``slots`` the per-slot stacks, or both None for a base-only step: then no layer
    calls a LoRA op at all.
    """

    routing: tuple[Tensor, Tensor, Tensor] | None = None
    slots: tuple[Tensor, ...] | None = None

    def clear(self) -> None:
        self.routing = None
        self.slots = None


class LoRALinear(nn.Module):
    """Wraps a base ``nn.Linear`` (fused or not) of one target family and layer.

    Forward: ``y = base(x)``; if inputs are bound, ``y[t, slice_s] += x[t] @ A_s.T @ B_s.T``
    for the rows ``t`` the routing sends to LoRA, with each row's A and B taken from its
    group's slot (the scale is already in B). ``x`` is ``[..., in_features]``; rows are
    the flattened leading dims, in order.
    """

    def __init__(self, base: nn.Linear, *, target_name: str, target: LoraTarget, layer: int,
                 layout: SlotLayout, bound: BoundInputs) -> None:
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
        self.a_offset, self.b_offset = layout.blocks[(target_name, layer)]
        self._bound = bound

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        bound = self._bound
        if bound.routing is None or bound.slots is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        slots = list(bound.slots)
        h = ops.lora_shrink(x2, slots, self.a_offset, self.num_slices, self.max_rank, *bound.routing)
        ops.lora_expand_(y2, h, slots, self.b_offset, self.out_slices, *bound.routing)
        return y

    def extra_repr(self) -> str:
        return f"target={self.target_name}, layer={self.layer}, out_slices={self.out_slices}, max_rank={self.max_rank}"
