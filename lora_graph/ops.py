"""The segmented LoRA shrink and expand as ``torch.library`` custom ops.

``torch.compile`` sees each as one opaque node; a CUDA graph captures whatever kernel the
op launches. Both read the routing triple and the slot stacks as inputs, so a replay sees
new routing and new slot contents without recompiling.

Routing triple (all on the activations' device):

- ``lora_ids`` ``[G]`` int32: the slot of each group (padding groups: slot 0, empty).
- ``grouped_offsets`` ``[G + 1]`` int32: token offsets of the groups, non-decreasing;
  group ``g`` covers rows ``grouped_offsets[g]:grouped_offsets[g + 1]``.
- ``end`` ``[1]`` int32: rows routed to LoRA; rows at or after it get no delta.

Slot stacks: ``slots``, one flat tensor ``[numel]`` per slot, all views of one pool
``[num_slots, numel]`` (what :class:`~lora_graph.manager.LoRAManager` hands out). A
target's A block starts at ``a_offset`` in every slot, shaped
``[num_slices, max_rank, in_features]``; its B block at ``b_offset``,
``[out_features, max_rank]``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

# Row counts up to which :class:`~lora_graph.layers.LoRALinear` computes its LoRA delta on
# a side stream beside the base linear (decode), when the backend has the side-stream ops;
# above it, shrink + expand run in place after the base linear.
DELTA_MAX_ROWS = 64


def slot_pool_view(slots: list[Tensor], offset: int, shape: tuple[int, ...]) -> Tensor:
    """A ``[len(slots), *shape]`` view of the block at ``offset`` in every slot.

    Zero-copy: the slots are views of one pool with a constant stride between them.

    Raises:
        ValueError: if the slots are not evenly spaced views of one storage.
    """
    base = slots[0]
    n = len(slots)
    stride0 = slots[1].storage_offset() - base.storage_offset() if n > 1 else base.numel()
    last = slots[-1]
    if (
        last.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        or last.storage_offset() != base.storage_offset() + (n - 1) * stride0
        or stride0 < base.numel()
    ):
        raise ValueError("slot stacks must be evenly spaced views of one pool (LoRAManager.input_buffers)")
    strides = []
    acc = 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return base.as_strided((n, *shape), (stride0, *reversed(strides)), base.storage_offset() + offset)


def row_slots(n_rows: int, lora_ids: Tensor, grouped_offsets: Tensor, end: Tensor) -> Tensor:
    """``[n_rows]`` int64: the slot of each row, ``-1`` for rows at or after ``end``."""
    rows = torch.arange(n_rows, device=lora_ids.device, dtype=grouped_offsets.dtype)
    group = torch.searchsorted(grouped_offsets[1:].contiguous(), rows, right=True).clamp_(max=lora_ids.numel() - 1)
    return torch.where(rows < end, lora_ids.long()[group], -1)


@torch.library.custom_op("lora_graph::lora_shrink", mutates_args=())
def lora_shrink(
    x: Tensor,
    slots: list[Tensor],
    a_offset: int,
    num_slices: int,
    max_rank: int,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> Tensor:
    """Semantics: ``h[s, t] = x[t] @ A[slot(t), s].T`` for rows ``t < end``; 0 after.

    Args:
        x: ``[N, in_features]`` activations (float32, bfloat16 or float16).
        slots, a_offset: the slot stacks and the A block's offset (module docstring).
        num_slices, max_rank: the A block's leading dims.
        lora_ids, grouped_offsets, end: the routing triple.

    Returns:
        ``h`` ``[num_slices, N, max_rank]`` float32.
    """
    n, in_features = x.shape
    a = slot_pool_view(slots, a_offset, (num_slices * max_rank, in_features))
    slot_of = row_slots(n, lora_ids, grouped_offsets, end)
    x32 = x.float()
    h = x32.new_zeros(n, num_slices * max_rank)
    for s in range(1, a.shape[0]):  # slot 0 is the zero adapter
        h = torch.where((slot_of == s)[:, None], x32 @ a[s].float().T, h)
    return h.view(n, num_slices, max_rank).transpose(0, 1).contiguous()


@lora_shrink.register_fake
def _(x, slots, a_offset, num_slices, max_rank, lora_ids, grouped_offsets, end):
    return x.new_empty((num_slices, x.shape[0], max_rank), dtype=torch.float32)


@torch.library.custom_op("lora_graph::lora_embedding_shrink", mutates_args=())
def lora_embedding_shrink(
    tokens: Tensor,
    slots: list[Tensor],
    a_offset: int,
    vocab_size: int,
    max_rank: int,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> Tensor:
    """The shrink of an embedding target: ``h[0, t] = A[slot(t)][:, tokens[t]]`` for rows
    ``t < end``, 0 after: ``x @ A.T`` of the token's one-hot, as PEFT's
    ``lora_embedding_A`` defines it. A gather, so one implementation serves every backend.

    Args:
        tokens: ``[N]`` int64 token ids.
        slots, a_offset: the slot stacks and the A block's offset. An embedding's A block
            holds PEFT's ``lora_embedding_A`` transposed, ``[vocab_size, max_rank]``, so a
            token's rank vector is one contiguous row.
        vocab_size, max_rank: the A block's dims.
        lora_ids, grouped_offsets, end: the routing triple.

    Returns:
        ``h`` ``[1, N, max_rank]`` float32, ready for :func:`lora_expand_`.
    """
    a = slot_pool_view(slots, a_offset, (vocab_size, max_rank))
    slot_of = row_slots(tokens.shape[0], lora_ids, grouped_offsets, end)
    h = a[slot_of.clamp(min=0), tokens].float()
    return torch.where((slot_of >= 0)[:, None], h, 0.0)[None]


@lora_embedding_shrink.register_fake
def _(tokens, slots, a_offset, vocab_size, max_rank, lora_ids, grouped_offsets, end):
    return tokens.new_empty((1, tokens.shape[0], max_rank), dtype=torch.float32)


@torch.library.custom_op("lora_graph::lora_expand_", mutates_args=("y",))
def lora_expand_(
    y: Tensor,
    h: Tensor,
    slots: list[Tensor],
    b_offset: int,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> None:
    """Semantics: ``y[t, slice_s] += h[s, t] @ B[slot(t), slice_s].T`` for rows ``t < end``.

    Args:
        y: ``[N, sum(out_slices)]`` base output, updated in place; rows at or after ``end``
            are left bit-for-bit unchanged.
        h: ``[num_slices, N, max_rank]`` float32, from :func:`lora_shrink`.
        slots, b_offset: the slot stacks and the B block's offset (module docstring).
        out_slices: the width of each slice.
        lora_ids, grouped_offsets, end: the routing triple.
    """
    num_slices, n, max_rank = h.shape
    b = slot_pool_view(slots, b_offset, (sum(out_slices), max_rank))
    slot_of = row_slots(n, lora_ids, grouped_offsets, end)
    for s in range(1, b.shape[0]):
        start = 0
        mask = (slot_of == s)[:, None]
        for i, width in enumerate(out_slices):
            delta = h[i] @ b[s, start : start + width].float().T
            y[:, start : start + width] += torch.where(mask, delta, 0.0).to(y.dtype)
            start += width


@lora_expand_.register_fake
def _(y, h, slots, b_offset, out_slices, lora_ids, grouped_offsets, end):
    return None


class Kernels(NamedTuple):
    """The ops a backend serves LoRA with: ``shrink`` / ``expand`` (in place), and for the
    Triton backend ``linear_delta`` (the base linear with the LoRA delta overlapping it on a
    side stream) that decode-sized calls use (None for the torch reference)."""

    shrink: Any
    expand: Any
    linear_delta: Any = None


def kernels(backend: str, device: torch.device) -> Kernels:
    """The :class:`Kernels` of a backend: ``"torch"`` (the reference above), ``"triton"``
    (:mod:`lora_graph.triton_ops`), or ``"auto"`` (Triton on CUDA when it is installed,
    else the reference). The fused one-launch ``lora_apply_triton_`` is not used: it
    measured slower than the pair on the H200 (bench/RESULTS.md).

    Raises:
        ValueError: for ``"triton"`` when Triton is not installed or the device is not CUDA
            (the interpreter, ``TRITON_INTERPRET=1``, also runs it on the CPU).
    """
    reference = Kernels(lora_shrink, lora_expand_)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference
    from lora_graph import triton_ops

    triton_kernels = Kernels(triton_ops.lora_shrink_triton, triton_ops.lora_expand_triton_, triton_ops.lora_linear_delta)
    if backend == "auto":
        return triton_kernels if triton_ops.HAVE_TRITON else reference
    if backend == "triton":
        if not triton_ops.HAVE_TRITON:
            raise ValueError("backend='triton' but Triton is not installed")
        if device.type != "cuda" and not triton_ops.interpreted():
            raise ValueError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
        return triton_kernels
    raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
