"""The LoRA ops as ``torch.library`` custom ops: one op per meaning, one implementation per
device (the Triton kernels on CUDA when Triton is installed, the pure-torch reference
elsewhere), so ``torch.compile`` sees each as one opaque node and a CUDA graph captures
whatever kernel it launches.

Every op takes the routing triple ``(lora_ids, grouped_offsets, end)``
(:mod:`lora_graph.routing`) and a LoRA layer's slot stacks, ``a`` ``[num_slots, S * R, K]``
and ``b`` ``[num_slots, out_features, R]`` (views of the slot pool; slot 0 is the zero
adapter), as inputs: a replay sees new routing and new slot contents without recompiling.
The linear ops also take ``ranks`` (optional, ``[num_slots]`` int32: the rank of the
adapter each slot holds, :attr:`lora_graph.slots.SlotPool.ranks`): a slot's A rows and B
columns at or above it are zeros, which the kernels then do not read, so a step's cost
follows its adapters' ranks rather than ``R``. The result is the same without it.

- ``lora_graph::lora_shrink(x [N, K], a, num_slices, *routing) -> h [S, N, R]`` float32:
  ``h[s, t] = x[t] @ a[slot(t), s*R:(s+1)*R].T`` for rows ``t < end``, 0 after.
- ``lora_graph::lora_expand_(y [N, out], h, b, out_slices, *routing)``, in place:
  ``y[t, slice_s] += h[s, t] @ b[slot(t), slice_s].T`` for rows ``t < end``; other rows are
  left bit-for-bit unchanged.
- ``lora_graph::lora_embedding_shrink(tokens [N], a [num_slots, vocab, R], *routing)``
  ``-> h [1, N, R]``: the shrink of an embedding (a gather; one implementation for every device).
- ``lora_graph::lora_expand_silu_mul(y [N, 2I], h [2, N, R], b, *routing) -> [N, I]``: a gated
  MLP's activation ``silu(g) * u`` of ``[g | u] = y`` plus the expand's delta, so the
  ``[N, 2I]`` projection is read once instead of read, written and read again (prefill).
- ``lora_graph::lora_linear_delta(x, weight, bias, a, b, num_slices, out_slices, *routing)``
  ``-> (y, buf)``: the base linear and the float32 delta of shrink + expand
  (``buf[:N*out]``), on CUDA with the delta on a side stream overlapping the base GEMM
  (decode).
- ``lora_graph::lora_linear_delta_stacked(...) -> [2, N, out]``: the same, ``y`` and ``d``
  stacked in ``x``'s dtype (a row-parallel layer under tensor parallelism: one all-reduce
  sums both, and the add after it fuses into the next pointwise op).
- ``lora_graph::lora_linear_shrink(x, weight, bias, a, num_slices, *routing) -> (y, h)``: the
  base linear and the shrink, on CUDA with the shrink on a side stream beside the GEMM
  (a gated MLP's gate/up at decode: :func:`lora_expand_silu_mul` then expands and applies
  the activation in one kernel, so the delta never goes through memory).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lora_graph.kernels import reference
from lora_graph.kernels.policy import KernelPolicy
from lora_graph.routing import Routing


@functools.cache
def _triton():  # the Triton implementations, imported on first CUDA call (None without Triton)
    from lora_graph.kernels import triton_launch

    return triton_launch if triton_launch.HAVE_TRITON else None


def have_triton() -> bool:
    """Whether the Triton kernels can run (Triton is installed)."""
    return _triton() is not None


@torch.library.custom_op("lora_graph::lora_shrink", mutates_args=())
def lora_shrink(
    x: Tensor,
    a: Tensor,
    num_slices: int,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    ranks: Tensor | None = None,
) -> Tensor:
    """Shrink (module docstring). Args: ``x`` ``[N, K]`` float32/bfloat16/float16; ``a``
    ``[num_slots, S * R, K]``; ``num_slices`` ``S``; the routing triple. Returns ``h``
    ``[S, N, R]`` float32, exactly 0 on rows that get no delta."""
    return reference.shrink(x, a, num_slices, lora_ids, grouped_offsets, end)


@lora_shrink.register_kernel("cuda")
def _(x, a, num_slices, lora_ids, grouped_offsets, end, ranks=None):
    impl = _triton()
    return (impl or reference).shrink(x, a, num_slices, lora_ids, grouped_offsets, end, ranks=ranks)


@lora_shrink.register_fake
def _(x, a, num_slices, lora_ids, grouped_offsets, end, ranks=None):
    return x.new_empty((num_slices, x.shape[0], a.shape[1] // num_slices), dtype=torch.float32)


@torch.library.custom_op("lora_graph::lora_expand_", mutates_args=("y",))
def lora_expand_(
    y: Tensor,
    h: Tensor,
    b: Tensor,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    ranks: Tensor | None = None,
) -> None:
    """Expand, in place (module docstring). Args: ``y`` ``[N, sum(out_slices)]``; ``h``
    ``[S, N, R]`` float32 from :func:`lora_shrink`; ``b`` ``[num_slots, sum(out_slices), R]``;
    ``out_slices`` the width of each slice; the routing triple."""
    reference.expand_(y, h, b, out_slices, lora_ids, grouped_offsets, end)


@lora_expand_.register_kernel("cuda")
def _(y, h, b, out_slices, lora_ids, grouped_offsets, end, ranks=None):
    impl = _triton() or reference
    impl.expand_(y, h, b, out_slices, lora_ids, grouped_offsets, end, ranks=ranks)


@lora_expand_.register_fake
def _(y, h, b, out_slices, lora_ids, grouped_offsets, end, ranks=None):
    return None


@torch.library.custom_op("lora_graph::lora_expand_silu_mul", mutates_args=())
def lora_expand_silu_mul(
    y: Tensor,
    h: Tensor,
    b: Tensor,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    ranks: Tensor | None = None,
) -> Tensor:
    """Expand + gated activation (module docstring). Args: ``y`` ``[N, 2I]`` (the gate then
    the up projection, unchanged); ``h`` ``[2, N, R]`` float32 from :func:`lora_shrink`;
    ``b`` ``[num_slots, 2I, R]``; the routing triple. Returns ``silu(g) * u`` ``[N, I]`` in
    ``y``'s dtype, ``g`` and ``u`` each rounded to that dtype after its delta (as
    :func:`lora_expand_` leaves them)."""
    return reference.expand_silu_mul(y, h, b, lora_ids, grouped_offsets, end)


@lora_expand_silu_mul.register_kernel("cuda")
def _(y, h, b, lora_ids, grouped_offsets, end, ranks=None):
    impl = _triton() or reference
    return impl.expand_silu_mul(y, h, b, lora_ids, grouped_offsets, end, ranks=ranks)


@lora_expand_silu_mul.register_fake
def _(y, h, b, lora_ids, grouped_offsets, end, ranks=None):
    return y.new_empty((y.shape[0], y.shape[1] // 2))


@torch.library.custom_op("lora_graph::lora_embedding_shrink", mutates_args=())
def lora_embedding_shrink(
    tokens: Tensor, a: Tensor, lora_ids: Tensor, grouped_offsets: Tensor, end: Tensor
) -> Tensor:
    """Embedding shrink (module docstring). Args: ``tokens`` ``[N]`` int64; ``a``
    ``[num_slots, vocab, R]`` (PEFT's ``lora_embedding_A`` transposed, so a token's rank
    vector is one contiguous row); the routing triple. Returns ``h`` ``[1, N, R]`` float32."""
    return reference.embedding_shrink(tokens, a, lora_ids, grouped_offsets, end)


@lora_embedding_shrink.register_fake
def _(tokens, a, lora_ids, grouped_offsets, end):
    return tokens.new_empty((1, tokens.shape[0], a.shape[2]), dtype=torch.float32)


@torch.library.custom_op("lora_graph::lora_linear_delta", mutates_args=())
def lora_linear_delta(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    a: Tensor,
    b: Tensor,
    num_slices: int,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    ranks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The base linear ``y = x @ weight.T + bias`` and the LoRA delta ``d`` that
    :func:`lora_expand_` would add to it, in one op so a compiler cannot schedule the GEMM
    before the side-stream work starts (module docstring). Returns ``(y, buf)``: ``y``
    ``[N, sum(out_slices)]`` in ``x``'s dtype, and one float32 buffer holding ``d`` (its
    first ``N * sum(out_slices)`` elements, row-major) then ``h``. The caller adds
    ``y + d`` in float32, which a compiled graph fuses into the next pointwise op."""
    return reference.linear_delta(
        x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end
    )


