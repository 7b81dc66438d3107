"""The LoRA layers, and the plain layers a model declares where an adapter may attach.

A model builds each LoRA-targetable projection as :class:`Linear` (or :class:`Embedding`)
and calls it as ``proj(x, routing)``: the plain layer ignores the routing. Wrapping
(:mod:`lora_graph.wrapping`) swaps in :class:`LoRALinear` / :class:`LoRAEmbedding`, which
add the adapters' delta for the rows the routing sends to them. Routing is an explicit
argument (:class:`~lora_graph.routing.Routing`, or None for a base-only step), never state
bound into the layers.
"""

from __future__ import annotations

from torch import Tensor, nn

from lora_graph import ops
from lora_graph.routing import Routing
from lora_graph.targets import LoraTarget


class Linear(nn.Linear):
    """An ``nn.Linear`` a model declares for a LoRA target: ``forward(x, routing)`` ignores
    the routing."""

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        return super().forward(x)


class Embedding(nn.Embedding):
    """An ``nn.Embedding`` a model declares for a LoRA target: ``forward(tokens, routing)``
    ignores the routing."""

    def forward(self, tokens: Tensor, routing: Routing | None = None) -> Tensor:
        return super().forward(tokens)


class LoRALinear(nn.Module):
    """A base ``nn.Linear`` (fused or not) of one target family and layer, plus LoRA.

    Forward: ``y = base(x)``; with routing, ``y[t, slice_s] += x[t] @ A_s.T @ B_s.T`` for the
    rows ``t`` the routing sends to LoRA, each row's A and B from its group's slot (the scale
    is already in B). ``x`` is ``[..., in_features]``; rows are the flattened leading dims.

    ``a`` ``[num_slots, S * R, in_features]`` and ``b`` ``[num_slots, out_features, R]`` are
    this layer's views of the slot pool, set once by wrapping: loading an adapter into a
    slot rewrites the pool in place. Every layer of a target has views of the same shape,
    so one compiled graph serves every layer.

    A ``per_segment`` target (an LM head) given a 2-D ``x`` ``[requests, in_features]`` is
    routed by request (:attr:`Routing.segments`); given ``[B, T, in_features]``, by token.
    With kernels that have ``linear_delta`` and at most :data:`ops.DELTA_MAX_ROWS` rows
    (decode), the base linear and the delta run in one op, the delta on a side stream, and
    are added after it (``y + d`` in float32, rounded once).
    """

    def __init__(
        self,
        base: nn.Linear,
        *,
        target_name: str,
        target: LoraTarget,
        layer: int,
        a: Tensor,
        b: Tensor,
        kernels: ops.Kernels,
    ) -> None:
        super().__init__()
        if base.in_features != target.in_features or base.out_features != target.out_features:
            raise ValueError(
                f"{target_name} layer {layer}: base linear {base.in_features}->{base.out_features} "
                f"does not match the target {target.in_features}->{target.out_features}"
            )
        self.base = base
        self.target_name = target_name
        self.layer = layer
        self.per_segment = target.per_segment
        self.num_slices = target.num_slices
        self.out_slices = list(target.out_slices)
        self.a = a
        self.b = b
        self._kernels = kernels

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        if routing is None:
            return self.base(x)
        route = routing.segments if self.per_segment and x.dim() == 2 else routing.tokens
        x2 = x.reshape(-1, x.shape[-1])
        k = self._kernels
        if k.linear_delta is not None and x2.shape[0] <= ops.DELTA_MAX_ROWS:
            y, buf = k.linear_delta(
                x2,
                self.base.weight,
                self.base.bias,
                self.a,
                self.b,
                self.num_slices,
                self.out_slices,
                *route,
            )
            d = buf[: y.numel()].view(y.shape)
            return (y + d).to(y.dtype).view(*x.shape[:-1], y.shape[-1])
        y = self.base(x)
        h = k.shrink(x2, self.a, self.num_slices, *route)
        k.expand(y.view(-1, y.shape[-1]), h, self.b, self.out_slices, *route)
        return y

    def extra_repr(self) -> str:
        return (
            f"target={self.target_name}, layer={self.layer}, out_slices={self.out_slices}, "
            f"a={list(self.a.shape)}"
        )


class LoRAEmbedding(nn.Module):
    """A base ``nn.Embedding`` (an ``embedding`` target), plus LoRA.

    Forward: ``y = base(tokens)``; with routing, ``y[t] += A[:, tokens[t]] @ B.T`` for the
    tokens the routing sends to LoRA (PEFT's ``lora_embedding_A`` ``[r, vocab]`` and
    ``lora_embedding_B`` ``[dim, r]``, scale folded into B). ``a`` ``[num_slots, vocab, R]``
    holds A transposed, ``b`` ``[num_slots, dim, R]``.
    """

    def __init__(
        self,
        base: nn.Embedding,
        *,
        target_name: str,
        target: LoraTarget,
        layer: int,
        a: Tensor,
        b: Tensor,
        kernels: ops.Kernels,
    ) -> None:
        super().__init__()
        if base.num_embeddings != target.in_features or base.embedding_dim != target.out_features:
            raise ValueError(
                f"{target_name}: base embedding {base.num_embeddings}x{base.embedding_dim} does "
                "not match "
                f"the target {target.in_features}x{target.out_features}"
            )
        self.base = base
        self.target_name = target_name
        self.layer = layer
        self.a = a
        self.b = b
        self._kernels = kernels

    def forward(self, tokens: Tensor, routing: Routing | None = None) -> Tensor:
        y = self.base(tokens)
        if routing is None:
            return y
        h = self._kernels.embedding_shrink(tokens.reshape(-1), self.a, *routing.tokens)
        self._kernels.expand(y.view(-1, y.shape[-1]), h, self.b, [y.shape[-1]], *routing.tokens)
        return y

    def extra_repr(self) -> str:
        return f"target={self.target_name}, a={list(self.a.shape)}"


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
