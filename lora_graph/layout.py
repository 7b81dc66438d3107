"""Where each target's A and B live inside one slot's flat buffer."""

from __future__ import annotations

import torch
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
        self.order = list(self.blocks)  # the blocks in slot order
        self.position = {key: i for i, key in enumerate(self.order)}

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

    def write(self, slot: Tensor, image: AdapterImage) -> None:
        """Overwrite a flat slot (any device) with ``image``: zeros, then each of its blocks
        at its rank. The image crosses to the slot's device in one copy (asynchronous from
        pinned memory); it is then placed there with two copies a target (its A rows and B
        columns of every layer at once, as strided views), a block at a time only for a
        target whose layers are not one run."""
        slot.zero_()
        data = image.data.to(slot.device, non_blocking=True)
        r = image.rank
        for target, layers in image.runs():
            t = self.targets[target]
            if t.kind == "embedding" or len(layers) == 1:
                for layer in layers:  # (a slot's A is [S, R, K] or [vocab, R])
                    self.a_view(slot, target, layer)[:, :r].copy_(image.a(target, layer, data))
                    self.b_view(slot, target, layer)[:, :r].copy_(image.b(target, layer, data))
                continue
            n, R = len(layers), self.max_rank
            a0, b0 = self.blocks[(target, layers[0])]
            step = self.blocks[(target, layers[1])][0] - a0
            ia0, ib0 = image.offsets[(target, layers[0])]
            istep = image.offsets[(target, layers[1])][0] - ia0
            S, K, out = t.num_slices, t.in_features, t.out_features
            base, ibase = slot.storage_offset(), data.storage_offset()
            slot.as_strided((n, S, r, K), (step, R * K, K, 1), base + a0).copy_(
                data.as_strided((n, S, r, K), (istep, r * K, K, 1), ibase + ia0)
            )
            slot.as_strided((n, out, r), (step, R, 1), base + b0).copy_(
                data.as_strided((n, out, r), (istep, r, 1), ibase + ib0)
            )

    def read(self, slot: Tensor, rank: int) -> AdapterImage:
        """A host image of a flat slot holding an adapter of ``rank``: its blocks with a
        nonzero value, at that rank (the inverse of :meth:`write`)."""
        blocks = [
            (target, layer)
            for target, layer in self.blocks
            if bool(self.a_view(slot, target, layer).any())
            or bool(self.b_view(slot, target, layer).any())
        ]
        image = AdapterImage(self, blocks, rank, slot.dtype)
        for target, layer in blocks:
            image.a(target, layer).copy_(self.a_view(slot, target, layer)[:, :rank])
            image.b(target, layer).copy_(self.b_view(slot, target, layer)[:, :rank])
        return image


class AdapterImage:
    """One adapter normalised for the slots, at its own targets and rank: for each
    ``(target, layer)`` it has, ``A [num_slices, rank, in_features]`` (an embedding
    target's: ``[vocab_size, rank]``, transposed as in a slot) and ``B [out_features,
    rank]`` with the scale folded in, in one flat buffer (host memory; pinned on CUDA).

    A slot holds every target at ``max_rank``; an image holds only what the adapter has,
    so the host tier keeps about the adapter's own bytes (a rank-8 adapter on two
    projections is not padded to every target at the pool's rank). :meth:`SlotLayout.write`
    expands it into a slot; the blocks it lacks are zero there.

    Args:
        layout: the slot layout the image is written into.
        blocks: the ``(target, layer)`` blocks the adapter has.
        rank: the adapter's rank (its largest module's).
        dtype: the slot dtype.
        data: the flat buffer (None: zeros).
    """

    def __init__(
        self,
        layout: SlotLayout,
        blocks: list[tuple[str, int]],
        rank: int,
        dtype: torch.dtype,
        data: Tensor | None = None,
    ) -> None:
        self.rank = rank
        self.layout = layout
        self.targets = layout.targets
        self.offsets: dict[tuple[str, int], tuple[int, int]] = {}
        offset = 0
        for key in sorted(blocks, key=lambda k: layout.blocks[k]):  # slot order
            t = self.targets[key[0]]
            a_off = offset
            offset += t.num_slices * rank * t.in_features
            self.offsets[key] = (a_off, offset)
            offset += t.out_features * rank
        self.numel = offset
        self.data = torch.zeros(offset, dtype=dtype) if data is None else data

    @property
    def nbytes(self) -> int:
        """Bytes of the image's buffer."""
        return self.data.numel() * self.data.element_size()

    def a(self, target: str, layer: int, data: Tensor | None = None) -> Tensor:
        """``A [num_slices, rank, in_features]`` (embedding: ``[vocab_size, rank]``) in the
        image's buffer, or in ``data``, a copy of it (on another device)."""
        t = self.targets[target]
        a_off, b_off = self.offsets[(target, layer)]
        flat = (self.data if data is None else data)[a_off:b_off]
        if t.kind == "embedding":
            return flat.view(t.in_features, self.rank)
        return flat.view(t.num_slices, self.rank, t.in_features)

    def b(self, target: str, layer: int, data: Tensor | None = None) -> Tensor:
        """``B [out_features, rank]`` in the image's buffer, or in ``data`` (as :meth:`a`)."""
        t = self.targets[target]
        _, b_off = self.offsets[(target, layer)]
        flat = (self.data if data is None else data)[b_off : b_off + t.out_features * self.rank]
        return flat.view(t.out_features, self.rank)

    def runs(self) -> list[tuple[str, list[int]]]:
        """The image's blocks as ``(target, layers)`` runs: layers consecutive in the slot
        layout, whose blocks lie at one fixed stride both in a slot and in the image."""
        runs: list[tuple[str, list[int]]] = []
        for target, layer in self.offsets:  # (in slot order)
            if (
                runs
                and runs[-1][0] == target
                and self._next_in_layout(target, runs[-1][1][-1]) == layer
            ):
                runs[-1][1].append(layer)
            else:
                runs.append((target, [layer]))
        return runs

    def _next_in_layout(self, target: str, layer: int) -> int | None:
        """The layer whose block follows ``layer``'s in the slot layout (same target)."""
        order = self.layout.order
        at = self.layout.position[(target, layer)] + 1
        following = order[at] if at < len(order) else None
        return following[1] if following is not None and following[0] == target else None

    def pin_memory(self) -> AdapterImage:
        """Pin the image's buffer (on CUDA: slot loads then copy asynchronously); returns
        the image."""
        if not self.data.is_pinned():
            self.data = self.data.pin_memory()
        return self

    def is_pinned(self) -> bool:
        return self.data.is_pinned()

    def write(self, slot: Tensor) -> None:
        """Overwrite a flat slot with this image (:meth:`SlotLayout.write`)."""
        self.layout.write(slot, self)