@lora_linear_delta.register_kernel("cuda")
def _(x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end, ranks=None):
    impl = _triton() or reference
    return impl.linear_delta(
        x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end, ranks=ranks
    )


@lora_linear_delta.register_fake
def _(x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end, ranks=None):
    n, r = x.shape[0], a.shape[1] // num_slices
    return (
        x.new_empty((n, weight.shape[0])),
        x.new_empty((n * sum(out_slices) + num_slices * n * r,), dtype=torch.float32),
    )


@torch.library.custom_op("lora_graph::lora_linear_delta_stacked", mutates_args=())
def lora_linear_delta_stacked(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    a: Tensor,
    b: Tensor,
    num_slices: int,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    ranks: Tensor | None = None,
) -> Tensor:
    """:func:`lora_linear_delta` with ``y`` and ``d`` stacked, ``[2, N, sum(out_slices)]``,
    both in ``x``'s dtype: a row-parallel layer's partial output and delta, which one
    all-reduce then sums over the ranks before the add (:meth:`Kernels.linear_stacked`)."""
    return reference.linear_delta_stacked(
        x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end
    )


@lora_linear_delta_stacked.register_kernel("cuda")
def _(x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end, ranks=None):
    impl = _triton() or reference
    return impl.linear_delta_stacked(
        x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end, ranks=ranks
    )


