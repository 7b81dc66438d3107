"""The pure-torch reference of every LoRA op (:mod:`lora_graph.ops`): the CPU
implementation, and the twin every fast kernel is tested against.

``*routing`` is the triple ``(lora_ids, grouped_offsets, end)``. ``ranks`` (each slot's
rank, ``[num_slots]``) is accepted and not needed: a slot's A rows and B columns at or
above its rank are zeros, which the reference reads like any other value (the kernels use
it to skip them). Slot stacks are each LoRA layer's views of the slot pool: ``a``
``[num_slots, S * R, K]`` (the A of slice ``s`` in rows ``s*R:(s+1)*R``), ``b``
``[num_slots, out_features, R]``;
an embedding's ``a`` is ``[num_slots, vocab, R]`` (PEFT's ``lora_embedding_A``
transposed). Slot 0 is the zero adapter. Routing: :mod:`lora_graph.routing`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lora_graph.routing import row_slots


def shrink(
    x: Tensor, a: Tensor, num_slices: int, *routing: Tensor, ranks: Tensor | None = None
) -> Tensor:
    """Semantics: ``h[s, t] = x[t] @ a[slot(t), s*R:(s+1)*R].T`` for rows ``t < end``; 0 after.

    Returns ``h`` ``[num_slices, N, R]`` float32."""
    n = x.shape[0]
    sr = a.shape[1]
    slot_of = row_slots(n, *routing)
    x32 = x.float()
    h = x32.new_zeros(n, sr)
    for s in range(1, a.shape[0]):  # slot 0 is the zero adapter
        h = torch.where((slot_of == s)[:, None], x32 @ a[s].float().T, h)
    return h.view(n, num_slices, sr // num_slices).transpose(0, 1).contiguous()


def embedding_shrink(tokens: Tensor, a: Tensor, *routing: Tensor) -> Tensor:
    """Semantics: ``h[0, t] = a[slot(t), tokens[t]]`` for rows ``t < end``, 0 after (``x @ A.T``
    of the token's one-hot). Returns ``h`` ``[1, N, R]`` float32."""
    slot_of = row_slots(tokens.shape[0], *routing)
    h = a[slot_of.clamp(min=0), tokens].float()
    return torch.where((slot_of >= 0)[:, None], h, 0.0)[None]


def expand_(
    y: Tensor, h: Tensor, b: Tensor, out_slices: list[int], *routing: Tensor,
    ranks: Tensor | None = None,
) -> None:  # fmt: skip
    """Semantics: ``y[t, slice_s] += h[s, t] @ b[slot(t), slice_s].T`` for rows ``t < end``; rows
    at or after ``end`` are left bit-for-bit unchanged."""
    slot_of = row_slots(h.shape[1], *routing)
    for s in range(1, b.shape[0]):
        start = 0
        mask = (slot_of == s)[:, None]
        for i, width in enumerate(out_slices):
            delta = h[i] @ b[s, start : start + width].float().T
            y[:, start : start + width] += torch.where(mask, delta, 0.0).to(y.dtype)
            start += width


def expand_silu_mul(
    y: Tensor, h: Tensor, b: Tensor, *routing: Tensor, ranks: Tensor | None = None
) -> Tensor:
    """Semantics: ``[g | u] = y`` (``[N, 2I]``) after :func:`expand_` with slices ``(I, I)``
    (on a copy; ``y`` is unchanged); returns ``silu(g) * u`` ``[N, I]`` in ``y``'s dtype (the
    gated MLP's activation, Shazeer 2020, "GLU Variants Improve Transformer")."""
    y = y.clone()
    i = y.shape[1] // 2
    expand_(y, h, b, [i, i], *routing)
    gate, up = y.split(i, dim=1)
    return torch.nn.functional.silu(gate) * up


def linear_delta(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, num_slices: int,
    out_slices: list[int], *routing: Tensor, ranks: Tensor | None = None
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Semantics: ``y = x @ weight.T + bias`` and the float32 delta ``d`` that
    :func:`expand_` would add, returned as ``(y, buf)`` with ``d`` the first
    ``N * sum(out_slices)`` elements of ``buf`` (row-major), ``h`` after it."""
    n = x.shape[0]
    out_features = sum(out_slices)
    h = shrink(x, a, num_slices, *routing)
    d = torch.zeros(n, out_features, dtype=torch.float32, device=x.device)
    expand_(d, h, b, out_slices, *routing)
    return torch.nn.functional.linear(x, weight, bias), torch.cat([d.reshape(-1), h.reshape(-1)])


def linear_delta_stacked(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, num_slices: int,
    out_slices: list[int], *routing: Tensor, ranks: Tensor | None = None
) -> Tensor:  # fmt: skip
    """Semantics: :func:`linear_delta`'s ``y`` and ``d`` stacked, ``[2, N, sum(out_slices)]``
    in ``x``'s dtype (``d`` rounded to it)."""
    y, buf = linear_delta(x, weight, bias, a, b, num_slices, out_slices, *routing)
    return torch.stack([y, buf[: y.numel()].view(y.shape).to(y.dtype)])


def linear_shrink(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, num_slices: int, *routing: Tensor,
    ranks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Semantics: ``(x @ weight.T + bias, shrink(x, a, num_slices, *routing))``."""
    return torch.nn.functional.linear(x, weight, bias), shrink(x, a, num_slices, *routing)
