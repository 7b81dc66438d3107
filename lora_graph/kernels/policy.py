"""The kernel policy: which path a LoRA layer's call takes, chosen once when the layers are
built (``LoRAConfig.kernel_policy``) and frozen; tests and benchmarks pass another policy
instead of changing module state. The defaults are what the H200 measured fastest
(``bench/RESULTS.md``, sessions 7-12).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelPolicy:
    """How the kernels backend (:func:`lora_graph.ops.kernels`) runs a LoRA layer.

    Attributes:
        side_stream_max_rows: rows up to which a LoRA linear traced by ``torch.compile`` or
            captured in a CUDA graph runs its delta on a side stream beside the base GEMM
            (``lora_linear_delta``; decode), and an eager call on CUDA runs shrink and
            expand in one launch (``delta_``). Above it, shrink and expand run in place
            after the base linear. 0: never.
        fused_silu_decode: whether, within ``side_stream_max_rows`` rows in a graph, a gated
            MLP's gate/up projection runs ``lora_linear_shrink`` (the shrink beside the GEMM)
            and ``lora_expand_silu_mul`` (the expand fused with the activation) instead of
            the side-stream delta and the activation after. On the H200 (Llama-3-8B shapes,
            4 adapters) it took 2-5% off a decode step at 8-64 rows and added 1.5% at 1 row.
        fused_silu_min_rows: the fewest rows ``fused_silu_decode`` applies to (below it the
            side-stream delta hides entirely behind the GEMM and the fused kernel does not).
        reduce_delta_apart: tensor parallel: whether a row-parallel layer's side-stream
            delta is all-reduced beside its partial output (one collective of twice the
            bytes; the add after it fuses into the residual add) rather than added before
            the all-reduce (an add kernel of its own). On one H200 at size 1 (Llama-3-8B
            shapes, 4 adapters, CUDA graphs, 2026-12-05) LoRA decode steps took 0.99-1.009x
            the plain step's time with it and 1.014-1.022x with the add, hence on by
            default; at size 2 (twice the bytes a collective) ``bench/gpu_run.sh tp2``
            times both.

    Raises:
        ValueError: for a row count that is not an integer or is negative,
            ``fused_silu_min_rows`` below 1, or a ``fused_silu_decode`` or
            ``reduce_delta_apart`` that is not a bool.
    """

    side_stream_max_rows: int = 64
    fused_silu_decode: bool = True
    fused_silu_min_rows: int = 8
    reduce_delta_apart: bool = True

    def __post_init__(self) -> None:
        for name in ("side_stream_max_rows", "fused_silu_min_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("fused_silu_decode", "reduce_delta_apart"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.side_stream_max_rows < 0:
            raise ValueError(
                f"side_stream_max_rows must be at least 0, got {self.side_stream_max_rows}"
            )
        if self.fused_silu_min_rows < 1:
            raise ValueError(
                f"fused_silu_min_rows must be at least 1, got {self.fused_silu_min_rows}"
            )
