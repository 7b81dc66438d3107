"""Launchers of the Triton LoRA kernels, and the Triton implementations of the ops in
:mod:`lora_graph.ops` on the slot stacks (``a`` ``[num_slots, S * R, K]``, ``b``
``[num_slots, out_features, R]``: each LoRA layer's views of the slot pool).

Kernels decorated while ``TRITON_INTERPRET=1`` is set run under Triton's CPU interpreter
(:func:`interpreted`); the launchers then set it around each launch too.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lora_graph.kernels import fast_launch
from lora_graph.kernels.triton_config import (
    ExpandConfig,
    ShrinkConfig,
    cdiv,
    device_sms,
    expand_config,
    next_pow2,
    num_tiles,
    shrink_config,
    slice_meta,
)
from lora_graph.kernels.triton_kernels import HAVE_TRITON, triton

if HAVE_TRITON:
    from lora_graph.kernels.triton_kernels import (
        _delta_kernel,
        _expand_kernel,
        _expand_silu_mul_kernel,
        _shrink_kernel,
    )

_INTERPRETED = HAVE_TRITON and not isinstance(_shrink_kernel, triton.runtime.JITFunction)


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` was
    set when they were first imported)."""
    return _INTERPRETED


def _require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError(
            "the Triton LoRA kernels need Triton (pip install triton); use the torch backend"
        )


def _f32_operands(x: Tensor, a: Tensor) -> bool:
    """Whether the shrink's ``tl.dot`` takes float32 tiles (exact fp32 products): fp32 or
    mixed operands; and bf16 under the interpreter, which runs ``tl.dot`` through numpy (no
    bfloat16: it would multiply the raw uint16 bits). Compiled bf16 tiles use bf16 MMA."""
    return (
        x.dtype != a.dtype
        or x.dtype == torch.float32
        or (x.dtype == torch.bfloat16 and interpreted())
    )


def _opt(t: Tensor | None) -> tuple[Tensor, ...]:
    return () if t is None else (t,)


def _check_devices(*tensors: Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors[1:]):
        devices = [str(t.device) for t in tensors]
        raise ValueError(f"activations, slots, h and routing must share one device, got {devices}")


def _device_guard(t: Tensor) -> contextlib.AbstractContextManager:
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    if _INTERPRETED and os.environ.get("TRITON_INTERPRET") != "1":
        return _interpreter_env()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _interpreter_env():
    """Interpreted kernels need ``TRITON_INTERPRET=1`` while they launch too (Triton reads it
    lazily, e.g. when it first imports its gluon frontend); set it for the launch only."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def launch_shrink(
    x: Tensor,
    a: Tensor,
    h: Tensor,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    max_rank: int,
    config: ShrinkConfig | None = None,
    *,
    ranks: Tensor | None = None,
) -> None:
    """Semantics: ``h[s, t] (+)= x[t] @ a[slot(t), s*R:(s+1)*R].T`` for rows ``t < end``.

    Args:
        x: ``[N, K]`` float32 / bfloat16 / float16 activations.
        a: ``[num_slots, S * max_rank, K]`` strided pool view of the A blocks.
        h: ``[S, N, max_rank]`` float32, zero where no delta applies; written (``SPLIT_K == 1``)
            or accumulated into (``SPLIT_K > 1``): it must be zero on entry.
        lora_ids, grouped_offsets, end: the routing triple (``[G]``, ``[G + 1]``, ``[1]`` int).
        max_rank: ``R``.
        config: tiles; :func:`shrink_config` when None.
        ranks: ``[num_slots]`` int32, each slot's rank (its A rows at or above it are zeros
            and are not read); None: every slot is read to ``max_rank``.
    """
    _require_triton()
    n, k = x.shape
    num_slots, sr, k_a = a.shape
    g = lora_ids.numel()
    if n == 0 or g == 0:
        return
    assert k_a == k and h.shape == (sr // max_rank, n, max_rank) and h.dtype == torch.float32
    _check_devices(x, a, h, lora_ids, grouped_offsets, end, *_opt(ranks))
    cfg = config or shrink_config(n, k, sr, x.element_size(), device_sms(x.device))
    f32 = _f32_operands(x, a)
    n_items = num_tiles(n, g, cfg.block_m) * cdiv(sr, cfg.block_n) * cfg.split_k
    grid = (min(n_items, cfg.max_programs) if cfg.max_programs else n_items,)
    with _device_guard(x):
        # fmt: off
        fast_launch.launch(_shrink_kernel, grid, (
            x, a, h, lora_ids, grouped_offsets, end, lora_ids if ranks is None else ranks,
            n, k, g, num_slots, cfg.k_per_split, n_items,
            x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
            h.stride(0), h.stride(1), h.stride(2),
        ), dict(
            R=max_rank, SR=sr, G_POW2=max(16, next_pow2(g)),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
            USE_DOT=cfg.use_dot, CAST_F32=f32, DOT_PRECISION="tf32x3" if f32 else "tf32",
            HAS_RANKS=ranks is not None, COMPACT=_compact(ranks, cfg.use_dot),
        ), num_warps=cfg.num_warps, num_stages=cfg.num_stages, device=x.device)
        # fmt: on


# The kernels' work follows each slot's rank (given a rank table) in broadcast tiles (below
# 16 rows: 1-4 rows at decode): the shrink numbers only a slot's live columns (COMPACT) and
# the expands loop over RANK_CHUNK rank columns at a time up to the slot's rank (_compact
# and _rank_chunk say why not in tl.dot tiles). Either way the loads skip what lies past a
# slot's rank. On the H200 (sessions 11 and 12) a rank-8 adapter alone in a rank-64 pool
# cost +13-14% a decode step over base at batch 1 with max_rank tiles masked past the rank
# (the alternative, since removed: bench/RESULTS.md) and +8% this way; its values are
# checked against float64 on the GPU (tests/test_triton_ops.py's
# test_gpu_columns_past_a_slots_rank_are_not_read) and under the interpreter.
# Rank columns an expand tile takes at a time when it loops up to its slot's rank
RANK_CHUNK = 16


def _rank_chunk(ranks: Tensor | None, max_rank: int, use_dot: bool) -> int:
    """``RANK_CHUNK`` when an expand tile should loop over chunks of rank columns up to its
    slot's rank, else 0 (one tile of ``BLOCK_R`` columns, masked past the rank): with a rank
    table, in a pool wider than one chunk, for broadcast tiles (below 16 rows: their
    multiply-adds grow with ``BLOCK_R``). ``tl.dot`` tiles keep the one masked tile: on the
    H200 the loop's serial loads made a rank-64 slot's expand slower at 8-64 rows (session
    11) than the tensor cores' work on masked columns costs."""
    return RANK_CHUNK if _compact(ranks, use_dot) and max_rank > RANK_CHUNK else 0


