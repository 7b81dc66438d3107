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

from torch import Tensor, nn

from lora_graph import ops
from lora_graph.distributed import tp_all_reduce
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
        return ops.silu_and_mul(self(x, routing))

    def reduced(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """A row-parallel layer's output: ``self(x)`` summed over the tensor-parallel ranks
        (:func:`lora_graph.distributed.tp_all_reduce`)."""
        return tp_all_reduce(self(x, routing))


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
    How (which kernels, a side stream at decode) is the kernels backend's choice, by its
    policy (:meth:`lora_graph.ops.Kernels.linear`).

    ``a`` is ``[num_slots, S * R, in_features]`` and ``b`` ``[num_slots, out_features, R]``.
    Every layer of a target has views of the same shape, so one compiled graph serves every
    layer.

    A ``per_segment`` target (an LM head) given a 2-D ``x`` ``[requests, in_features]`` is
    routed by request (:attr:`Routing.segments`); given ``[B, T, in_features]``, by token.
    """

    base: nn.Linear

    def __init__(self, base: nn.Linear, *, target: LoraTarget, **kwargs) -> None:
        super().__init__(base, target=target, **kwargs)
        self.per_segment = target.per_segment
        self.num_slices = target.num_slices
        self.out_slices = list(target.out_slices)
        # the eager one-launch delta's launches (token or segment routing): this layer passes
        # the same slot stacks and ranks every call, and routing views laid out alike
        self.plans_tokens: dict = {}
        self.plans_segments: dict = {}

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """The base linear, then the LoRA delta of the routed rows."""
        if routing is None:
            return self.base(x)
        return self._kernels.linear(self, x, routing)

    def silu_and_mul(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """:meth:`Linear.silu_and_mul` with LoRA (:meth:`lora_graph.ops.Kernels.silu_and_mul`:
        the expand fused with the activation where the backend has it)."""
        if routing is None:
            return ops.silu_and_mul(self.base(x))
        return self._kernels.silu_and_mul(self, x, routing)

    def reduced(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        """A row-parallel layer's output with LoRA: ``self(x)`` summed over the
        tensor-parallel ranks. Where the backend stacks the base output and the side-stream
        delta (:meth:`lora_graph.ops.Kernels.linear_stacked`), one all-reduce sums both and
        the add comes after it (fused by a compiler into the residual add); otherwise the
        delta joins the partial output before the all-reduce. Either way LoRA adds no
        collective of its own (:mod:`lora_graph.parallel`)."""
        if routing is not None:
            stacked = self._kernels.linear_stacked(self, x, routing)
            if stacked is not None:
                tp_all_reduce(stacked)
                return stacked[0] + stacked[1]
        return tp_all_reduce(self(x, routing))


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
        if routing is None:
            return self.base(tokens)
        base = cast(nn.Embedding, self.base)
        return self._kernels.embedding(base, self.a, self.b, self.ranks, tokens, routing)


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
