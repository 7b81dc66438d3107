"""The one-launch LoRA delta for decode (:func:`launch_delta`): the shrink and the expand
of up to 64 rows in one launch of ``_delta_kernel``, its expand items waiting in the kernel
for their row tile's shrink items, ``h`` in each stream's zero workspace; and the launch
plans an eager caller keeps per call signature (its host time is what an eager decode call
costs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lora_graph.kernels import fast_launch
from lora_graph.kernels.triton_config import (
    cdiv,
    device_sms,
    expand_config,
    next_pow2,
    num_tiles,
    shrink_config,
    slice_meta,
)
from lora_graph.kernels.triton_kernels import HAVE_TRITON
from lora_graph.kernels.triton_launchers import (
    _check_devices,
    _compact,
    _device_guard,
    _f32_operands,
    _opt,
    _rank_chunk,
    _require_triton,
    _run_length,
)

if HAVE_TRITON:
    from lora_graph.kernels.triton_kernels import (
        _delta_kernel,
    )

# The one-launch decode delta (launch_delta): rows it serves, and its row tiles' counters
DELTA_MAX_TILES = 256
# (device index, raw stream) -> (counters, h): each stream's zero workspace of launch_delta
_WORKSPACES: dict[tuple, tuple[Tensor, Tensor]] = {}
# every workspace ever handed out: a captured graph keeps its address, so none is freed
_KEPT: list[tuple[Tensor, Tensor]] = []


def _workspace(device: torch.device, h_numel: int) -> tuple[Tensor, Tensor]:
    """The current stream's zero workspace of :func:`launch_delta`: ``(count
    [2 * DELTA_MAX_TILES] int32, h [>= h_numel] float32)``, all zero between launches (each
    launch leaves them so). One per stream, so launches on two streams never share one.
    Made (zeroed) on first use; when made during CUDA graph capture, the graph zeroes it
    again at each replay, which it is anyway."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key: tuple = (index, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (str(device), 0)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[1].numel() < h_numel:
        count = torch.zeros(2 * DELTA_MAX_TILES, dtype=torch.int32, device=device)
        ws = (count, torch.zeros(max(h_numel, 3 * 64 * 64), dtype=torch.float32, device=device))
        _WORKSPACES[key] = ws
        _KEPT.append(ws)
    return ws


@dataclass
class _DeltaPlan:
    """What a :func:`launch_delta` call of one signature launches (everything but the
    tensors' addresses follows from the signature), and the compiled kernels of it by the
    tensors' 16-byte alignment (Triton's one specialisation on a tensor beyond its dtype)."""

    grid: tuple[int]
    ints: tuple[int, ...]
    constexprs: dict[str, Any]
    values: tuple[Any, ...]  # the constexprs in the kernel's order
    num_warps: int
    num_stages: int
    h_numel: int
    compiled: dict[tuple[bool, ...], Any] = field(default_factory=dict)


