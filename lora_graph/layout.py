"""Where each target's A and B live inside one slot's flat buffer."""

from __future__ import annotations

from torch import Tensor

from lora_graph.targets import LoraTarget

_ALIGN = 64  # elements; keeps every block 128-byte aligned in bf16


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SlotLayout:
    """The layout of one slot: a flat buffer holding, for every target and layer,
    ``A [num_slices, max_rank, in_features]`` then ``B [out_features, max_rank]``.

    An adapter of rank ``r < max_rank`` fills ``A[:, :r]`` and ``B[:, :r]``; the rest is zero,
    so a slot's delta is exactly the adapter's. The scale is already folded into B.

    An embedding target (``kind="embedding"``) stores its A transposed,
    ``[vocab_size, max_rank]`` (``in_features`` is the vocabulary), so the shrink's gather
    reads one contiguous row per token; its B is ``[embedding_dim, max_rank]`` as usual.
    """

    def __init__(self, targets: dict[str, LoraTarget], num_layers: int, max_rank: int) -> None:
        self.targets = targets
        self.max_rank = max_rank
        self.blocks: dict[tuple[str, int], tuple[int, int]] = {}
        offset = 0
        for name, target in targets.items():
            for layer in target.layer_ids(num_layers):
                a_off = offset
                offset = _aligned(offset + target.num_slices * max_rank * target.in_features)
                b_off = offset
                offset = _aligned(offset + target.out_features * max_rank)
                self.blocks[(name, layer)] = (a_off, b_off)
        self.numel = offset

    def a_view(self, slot: Tensor, target: str, layer: int) -> Tensor:
        """``A [num_slices, max_rank, in_features]`` of ``(target, layer)`` in a flat slot
        (an embedding target's: ``[vocab_size, max_rank]``)."""
        t = self.targets[target]
        a_off, _ = self.blocks[(target, layer)]
        n = t.num_slices * self.max_rank * t.in_features
        if t.kind == "embedding":
            return slot[a_off : a_off + n].view(t.in_features, self.max_rank)
        return slot[a_off : a_off + n].view(t.num_slices, self.max_rank, t.in_features)

    def b_view(self, slot: Tensor, target: str, layer: int) -> Tensor:
        """``B [out_features, max_rank]`` of ``(target, layer)`` in a flat slot."""
        t = self.targets[target]
        _, b_off = self.blocks[(target, layer)]
        n = t.out_features * self.max_rank
        return slot[b_off : b_off + n].view(t.out_features, self.max_rank)