def _compact(ranks: Tensor | None, use_dot: bool) -> bool:
    """Whether the shrink numbers only each slot's live columns (``COMPACT``): with a rank
    table, for broadcast tiles (below 16 rows). On the H200 (session 11) it made batch 1
    with a rank-8 adapter in a rank-64 pool 5% faster, and mixed ranks at 8-64 rows (its
    ``tl.dot`` tiles) 3-8% slower, for a reason not found (a suspect, not measured: the
    column mapping's division by the slot's runtime rank)."""
    return ranks is not None and not use_dot


def _run_length(tiles: int, n_blocks: int, device: torch.device) -> int:
    """Column blocks a program walks so that about four programs a SM cover ``tiles`` row
    tiles of ``n_blocks`` blocks (at least one, at most all)."""
    return max(1, min(n_blocks, cdiv(tiles * n_blocks, 4 * device_sms(device))))


def launch_expand(
    y: Tensor,
    h: Tensor,
    b: Tensor,
    out_slices: tuple[int, ...],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    config: ExpandConfig | None = None,
    *,
    overwrite: bool = False,
    ranks: Tensor | None = None,
) -> None:
    """Semantics: ``y[t, slice_s] += h[s, t] @ b[slot(t), slice_s].T`` for rows ``t < end``;
    with ``overwrite``, ``y[t, slice_s] = h[s, t] @ b[slot(t), slice_s].T`` for every row
    (0 for rows that get no delta), so ``y`` need not be zeroed first.

    Args:
        y: ``[N, sum(out_slices)]`` float32 / bfloat16 / float16, updated in place (only the
            rows that get a delta are written, unless ``overwrite``).
        h: ``[S, N, max_rank]`` float32.
        b: ``[num_slots, sum(out_slices), max_rank]`` strided pool view of the B blocks.
        out_slices: the width of each slice (``S`` entries).
        lora_ids, grouped_offsets, end: the routing triple.
        config: tiles; :func:`expand_config` when None.
        overwrite: write every row instead of adding to the rows that get a delta.
        ranks: as :func:`launch_shrink` (B's columns at or above a slot's rank: not read).
    """
    _require_triton()
    num_slices, n, max_rank = h.shape
    num_slots, out_features, r_b = b.shape
    g = lora_ids.numel()
    if n == 0 or (g == 0 and not overwrite):
        return
    assert r_b == max_rank and len(out_slices) == num_slices and y.shape == (n, out_features)
    _check_devices(y, h, b, lora_ids, grouped_offsets, end, *_opt(ranks))
    cfg = config or expand_config(
        n, max(out_slices), max_rank, y.element_size(), device_sms(y.device)
    )
    blk0, col0, widths, n_blocks = slice_meta(tuple(out_slices), cfg.block_n)
    groups = g + 1 if overwrite else g  # overwrite: the rows after end are one more group
    tiles = num_tiles(n, groups, cfg.block_m)
    per_item = cfg.blocks_per_item or (
        1 if cfg.max_programs else _run_length(tiles, n_blocks, y.device)  # decode: 1 block
    )
    n_items = tiles * cdiv(n_blocks, per_item)
    grid = (min(n_items, cfg.max_programs) if cfg.max_programs else n_items,)
    with _device_guard(y):
        # fmt: off
        fast_launch.launch(_expand_kernel, grid, (
            y, h, b, lora_ids, grouped_offsets, end, lora_ids if ranks is None else ranks,
            n, g, num_slots, n_items,
            y.stride(0), y.stride(1), h.stride(0), h.stride(1), h.stride(2),
            b.stride(0), b.stride(1), b.stride(2),
        ), dict(
            R=max_rank, G_POW2=max(16, next_pow2(groups)), NUM_SLICES=num_slices,
            N_COL_BLOCKS=n_blocks, SLICE_BLOCK0=blk0, SLICE_COL0=col0, SLICE_WIDTH=widths,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
            BLOCKS_PER_ITEM=per_item, NUM_STAGES=3 if per_item > 1 else 1, USE_DOT=cfg.use_dot,
            DOT_PRECISION="tf32x3" if y.dtype == torch.float32 else "tf32", OVERWRITE=overwrite,
            HAS_RANKS=ranks is not None, RANK_CHUNK=_rank_chunk(ranks, max_rank, cfg.use_dot),
        ), num_warps=cfg.num_warps, num_stages=cfg.num_stages, device=y.device)
        # fmt: on


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


