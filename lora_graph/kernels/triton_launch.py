"""The Triton implementations of the ops in :mod:`lora_graph.ops` (which registers them for
CUDA), over the launchers of :mod:`~lora_graph.kernels.triton_launchers` and
:mod:`~lora_graph.kernels.triton_delta`; the side stream a decode's LoRA runs on beside the
base GEMM in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from lora_graph.kernels.triton_config import device_sms, shrink_config
from lora_graph.kernels.triton_delta import launch_delta
from lora_graph.kernels.triton_kernels import HAVE_TRITON, triton
from lora_graph.kernels.triton_launchers import (
    _require_triton,
    interpreted,
    launch_expand,
    launch_expand_silu_mul,
    launch_shrink,
)

__all__ = [
    "HAVE_TRITON",
    "delta_",
    "expand_",
    "expand_silu_mul",
    "interpreted",
    "launch_delta",
    "launch_expand",
    "launch_expand_silu_mul",
    "launch_shrink",
    "linear_delta",
    "linear_shrink",
    "shrink",
    "triton",
]


# --------------------------------------------------------------------------------------
# the ops' Triton implementations (lora_graph.ops registers them for CUDA)
# --------------------------------------------------------------------------------------


def _routing3(routing: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """The routing triple ``(lora_ids, grouped_offsets, end)`` as a fixed-length tuple."""
    lora_ids, grouped_offsets, end = routing
    return lora_ids, grouped_offsets, end


def shrink(
    x: Tensor, a: Tensor, num_slices: int, *routing: Tensor, ranks: Tensor | None = None
) -> Tensor:
    """:func:`lora_graph.ops.lora_shrink` in one launch for all slices (split-K with fp32
    atomics at small ``N``, into a zeroed ``h``)."""
    _require_triton()
    max_rank = a.shape[1] // num_slices
    h = torch.zeros((num_slices, x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    launch_shrink(x, a, h, *_routing3(routing), max_rank, ranks=ranks)
    return h


def expand_(
    y: Tensor, h: Tensor, b: Tensor, out_slices: list[int], *routing: Tensor,
    ranks: Tensor | None = None,
) -> None:  # fmt: skip
    """:func:`lora_graph.ops.lora_expand_` in one launch for all slices; the sum is formed in
    fp32 and cast to ``y``'s dtype once."""
    _require_triton()
    launch_expand(y, h, b, tuple(out_slices), *_routing3(routing), ranks=ranks)