@lora_linear_delta_stacked.register_fake
def _(x, weight, bias, a, b, num_slices, out_slices, lora_ids, grouped_offsets, end, ranks=None):
    return x.new_empty((2, x.shape[0], weight.shape[0]))


@torch.library.custom_op("lora_graph::lora_linear_shrink", mutates_args=())
def lora_linear_shrink(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    a: Tensor,
    num_slices: int,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    ranks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The base linear ``y = x @ weight.T + bias`` and :func:`lora_shrink`'s ``h``, in one op
    so the shrink can run beside the GEMM (module docstring). Returns ``(y, h)``: ``y``
    ``[N, out]`` in ``x``'s dtype, ``h`` ``[S, N, R]`` float32."""
    return reference.linear_shrink(x, weight, bias, a, num_slices, lora_ids, grouped_offsets, end)


@lora_linear_shrink.register_kernel("cuda")
def _(x, weight, bias, a, num_slices, lora_ids, grouped_offsets, end, ranks=None):
    impl = _triton() or reference
    return impl.linear_shrink(
        x, weight, bias, a, num_slices, lora_ids, grouped_offsets, end, ranks=ranks
    )


@lora_linear_shrink.register_fake
def _(x, weight, bias, a, num_slices, lora_ids, grouped_offsets, end, ranks=None):
    n, r = x.shape[0], a.shape[1] // num_slices
    return x.new_empty((n, weight.shape[0])), x.new_empty((num_slices, n, r), dtype=torch.float32)


class LoRALinearParams(Protocol):
    """What the backend reads of a LoRA linear (:class:`lora_graph.layers.LoRALinear`): its
    base linear, its slot stacks ``a`` ``[num_slots, S * R, in]`` and ``b``
    ``[num_slots, out, R]``, the pool's slot ``ranks``, its slices, whether it is routed
    per request (an LM head), and its cached one-launch plans (token or segment routing)."""

    base: nn.Linear
    a: Tensor
    b: Tensor
    ranks: Tensor | None
    num_slices: int
    out_slices: list[int]
    per_segment: bool
    plans_tokens: dict
    plans_segments: dict


def silu_and_mul(y: Tensor) -> Tensor:
    """A gated MLP's activation (SwiGLU; Shazeer 2020, "GLU Variants Improve Transformer"):
    ``silu(g) * u`` where ``[g | u] = y`` splits the last dim in two halves."""
    gate, up = y.split(y.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def in_graph(x: Tensor) -> bool:
    """Whether this call is traced by ``torch.compile`` or captured into a CUDA graph: only
    there does overlapping LoRA with the base GEMM on a side stream pay (an eager call is
    bound by its host time; one fewer op and no float32 delta serve it better)."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class Kernels:
    """The kernels backend: what a LoRA layer calls, with the signatures of the ops above
    (the ops themselves, per-device dispatch, or for a forced backend the implementations
    directly), and the path each call takes, picked from :attr:`policy`
    (:meth:`linear`, :meth:`silu_and_mul`, :meth:`embedding`).

    ``linear_delta`` is None where the side-stream delta is not used; ``expand_silu_mul``
    None where a gated MLP expands in place and applies its activation after (the fused
    kernel would gain nothing: the CPU); ``linear_shrink`` None where a gated MLP's decode
    does not shrink beside its GEMM; ``delta_`` (shrink + expand in one launch,
    ``delta_(y, x, a, b, out_slices, *routing, ranks=, plans=)``; no op: never traced) None
    where eager decode calls shrink and expand; ``linear_delta_stacked`` None where
    ``linear_delta`` is; ``direct`` the same implementations without
    the op dispatch, for eager calls (None: these are)."""

    shrink: Callable[..., Tensor]
    embedding_shrink: Callable[..., Tensor]
    expand: Callable[..., None]
    linear_delta: Callable[..., tuple[Tensor, Tensor]] | None = None
    expand_silu_mul: Callable[..., Tensor] | None = None
    linear_shrink: Callable[..., tuple[Tensor, Tensor]] | None = None
    delta_: Callable[..., None] | None = None
    linear_delta_stacked: Callable[..., Tensor] | None = None
    direct: Kernels | None = None
    policy: KernelPolicy = field(default_factory=KernelPolicy)

    def now(self) -> Kernels:
        """The ops while ``torch.compile`` traces (one opaque node each); outside, the
        implementations they dispatch to, called directly (the dispatch is host time only)."""
        if self.direct is None or torch.compiler.is_compiling():
            return self
        return self.direct

    def _side(self, x2: Tensor) -> bool:
        """Decode in a graph: ``x2``'s rows within ``policy.side_stream_max_rows``, traced
        or captured (where a LoRA layer's delta may run on a side stream)."""
        return x2.shape[0] <= self.policy.side_stream_max_rows and in_graph(x2)

    def linear(self, layer: LoRALinearParams, x: Tensor, routing: Routing) -> Tensor:
        """``layer.base(x)`` plus the LoRA delta of the rows ``routing`` sends to adapters
        (:class:`lora_graph.layers.LoRALinear`'s forward). Within
        ``policy.side_stream_max_rows`` rows in a graph, with ``linear_delta``: the base
        linear and the delta in one op, the delta on a side stream, added after it in
        float32 and rounded once. Otherwise shrink and expand after the base linear (the
        expand adds in float32 and rounds once; eagerly within that many rows, with
        ``delta_``, in one launch): the same result."""
        by_segment = layer.per_segment and x.dim() == 2
        route = routing.segments if by_segment else routing.tokens
        x2 = x.reshape(-1, x.shape[-1])
        k = self.now()
        small = x2.shape[0] <= self.policy.side_stream_max_rows
        if k.linear_delta is not None and self._side(x2):
            y, buf = k.linear_delta(
                x2, layer.base.weight, layer.base.bias, layer.a, layer.b, layer.num_slices,
                layer.out_slices, *route, ranks=layer.ranks,
            )  # fmt: skip
            d = buf[: y.numel()].view(y.shape)
            return (y + d).to(y.dtype).view(*x.shape[:-1], y.shape[-1])
        y = layer.base(x)
        if k.delta_ is not None and small:  # eager decode
            plans = layer.plans_segments if by_segment else layer.plans_tokens
            k.delta_(y.view(-1, y.shape[-1]), x2, layer.a, layer.b, layer.out_slices, *route,
                     ranks=layer.ranks, plans=plans)  # fmt: skip
            return y
        h = k.shrink(x2, layer.a, layer.num_slices, *route, ranks=layer.ranks)
        k.expand(y.view(-1, y.shape[-1]), h, layer.b, layer.out_slices, *route, ranks=layer.ranks)
        return y

    def linear_stacked(self, layer: LoRALinearParams, x: Tensor, routing: Routing) -> Tensor | None:
        """Where :meth:`linear` takes the side-stream delta (and the policy's
        ``reduce_delta_apart``): ``[2, ..., out_features]``, the base linear and the delta
        stacked in ``x``'s dtype, their sum :meth:`linear`'s result (up to the delta's
        rounding) -- a row-parallel layer all-reduces both in one collective and adds after
        it, where the add fuses into the residual add. None elsewhere."""
        x2 = x.reshape(-1, x.shape[-1])
        k = self.now()
        stacked = k.linear_delta_stacked if self.policy.reduce_delta_apart else None
        if stacked is None or layer.per_segment or not self._side(x2):
            return None
        out = stacked(
            x2, layer.base.weight, layer.base.bias, layer.a, layer.b, layer.num_slices,
            layer.out_slices, *routing.tokens, ranks=layer.ranks,
        )  # fmt: skip
        return out.view(2, *x.shape[:-1], out.shape[-1])

    def silu_and_mul(self, layer: LoRALinearParams, x: Tensor, routing: Routing) -> Tensor:
        """``silu_and_mul(layer(x))`` with LoRA. With ``expand_silu_mul`` and a two-slice
        target of equal halves (gate, up), the expand and the activation are one kernel:
        the ``[N, 2I]`` output is read once instead of read, written and read again, and no
        delta goes through memory. Within ``policy.side_stream_max_rows`` rows in a graph
        that takes ``linear_shrink`` (the shrink beside the base GEMM on a side stream),
        ``policy.fused_silu_decode`` and at least ``policy.fused_silu_min_rows`` rows;
        otherwise decode takes :meth:`linear`'s side-stream delta and the activation
        after."""
        k = self.now()
        x2 = x.reshape(-1, x.shape[-1])
        n, policy = x2.shape[0], self.policy
        side = self._side(x2)
        fused_side = (
            k.linear_shrink is not None
            and policy.fused_silu_decode
            and n >= policy.fused_silu_min_rows
        )
        if (
            k.expand_silu_mul is None
            or (side and not fused_side)
            or layer.per_segment
            or layer.out_slices != [layer.out_slices[0]] * 2
        ):
            return silu_and_mul(self.linear(layer, x, routing))
        route = routing.tokens
        if side:
            assert k.linear_shrink is not None  # (fused_side)
            y, h = k.linear_shrink(
                x2, layer.base.weight, layer.base.bias, layer.a, layer.num_slices, *route,
                ranks=layer.ranks,
            )  # fmt: skip
        else:
            y = layer.base(x2)
            h = k.shrink(x2, layer.a, layer.num_slices, *route, ranks=layer.ranks)
        out = k.expand_silu_mul(y, h, layer.b, *route, ranks=layer.ranks)
        return out.view(*x.shape[:-1], out.shape[-1])

    def embedding(
        self, base: nn.Embedding, a: Tensor, b: Tensor, ranks: Tensor | None, tokens: Tensor,
        routing: Routing,
    ) -> Tensor:  # fmt: skip
        """``base(tokens)`` plus the LoRA delta ``A[:, tokens[t]] @ B.T`` of the tokens the
        routing sends to adapters (:class:`lora_graph.layers.LoRAEmbedding`)."""
        y = base(tokens)
        k = self.now()
        h = k.embedding_shrink(tokens.reshape(-1), a, *routing.tokens)
        k.expand(y.view(-1, y.shape[-1]), h, b, [y.shape[-1]], *routing.tokens, ranks=ranks)
        return y


def kernels(backend: str, device: torch.device, policy: KernelPolicy | None = None) -> Kernels:
    """The :class:`Kernels` of a ``LoRAConfig.backend``, taking its paths by ``policy``
    (default: :class:`KernelPolicy`'s defaults):

    - ``"auto"``: the ops (Triton on CUDA when installed, the reference elsewhere), and on
      CUDA with Triton the side-stream ``linear_delta`` / ``linear_shrink`` at decode and
      the fused ``expand_silu_mul``.
    - ``"torch"``: the pure-torch reference on any device (no side stream).
    - ``"triton"``: the Triton kernels: the ops on CUDA; on the CPU under Triton's
      interpreter (``TRITON_INTERPRET=1``), the Triton implementations called directly.

    On CUDA with Triton the ops carry the implementations they dispatch to as ``direct``,
    which a LoRA layer calls outside ``torch.compile`` (the op's dispatch is host time only,
    and eager host time is what a call outside a graph costs there).

    Raises:
        ValueError: for ``"triton"`` without Triton, or off CUDA without the interpreter;
            for an unknown backend.
    """
    policy = policy or KernelPolicy()
    if backend == "torch":
        return Kernels(
            reference.shrink, reference.embedding_shrink, reference.expand_, policy=policy
        )
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
    ops = Kernels(lora_shrink, lora_embedding_shrink, lora_expand_, policy=policy)
    if backend == "auto" and device.type != "cuda":
        return ops  # (Triton is not even imported: 0.2 s of start-up)
    impl = _triton()
    if impl is None:
        if backend == "triton":
            raise ValueError("backend='triton' but Triton is not installed")
        return ops
    triton_impl = Kernels(
        impl.shrink,
        reference.embedding_shrink,
        impl.expand_,
        impl.linear_delta,
        impl.expand_silu_mul,
        impl.linear_shrink,
        impl.delta_,
        impl.linear_delta_stacked,
        policy=policy,
    )
    if device.type == "cuda":
        return Kernels(
            lora_shrink,
            lora_embedding_shrink,
            lora_expand_,
            lora_linear_delta,
            lora_expand_silu_mul,
            lora_linear_shrink,
            linear_delta_stacked=lora_linear_delta_stacked,
            direct=triton_impl,
            policy=policy,
        )
    if not impl.interpreted():
        raise ValueError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    return triton_impl