def _delta_plan(
    y: Tensor, x: Tensor, a: Tensor, b: Tensor, out_slices: tuple[int, ...], lora_ids: Tensor,
    grouped_offsets: Tensor, end: Tensor, max_rank: int, overwrite: bool, ranks: Tensor | None,
) -> _DeltaPlan | None:  # fmt: skip
    """The launch of a :func:`launch_delta` signature (None: nothing to launch). Raises its
    errors."""
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or y.dim() != 2 or not out_slices:
        raise ValueError(
            f"launch_delta: x [N, K], a [slots, S*R, K], b [slots, out, R], y [N, out] and one "
            f"or more out_slices, got x {list(x.shape)}, a {list(a.shape)}, b "
            f"{list(b.shape)}, y {list(y.shape)}, out_slices {list(out_slices)}"
        )
    n, k = x.shape
    num_slots, sr, k_a = a.shape
    out_features = b.shape[1]
    num_slices = len(out_slices)
    if (
        k_a != k
        or sr != num_slices * max_rank
        or b.shape[2] != max_rank
        or b.shape[0] != num_slots
        or sum(out_slices) != out_features
        or tuple(y.shape) != (n, out_features)
    ):
        raise ValueError(
            f"launch_delta: shapes disagree: x {list(x.shape)}, a {list(a.shape)}, b "
            f"{list(b.shape)}, y {list(y.shape)}, out_slices {list(out_slices)}, max_rank "
            f"{max_rank} (want a [slots, len(out_slices) * max_rank, K], b [slots, "
            f"sum(out_slices), max_rank], y [N, sum(out_slices)])"
        )
    if not y.dtype.is_floating_point:
        raise ValueError(f"launch_delta: y must be a floating-point tensor, got {y.dtype}")
    g = lora_ids.numel()
    if n == 0 or (g == 0 and not overwrite):
        return None
    if n > 64:
        raise ValueError(f"launch_delta serves decode steps of at most 64 rows, got {n}")
    _check_devices(y, x, a, b, lora_ids, grouped_offsets, end, *_opt(ranks))
    sms = device_sms(x.device)
    scfg = shrink_config(n, k, sr, x.element_size(), sms)
    ecfg = expand_config(n, max(out_slices), max_rank, y.element_size(), sms)
    assert scfg.block_m == ecfg.block_m
    blk0, col0, widths, n_blocks = slice_meta(tuple(out_slices), ecfg.block_n)
    groups = g + 1 if overwrite else g
    tiles = num_tiles(n, groups, ecfg.block_m)
    assert tiles <= DELTA_MAX_TILES
    per_item = _run_length(tiles, n_blocks, x.device)
    n_shrink = tiles * cdiv(sr, scfg.block_n) * scfg.split_k
    n_expand = tiles * cdiv(n_blocks, per_item)
    f32 = _f32_operands(x, a)
    # fmt: off
    ints = (
        n, k, g, num_slots, scfg.k_per_split, n_shrink, n_expand,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        n * max_rank, max_rank, 1,  # h [S, N, R], contiguous at the workspace's start
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), b.stride(2),
    )
    constexprs = dict(
        R=max_rank, SR=sr, G_POW2=max(16, next_pow2(groups)), NUM_SLICES=num_slices,
        N_COL_BLOCKS=n_blocks, SLICE_BLOCK0=blk0, SLICE_COL0=col0, SLICE_WIDTH=widths,
        BLOCK_M=ecfg.block_m, SHRINK_N=scfg.block_n, BLOCK_K=scfg.block_k,
        SPLIT_K=scfg.split_k, BLOCK_N=ecfg.block_n, BLOCK_R=ecfg.block_r,
        BLOCKS_PER_ITEM=per_item, NUM_STAGES=3 if per_item > 1 else 1,
        USE_DOT=ecfg.use_dot, CAST_F32=f32, S_PRECISION="tf32x3" if f32 else "tf32",
        E_PRECISION="tf32x3" if y.dtype == torch.float32 else "tf32",
        OVERWRITE=overwrite, HAS_RANKS=ranks is not None, MAX_TILES=DELTA_MAX_TILES,
        RANK_CHUNK=_rank_chunk(ranks, max_rank, ecfg.use_dot),
        COMPACT=_compact(ranks, scfg.use_dot),
    )
    # fmt: on
    sig = fast_launch.signature(_delta_kernel)
    values = tuple(constexprs[name] for name in sig[1]) if sig else ()
    return _DeltaPlan(
        (n_shrink + n_expand,), ints, constexprs, values,
        max(scfg.num_warps, ecfg.num_warps), scfg.num_stages, num_slices * n * max_rank,
    )  # fmt: skip