def expand_silu_mul(
    y: Tensor, h: Tensor, b: Tensor, *routing: Tensor, ranks: Tensor | None = None
) -> Tensor:
    """:func:`lora_graph.ops.lora_expand_silu_mul` in one launch."""
    _require_triton()
    out = torch.empty((y.shape[0], y.shape[1] // 2), dtype=y.dtype, device=y.device)
    launch_expand_silu_mul(y, h, b, out, *_routing3(routing), ranks=ranks)
    return out


def delta_(
    y: Tensor, x: Tensor, a: Tensor, b: Tensor, out_slices: list[int], *routing: Tensor,
    ranks: Tensor | None = None, plans: dict | None = None,
) -> None:  # fmt: skip
    """``expand_(y, shrink(x, a, len(out_slices), *routing), b, out_slices, *routing)`` in
    one launch (:func:`launch_delta`, which says what ``plans`` is; at most 64 rows): an
    eager decode call's LoRA."""
    _require_triton()
    max_rank = a.shape[1] // max(1, len(out_slices))
    launch_delta(y, x, a, b, tuple(out_slices), *_routing3(routing), max_rank, ranks=ranks,
                 plans=plans)  # fmt: skip


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of a CUDA device (one per device, made on first use) while a CUDA graph
    is being captured on it; None elsewhere. Outside a graph a LoRA call is bound by its
    host time, not the device's, and switching streams would only add to it."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def linear_delta(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, num_slices: int,
    out_slices: list[int], *routing: Tensor, ranks: Tensor | None = None
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`lora_graph.ops.lora_linear_delta`: the base linear on the caller's stream and,
    overlapping it on the device's side stream, the shrink (into a zeroed ``h``) and the
    expand, which writes every row of the float32 delta (no memset of it). Returns after
    the caller's stream waits for the side stream; ``x`` and the buffer were allocated on
    the caller's stream, so they outlive the side work. Outside CUDA graph capture (eager
    calls, the Triton interpreter) everything runs inline."""
    _require_triton()
    n = x.shape[0]
    out_features = sum(out_slices)
    max_rank = a.shape[1] // num_slices
    buf = torch.empty(
        n * out_features + num_slices * n * max_rank, dtype=torch.float32, device=x.device
    )
    d = buf[: n * out_features].view(n, out_features)
    h = buf[n * out_features :].view(num_slices, n, max_rank)
    y = _side_delta(x, weight, bias, a, b, out_slices, routing, ranks, d, h)
    return y, buf


def linear_delta_stacked(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, num_slices: int,
    out_slices: list[int], *routing: Tensor, ranks: Tensor | None = None
) -> Tensor:  # fmt: skip
    """:func:`lora_graph.ops.lora_linear_delta_stacked`: :func:`linear_delta` with the base
    linear written into ``out[0]`` and the delta, in ``x``'s dtype, into ``out[1]``."""
    _require_triton()
    n = x.shape[0]
    max_rank = a.shape[1] // num_slices
    out = torch.empty((2, n, sum(out_slices)), dtype=x.dtype, device=x.device)
    h = torch.empty((num_slices, n, max_rank), dtype=torch.float32, device=x.device)
    _side_delta(x, weight, bias, a, b, out_slices, routing, ranks, out[1], h, y=out[0])
    return out


def _side_delta(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor,
    out_slices: list[int], routing: tuple[Tensor, ...], ranks: Tensor | None, d: Tensor,
    h: Tensor, y: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The base linear (into ``y`` if given) on the caller's stream, the shrink into ``h``
    and the expand overwriting ``d`` on the side stream beside it; returns ``y``."""
    n, max_rank = x.shape[0], h.shape[2]
    shrink_cfg = shrink_config(n, x.shape[1], a.shape[1], x.element_size(), device_sms(x.device))
    side = _side_stream(x.device)
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if side is not None:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        ctx = torch.cuda.stream(side)
    # the expand writes every row of the unzeroed delta (adding into a zeroed one took a
    # memset more); the shrink and expand stay two launches (one launch_delta on the side
    # stream made the step 2-9% slower on the H200, session 9: its waiting expand programs
    # hold SMs the base GEMM beside it needs)
    with ctx:
        if shrink_cfg.split_k > 1:  # partial sums are added into h; else rows the
            h.zero_()  # shrink skips are rows the expand does not read
        launch_shrink(x, a, h, *_routing3(routing), max_rank, shrink_cfg, ranks=ranks)
        launch_expand(d, h, b, tuple(out_slices), *_routing3(routing), overwrite=True, ranks=ranks)
    if y is None:
        y = torch.nn.functional.linear(x, weight, bias)
    elif bias is None:
        torch.mm(x, weight.t(), out=y)
    else:
        torch.addmm(bias, x, weight.t(), out=y)
    if side is not None:
        main.wait_stream(side)
    return y


def linear_shrink(
    x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, num_slices: int, *routing: Tensor,
    ranks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`lora_graph.ops.lora_linear_shrink`: the base linear on the caller's stream and,
    overlapping it on the device's side stream, the shrink into a zeroed ``h``. Returns
    after the caller's stream waits for the side stream. Outside CUDA graph capture
    everything runs inline."""
    _require_triton()
    n = x.shape[0]
    max_rank = a.shape[1] // num_slices
    h = torch.empty((num_slices, n, max_rank), dtype=torch.float32, device=x.device)
    side = _side_stream(x.device)
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if side is not None:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        ctx = torch.cuda.stream(side)
    with ctx:
        h.zero_()  # h is exactly the shrink's: 0 on rows without a delta
        launch_shrink(x, a, h, *_routing3(routing), max_rank, ranks=ranks)
    y = torch.nn.functional.linear(x, weight, bias)
    if side is not None:
        main.wait_stream(side)
    return y, h