def launch_expand_silu_mul(
    y: Tensor,
    h: Tensor,
    b: Tensor,
    out: Tensor,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
    config: ExpandConfig | None = None,
    blocks_per_program: int | None = None,
    *,
    ranks: Tensor | None = None,
) -> None:
    """Semantics: ``out = silu(g) * u`` where ``[g | u] = y`` plus the delta
    :func:`launch_expand` would add (each rounded to ``y``'s dtype first), for every row.

    Args:
        y: ``[N, 2I]`` float32 / bfloat16 / float16 (read only).
        h: ``[2, N, max_rank]`` float32.
        b: ``[num_slots, 2I, max_rank]`` strided pool view of the B blocks.
        out: ``[N, I]``, ``y``'s dtype, written whole.
        lora_ids, grouped_offsets, end: the routing triple.
        config: tiles; :func:`expand_config` with columns of at most 64 when None.
        blocks_per_program: column blocks one program walks; when None, enough that about
            four programs a SM cover the step.
        ranks: as :func:`launch_shrink`.
    """
    _require_triton()
    num_slices, n, max_rank = h.shape
    num_slots, out_features, r_b = b.shape
    g = lora_ids.numel()
    i = out_features // 2
    assert num_slices == 2 and r_b == max_rank and y.shape == (n, 2 * i) and out.shape == (n, i)
    if n == 0:
        return
    _check_devices(y, h, b, out, lora_ids, grouped_offsets, end, *_opt(ranks))
    if config is None:
        cfg = expand_config(n, i, max_rank, y.element_size(), device_sms(y.device))
        block_n = min(cfg.block_n, 64)
        cfg = ExpandConfig(
            cfg.block_m, block_n, cfg.block_r, num_warps=4 if cfg.block_m * block_n < 4096 else 8
        )
    else:
        cfg = config
    n_blocks = cdiv(i, cfg.block_n)
    tiles = num_tiles(n, g + 1, cfg.block_m)  # the rows after end: one more group
    # a run of column blocks a program, so that about 4 programs a SM cover the step
    per_program = max(
        1, min(n_blocks, blocks_per_program or _run_length(tiles, n_blocks, y.device))
    )
    grid = (tiles, cdiv(n_blocks, per_program))
    # broadcast tiles loop over rank chunks (their column loop then is not pipelined)
    chunk = _rank_chunk(ranks, max_rank, cfg.use_dot)
    with _device_guard(y):
        # fmt: off
        fast_launch.launch(_expand_silu_mul_kernel, grid, (
            y, h, b, out, lora_ids, grouped_offsets, end, lora_ids if ranks is None else ranks,
            n, i, g, num_slots, tiles,
            y.stride(0), y.stride(1), h.stride(0), h.stride(1), h.stride(2),
            b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        ), dict(
            R=max_rank, G_POW2=max(16, next_pow2(g + 1)), N_COL_BLOCKS=n_blocks,
            BLOCKS_PER_PROGRAM=per_program, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_R=cfg.block_r, NUM_STAGES=1 if chunk else 3, USE_DOT=cfg.use_dot,
            DOT_PRECISION="tf32x3" if y.dtype == torch.float32 else "tf32",
            HAS_RANKS=ranks is not None, RANK_CHUNK=chunk,
        ), num_warps=cfg.num_warps, num_stages=1 if chunk else 3, device=y.device)
        # fmt: on


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
    y = torch.nn.functional.linear(x, weight, bias)
    if side is not None:
        main.wait_stream(side)
    return y, buf


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
