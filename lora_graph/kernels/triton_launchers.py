"""Launchers of the Triton LoRA kernels of shrink and expand (``_shrink_kernel``,
``_expand_kernel``, ``_expand_silu_mul_kernel``) on the slot stacks (``a``
``[num_slots, S * R, K]``, ``b`` ``[num_slots, out_features, R]``: each LoRA layer's views
of the slot pool), and what every launcher shares (devices, the interpreter).

Kernels decorated while ``TRITON_INTERPRET=1`` is set run under Triton's CPU interpreter
(:func:`interpreted`); the launchers then set it around each launch too.
"""

from __future__ import annotations

import contextlib
import os

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
