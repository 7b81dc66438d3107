"""The LoRA layers, and the plain layers a model declares where an adapter may attach.

A model builds each LoRA-targetable projection as :class:`Linear` (or :class:`Embedding`)
and calls it as ``proj(x, routing)``: the plain layer ignores the routing. Wrapping
(:mod:`lora_graph.wrapping`) swaps in :class:`LoRALinear` / :class:`LoRAEmbedding`, which
add the adapters' delta for the rows the routing sends to them. Routing is an explicit
argument (:class:`~lora_graph.routing.Routing`, or None for a base-only step), never state
bound into the layers.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lora_graph import ops
from lora_graph.routing import Routing
from lora_graph.targets import LoraTarget


class Linear(nn.Linear):
    """An ``nn.Linear`` a model declares for a LoRA target: ``forward(x, routing)`` ignores
    the routing."""

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        return super().forward(x)

    def silu_and_mul(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """A gated MLP's activation (SwiGLU; Shazeer 2020, "GLU Variants Improve
        Transformer"): ``silu(g) * u`` where ``[g | u] = self(x)`` splits the output in two
        halves. ``[..., in]`` -> ``[..., out / 2]``."""
        return _silu_and_mul(self(x, routing))


def _silu_and_mul(y: Tensor) -> Tensor:
    gate, up = y.split(y.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


class Embedding(nn.Embedding):
    """An ``nn.Embedding`` a model declares for a LoRA target: ``forward(tokens, routing)``
    ignores the routing."""

    def forward(self, tokens: Tensor, routing: Routing | None = None) -> Tensor:
        return super().forward(tokens)


class _LoRALayer(nn.Module):
    """What every LoRA layer holds: its base module, its target, and its views of the slot
    pool, ``a`` and ``b`` (``[num_slots, ...]``, set once by wrapping: loading an adapter
    into a slot rewrites the pool in place), and ``ranks``, the pool's rank of each slot
    (``[num_slots]`` int32, or None), handed to the kernels so they skip the zero columns.

    Raises:
        ValueError: if the base module's ``(in, out)`` shape is not the target's.
    """

    def __init__(self, base: nn.Module, *, target_name: str, target: LoraTarget, layer: int,
                 a: Tensor, b: Tensor, kernels: ops.Kernels,
                 ranks: Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        shape, want = self._base_shape(base), (target.in_features, target.out_features)
        if shape != want:
            raise ValueError(
                f"{target_name} layer {layer}: the base {type(base).__name__} is "
                f"{shape[0]}x{shape[1]}, the target {want[0]}x{want[1]} (in x out)"
            )
        self.base = base
        self.target_name = target_name
        self.layer = layer
        self.a = a
        self.b = b
        self.ranks = ranks
        self._kernels = kernels

    @staticmethod
    def _base_shape(base: nn.Module) -> tuple[int, int]:
        return (cast(int, base.in_features), cast(int, base.out_features))

    def extra_repr(self) -> str:
        return f"target={self.target_name}, layer={self.layer}, a={list(self.a.shape)}"


class LoRALinear(_LoRALayer):
    """A base ``nn.Linear`` (fused or not) of one target family and layer, plus LoRA.

    Forward: ``y = base(x)``; with routing, ``y[t, slice_s] += x[t] @ A_s.T @ B_s.T`` for the
    rows ``t`` the routing sends to LoRA, each row's A and B from its group's slot (the scale
    is already in B). ``x`` is ``[..., in_features]``; rows are the flattened leading dims.

    ``a`` is ``[num_slots, S * R, in_features]`` and ``b`` ``[num_slots, out_features, R]``.
    Every layer of a target has views of the same shape, so one compiled graph serves every
    layer.

    A ``per_segment`` target (an LM head) given a 2-D ``x`` ``[requests, in_features]`` is
    routed by request (:attr:`Routing.segments`); given ``[B, T, in_features]``, by token.
    With kernels that have ``linear_delta``, at most :data:`ops.DELTA_MAX_ROWS` rows
    (decode), traced by ``torch.compile`` or captured in a CUDA graph, the base linear and
    the delta run in one op, the delta on a side stream, and are added after it (``y + d``
    in float32, rounded once). Otherwise shrink and expand run after the base linear, the
    expand adding into ``y`` in float32 and rounding once: the same result (eagerly up to
    :data:`ops.DELTA_MAX_ROWS` rows, with kernels that have ``delta_``, in one launch).
    """

    def __init__(self, base: nn.Linear, *, target: LoraTarget, **kwargs) -> None:
        super().__init__(base, target=target, **kwargs)
        self.per_segment = target.per_segment
        self.num_slices = target.num_slices
        self.out_slices = list(target.out_slices)
        # the eager one-launch delta's launches (token or segment routing): this layer passes
        # the same slot stacks and ranks every call, and routing views laid out alike
        self._plans_tokens: dict = {}
        self._plans_segments: dict = {}

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        if routing is None:
            return self.base(x)
        by_segment = self.per_segment and x.dim() == 2
        route = routing.segments if by_segment else routing.tokens
        x2 = x.reshape(-1, x.shape[-1])
        k = _kernels_now(self._kernels)
        if k.linear_delta is not None and x2.shape[0] <= ops.DELTA_MAX_ROWS and _in_graph(x2):
            weight, bias = self.base.weight, self.base.bias
            y, buf = k.linear_delta(
                x2, weight, bias, self.a, self.b, self.num_slices, self.out_slices, *route,
                ranks=self.ranks,
            )  # fmt: skip
            d = buf[: y.numel()].view(y.shape)
            return (y + d).to(y.dtype).view(*x.shape[:-1], y.shape[-1])
        y = self.base(x)
        if k.delta_ is not None and x2.shape[0] <= ops.DELTA_MAX_ROWS:  # eager decode
            plans = self._plans_segments if by_segment else self._plans_tokens
            k.delta_(y.view(-1, y.shape[-1]), x2, self.a, self.b, self.out_slices, *route,
                     ranks=self.ranks, plans=plans)  # fmt: skip
            return y
        h = k.shrink(x2, self.a, self.num_slices, *route, ranks=self.ranks)
        k.expand(y.view(-1, y.shape[-1]), h, self.b, self.out_slices, *route, ranks=self.ranks)
        return y

    def silu_and_mul(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """:meth:`Linear.silu_and_mul` with LoRA. With kernels that have
        ``expand_silu_mul`` and a two-slice target of equal halves (gate, up), the expand and
        the activation are one kernel: the ``[N, 2I]`` output is read once instead of read,
        written and read again, and no delta goes through memory. Up to
        :data:`ops.DELTA_MAX_ROWS` rows (decode) in a graph that needs ``linear_shrink``
        (the shrink beside the base GEMM on a side stream), :data:`ops.DECODE_FUSED_SILU` and
        at least :data:`ops.DECODE_FUSED_SILU_MIN_ROWS` rows; without, decode takes
        :meth:`forward`'s side-stream delta and the activation after."""
        k = _kernels_now(self._kernels)
        x2 = x.reshape(-1, x.shape[-1])
        side = x2.shape[0] <= ops.DELTA_MAX_ROWS and _in_graph(x2)  # decode in a graph
        if (
            routing is None
            or k.expand_silu_mul is None
            or (
                side
                and (
                    k.linear_shrink is None
                    or not ops.DECODE_FUSED_SILU
                    or x2.shape[0] < ops.DECODE_FUSED_SILU_MIN_ROWS
                )
            )
            or self.per_segment
            or self.out_slices != [self.out_slices[0]] * 2
        ):
            return _silu_and_mul(self(x, routing))
        route = routing.tokens
        if side:
            weight, bias = self.base.weight, self.base.bias
            assert k.linear_shrink is not None  # (else it returned above)
            y, h = k.linear_shrink(
                x2, weight, bias, self.a, self.num_slices, *route, ranks=self.ranks
            )
        else:
            y = self.base(x2)
            h = k.shrink(x2, self.a, self.num_slices, *route, ranks=self.ranks)
        out = k.expand_silu_mul(y, h, self.b, *route, ranks=self.ranks)
        return out.view(*x.shape[:-1], out.shape[-1])