def launch_delta(
    y: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    out_slices: tuple[int, ...],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    max_rank: int,
    *,
    overwrite: bool = False,
    ranks: Tensor | None = None,
    plans: dict | None = None,
) -> None:
    """:func:`launch_shrink` then :func:`launch_expand` in one launch, for decode (at most
    ``KernelPolicy.side_stream_max_rows`` rows): the expand items wait in the kernel for
    their row tile's shrink items (``_delta_kernel``), and ``h`` lives in the stream's
    zero workspace, so no memset and one launch instead of three.

    An eager call is bound by its host time, so a caller that passes ``plans`` has the
    launch of each of its call signatures worked out once and kept there, with the compiled
    kernel it launches (:class:`_DeltaPlan`).

    Args:
        y: ``[N, sum(out_slices)]``: ``y[t, slice_s] += h[s, t] @ b[slot(t), slice_s].T``
            for rows ``t < end`` (others left unchanged); with ``overwrite``, every row is
            stored (``= delta``, 0 without one) and ``y`` need not be zeroed.
        x: ``[N, K]`` activations; ``a``, ``b``, ``ranks``: as :func:`launch_shrink` and
            :func:`launch_expand`.
        lora_ids, grouped_offsets, end: the routing triple.
        plans: the caller's own cache of launches, for a caller that passes the same ``a``,
            ``b`` and ``ranks`` tensors every call, and routing tensors that are always
            views of one layout (a LoRA layer, with its :class:`RoutingBuffer`): its calls
            are then told apart by ``x``, ``y``, the number of groups and whether
            ``ranks`` is given, which costs less host time. None: the launch is worked out
            for this call.

    Raises:
        ValueError: for more than 64 rows, shapes that disagree (named in the message), a
            non-floating ``y``, or tensors on different devices.
    """
    _require_triton()
    if plans is None:  # worked out for this call, launched through fast_launch's own cache
        plan = _delta_plan(
            y, x, a, b, tuple(out_slices), lora_ids, grouped_offsets, end, max_rank, overwrite,
            ranks,
        )  # fmt: skip
        if plan is None:
            return
        count, h = _workspace(x.device, plan.h_numel)
        tensors = _delta_tensors(x, a, h, y, b, count, lora_ids, grouped_offsets, end, ranks)
        with _device_guard(x):
            fast_launch.launch(
                _delta_kernel,
                plan.grid,
                (*tensors, *plan.ints),
                plan.constexprs,
                num_warps=plan.num_warps,
                num_stages=plan.num_stages,
                device=x.device,
            )
        return
    # the caller's own cache: only x, y, the number of groups and ranks' presence change
    key = (
        x.shape, x.stride(), x.dtype, x.get_device(), y.shape, y.stride(), y.dtype,
        y.get_device(), lora_ids.shape, lora_ids.dtype, ranks is None, overwrite,
    )  # fmt: skip
    try:
        plan = plans[key]
    except KeyError:
        plan = plans[key] = _delta_plan(
            y, x, a, b, tuple(out_slices), lora_ids, grouped_offsets, end, max_rank, overwrite,
            ranks,
        )  # fmt: skip
    if plan is None:
        return
    count, h = _workspace(x.device, plan.h_numel)
    tensors = _delta_tensors(x, a, h, y, b, count, lora_ids, grouped_offsets, end, ranks)
    with _device_guard(x):
        if x.is_cuda and fast_launch.enabled():
            # the other tensors are the same every call (workspaces are fresh allocations):
            # only x's and y's alignment can change which binary Triton would pick
            align = (x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0)
            compiled = plan.compiled.get(align)
            if compiled is not None:
                fast_launch.relaunch(
                    compiled, plan.grid, x.get_device(), (*tensors, *plan.ints), plan.values
                )
                return
            compiled = _delta_kernel[plan.grid](
                *tensors, *plan.ints, **plan.constexprs, num_warps=plan.num_warps,
                num_stages=plan.num_stages,
            )  # fmt: skip
            if plan.values and fast_launch.launchable(compiled):
                plan.compiled[align] = compiled
            return
        _delta_kernel[plan.grid](
            *tensors, *plan.ints, **plan.constexprs, num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )  # fmt: skip


def _delta_tensors(x, a, h, y, b, count, lora_ids, grouped_offsets, end, ranks) -> tuple:
    """``_delta_kernel``'s tensor arguments, in its order (without a rank table, any int
    tensor in its place: the kernel does not read it)."""
    return (x, a, h, y, b, count, lora_ids, grouped_offsets, end,
            lora_ids if ranks is None else ranks)  # fmt: skip