def _kernels_now(kernels: ops.Kernels) -> ops.Kernels:
    """The ops while ``torch.compile`` traces (one opaque node each); outside, the
    implementations they dispatch to, called directly (the dispatch is host time only)."""
    if kernels.direct is None or torch.compiler.is_compiling():
        return kernels
    return kernels.direct


def _in_graph(x: Tensor) -> bool:
    """Whether this call is traced by ``torch.compile`` or captured into a CUDA graph: only
    there does overlapping LoRA with the base GEMM on a side stream pay (an eager call is
    bound by its host time; one fewer op and no float32 delta serve it better)."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


class LoRAEmbedding(_LoRALayer):
    """A base ``nn.Embedding`` (an ``embedding`` target), plus LoRA.

    Forward: ``y = base(tokens)``; with routing, ``y[t] += A[:, tokens[t]] @ B.T`` for the
    tokens the routing sends to LoRA (PEFT's ``lora_embedding_A`` ``[r, vocab]`` and
    ``lora_embedding_B`` ``[dim, r]``, scale folded into B). ``a`` ``[num_slots, vocab, R]``
    holds A transposed, ``b`` ``[num_slots, dim, R]``.
    """

    @staticmethod
    def _base_shape(base: nn.Module) -> tuple[int, int]:
        return (cast(int, base.num_embeddings), cast(int, base.embedding_dim))

    def forward(self, tokens: Tensor, routing: Routing | None = None) -> Tensor:
        y = self.base(tokens)
        if routing is None:
            return y
        k = _kernels_now(self._kernels)
        h = k.embedding_shrink(tokens.reshape(-1), self.a, *routing.tokens)
        k.expand(
            y.view(-1, y.shape[-1]), h, self.b, [y.shape[-1]], *routing.tokens, ranks=self.ranks
        )
        return y


def slot_stack(pool: Tensor, offset: int, shape: tuple[int, ...]) -> Tensor:
    """A ``[num_slots, *shape]`` view of the block at ``offset`` in every slot of ``pool``
    ``[num_slots, numel]`` (zero-copy)."""
    strides = []
    acc = 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return pool.as_strided(
        (pool.shape[0], *shape),
        (pool.stride(0), *reversed(strides)),
        pool.storage_offset() + offset,
    )


__all__ = ["Embedding", "LoRAEmbedding", "LoRALinear", "Linear", "slot_stack"]
