"""Triton kernels for the segmented LoRA shrink and expand, as ``torch.library`` custom ops.

Semantics: identical to the pure-torch reference ops in :mod:`lora_graph.ops`
(``lora_graph::lora_shrink`` / ``lora_graph::lora_expand_``), with the same Python
signatures: ``h[s, t] = x[t] @ A[slot(t), s].T`` and ``y[t, slice_s] += h[s, t] @ B[slot(t), slice_s].T``
for rows ``t < end``, where ``slot(t)`` is the slot of ``t``'s group. Rows at or after
``end``, and rows whose group names slot 0 (the zero adapter) or no valid slot, get no
delta: their ``h`` is exactly 0 and their ``y`` is left bit-for-bit unchanged.

Args (shared by both ops; Punica-style shapes):
    x: ``[N, in_features]`` float32 / bfloat16 / float16 activations (any strides).
    slots: ``num_slots`` flat ``[numel]`` slot stacks, evenly spaced views of one pool
        ``[num_slots, numel]``; A of a target at ``a_offset`` (``[num_slices * max_rank,
        in_features]`` per slot), B at ``b_offset`` (``[out_features, max_rank]``).
    lora_ids: ``[G]`` int32, the slot of each group.
    grouped_offsets: ``[G + 1]`` int32, non-decreasing token offsets of the groups.
    end: ``[1]`` int32, rows routed to LoRA.
    h: ``[num_slices, N, max_rank]`` float32 (shrink's output, expand's input).
    y: ``[N, sum(out_slices)]`` base output, updated in place.

Row ``t < end`` belongs to group ``g(t) = min(#{k >= 1 : grouped_offsets[k] <= t}, G - 1)``
(the reference's ``searchsorted``), i.e. group ``g`` covers rows
``grouped_offsets[g]:grouped_offsets[g + 1]``, except that group 0 starts at row 0 and
group ``G - 1`` runs to ``end``. For the routing :class:`~lora_graph.manager.LoRAManager`
builds (``grouped_offsets[0] == 0``, ``grouped_offsets[G] == end``) both readings agree.

Kernel design (no host synchronisation; the grid depends only on shapes):

- Work items. Each group's rows are cut into row tiles of ``BLOCK_M`` rows counted from
  the group's own start. Every program reads the routing triple once (one vector load of
  ``G`` entries), drops groups that name slot 0 / an unknown slot / no rows, and takes a
  ``cumsum`` of the groups' tile counts, so tile ``i`` maps to its group and rows in
  registers. The number of tiles of any routing of ``N`` rows in ``G`` groups is at most
  ``cdiv(N, BLOCK_M) + min(G, N)`` (one partial tile per non-empty group): the launch
  covers that bound, so a replay with more groups than before still covers every row.
  Items past the real tile count are idle and cost a few register ops. A 1-D grid of
  ``min(items, max_programs)`` programs walks the items grid-stride (at decode
  ``max_programs = 4 * SMs``, so idle items do not cost a CTA each; at prefill one program
  per item).
- shrink: one launch for all slices. The A block of a fused target is one ``[S*R, K]``
  matrix per slot (``S = num_slices``, ``R = max_rank``), so shrink is a segmented GEMM
  ``[rows, K] @ [K, S*R]`` whose column ``j`` lands in ``h[j // R, t, j % R]``. An item is
  ``(row tile, column block of BLOCK_N, K split)``. With ``SPLIT_K > 1`` an item reduces
  ``K / SPLIT_K`` of the inner dimension and ``tl.atomic_add`` adds its fp32 partial into
  ``h`` (zeroed by ``torch.zeros``), so at decode a ``16 x 4096`` A is streamed by many
  SMs at once (``SPLIT_K`` up to 64, one ``BLOCK_K`` step each); at prefill the splits
  are few and long.
- expand: one launch for all slices. An item is ``(row tile, column block)``; the column
  blocks of every slice are laid end to end and an item finds its slice from constexpr
  block starts (``static_range`` over the slices, no table in memory). It loads the
  ``[BLOCK_M, R]`` fp32 ``h`` tile and the ``[BLOCK_N, R]`` B tile, adds the fp32 product
  to ``y`` (upcast) and stores it in ``y``'s dtype; only rows that get a delta are written.
- Both use ``tl.dot`` (fp32 accumulation) when ``BLOCK_M >= 16`` and a broadcast
  multiply + ``tl.sum`` for ``BLOCK_M < 16`` (``N <= 4`` rows: decode at batch 1..4).
  bf16/fp16 shrink tiles go to the tensor cores as they are; fp32 operands use
  ``input_precision="tf32x3"`` (three TF32 MMAs, about fp32 accuracy; plain fp32 FMA dots
  spill registers at these tiles); expand multiplies fp32 ``h`` by B upcast to fp32
  (``tf32`` when ``y`` is 16-bit: its error is well below ``y``'s rounding; ``tf32x3``
  when ``y`` is fp32).
- fused (``lora_apply_triton_``, decode: ``N <= FUSED_MAX_ROWS = 64``): one launch, no
  memset, no allocation. An item is ``(row tile, column block of the fused output)``; it
  finds its slice as expand does, computes its rows' ``h`` for that slice in fp32
  registers (a K loop over x and the slice's ``[R, K]`` A rows, which the slice's other
  column blocks re-read from L2), then walks its ``BLOCK_N`` columns ``SUB_N`` at a time:
  ``y += h @ B.T`` as in expand. Default tiles (:func:`fused_config`): 16-row ``tl.dot``
  tiles (the only loads Triton pipelines with ``cp.async``), ``BLOCK_K`` 256 (16-bit) /
  64 (fp32), ``BLOCK_N`` 64..256 aiming at about one busy item per SM; broadcast-reduce
  tiles for 1..4 rows exist (``FUSED_BROADCAST_MAX_ROWS``, off by default). Above
  ``FUSED_MAX_ROWS`` rows the op runs shrink + expand (x would be re-read per column block).
- The only per-call allocation of the shrink + expand pair is the output ``h``. Tiles, ``SPLIT_K`` and the program
  cap come from :func:`shrink_config` / :func:`expand_config` (pure functions of shapes,
  cached); :func:`launch_shrink` / :func:`launch_expand` take an explicit config too.
  Every variant of these heuristics compiles for sm_90 without register spills.

This module imports without Triton installed (``HAVE_TRITON`` is then False and calling
an op raises ``RuntimeError``). Kernels decorated while ``TRITON_INTERPRET=1`` is set run
under Triton's CPU interpreter (:func:`interpreted`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from lora_graph.ops import DELTA_MAX_ROWS, slot_pool_view

try:  # pragma: no cover - exercised by the environment, not by a test
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = [
    "HAVE_TRITON",
    "ExpandConfig",
    "FUSED_BROADCAST_MAX_ROWS",
    "FUSED_MAX_ROWS",
    "FusedConfig",
    "ShrinkConfig",
    "expand_config",
    "fused_config",
    "DELTA_MAX_ROWS",
    "interpreted",
    "launch_expand",
    "launch_fused",
    "launch_shrink",
    "lora_apply_triton_",
    "lora_linear_delta",
    "lora_expand_triton_",
    "lora_shrink_triton",
    "shrink_config",
]

_DEFAULT_SMS = 132  # H100 / H200


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _group_table(lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots,
                     G_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """Per group (vectors of ``G_POW2``): slot, rows ``[lo, hi)`` (empty for slot 0, an
        unknown slot, or padding), and its row tiles ``[first, last)`` in the tile sequence."""
        gs = tl.arange(0, G_POW2)
        in_g = gs < G
        slot = tl.load(lora_ids_ptr + gs, mask=in_g, other=0).to(tl.int32)
        lo = tl.load(offsets_ptr + gs, mask=in_g, other=0).to(tl.int32)
        hi = tl.load(offsets_ptr + gs + 1, mask=in_g, other=0).to(tl.int32)
        end = tl.load(end_ptr).to(tl.int32)
        lo = tl.where(gs == 0, 0, lo)  # the reference's searchsorted puts rows before offsets[1] in group 0
        hi = tl.where(gs == G - 1, end, tl.minimum(hi, end))  # ... and rows up to end in group G - 1
        hi = tl.minimum(hi, N)
        valid = in_g & (slot > 0) & (slot < num_slots) & (hi > lo)
        hi = tl.where(valid, hi, lo)
        ntiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        last = tl.cumsum(ntiles, 0)
        return gs, slot, lo, hi, last - ntiles, last

    @triton.jit
    def _tile_rows(tile, gs, slot, lo, hi, first, last, BLOCK_M: tl.constexpr):
        """Slot and rows ``[row0, hi)`` of row tile ``tile``; ``row0 >= hi`` when idle."""
        g = tl.sum((last <= tile).to(tl.int32), axis=0)
        sel = gs == g
        slot_g = tl.sum(tl.where(sel, slot, 0), axis=0)
        lo_g = tl.sum(tl.where(sel, lo, 0), axis=0)
        hi_g = tl.sum(tl.where(sel, hi, 0), axis=0)
        first_g = tl.sum(tl.where(sel, first, 0), axis=0)
        return slot_g, lo_g + (tile - first_g) * BLOCK_M, hi_g

    @triton.jit
    def _shrink_tile(
        x_ptr, a_ptr, h_ptr, slot, row0, hi, pid_n, pid_k, K, k_per_split,
        stride_xm, stride_xk, stride_as, stride_aj, stride_ak, stride_hs, stride_hm, stride_hr,
        R: tl.constexpr, SR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < hi
        rows = offs_m.to(tl.int64)
        offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_j = offs_j < SR
        offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)

        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as
                  + offs_j[None, :] * stride_aj + offs_k[:, None] * stride_ak)  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_per_split, BLOCK_K):
            mask_k = offs_k < K - kk
            xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=mask_k[:, None] & mask_j[None, :], other=0.0)
            if USE_DOT:
                if CAST_F32:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
            else:
                acc += tl.sum(xt.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :], axis=1)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K * stride_ak

        s = offs_j // R
        r = offs_j % R
        h_ptrs = h_ptr + s[None, :] * stride_hs + rows[:, None] * stride_hm + r[None, :] * stride_hr
        mask = mask_m[:, None] & mask_j[None, :]
        if SPLIT_K == 1:
            tl.store(h_ptrs, acc, mask=mask)
        else:
            tl.atomic_add(h_ptrs, acc, mask=mask, sem="relaxed")

    # Row counts, group counts and item counts are not specialised on (one binary serves
    # every batch bucket with the same tiles); K and the strides are (vectorised loads).
    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_items"])
    def _shrink_kernel(
        x_ptr, a_ptr, h_ptr, lora_ids_ptr, offsets_ptr, end_ptr,
        N, K, G, num_slots, k_per_split, n_items,
        stride_xm, stride_xk,
        stride_as, stride_aj, stride_ak,
        stride_hs, stride_hm, stride_hr,
        R: tl.constexpr, SR: tl.constexpr, G_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Semantics: ``h[j // R, t, j % R] (+)= sum_k x[t, k] * A[slot(t), j, k]`` for every
        work item ``(row tile, column block, K split)`` this program owns.

        x ``[N, K]``; A ``[num_slots, S*R, K]`` (strided pool view); h ``[S, N, R]`` fp32.
        Items are numbered ``tile * (n_col_blocks * SPLIT_K) + col_block * SPLIT_K + split``;
        program ``p`` takes items ``p, p + num_programs, ...`` below ``n_items``.
        """
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M)
        per_tile: tl.constexpr = ((SR + BLOCK_N - 1) // BLOCK_N) * SPLIT_K
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            tile = item // per_tile
            pid_n = (item % per_tile) // SPLIT_K
            pid_k = item % SPLIT_K
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            if row0 < hi:
                _shrink_tile(x_ptr, a_ptr, h_ptr, slot, row0, hi, pid_n, pid_k, K, k_per_split,
                             stride_xm, stride_xk, stride_as, stride_aj, stride_ak, stride_hs, stride_hm, stride_hr,
                             R, SR, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, CAST_F32, DOT_PRECISION)

    @triton.jit
    def _expand_tile(
        y_ptr, h_ptr, b_ptr, slot, row0, hi, pid_n,
        stride_ym, stride_yn, stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br,
        R: tl.constexpr, NUM_SLICES: tl.constexpr,
        SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr, SLICE_WIDTH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # which slice column block pid_n is in (constexpr block starts, no table in memory)
        sl = pid_n * 0
        blk0 = pid_n * 0 + SLICE_BLOCK0[0]
        col0 = pid_n * 0 + SLICE_COL0[0]
        width = pid_n * 0 + SLICE_WIDTH[0]
        for i in tl.static_range(1, NUM_SLICES):
            hit = pid_n >= SLICE_BLOCK0[i]
            sl = tl.where(hit, i, sl)
            blk0 = tl.where(hit, SLICE_BLOCK0[i], blk0)
            col0 = tl.where(hit, SLICE_COL0[i], col0)
            width = tl.where(hit, SLICE_WIDTH[i], width)

        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < hi
        rows = offs_m.to(tl.int64)
        offs_c = (pid_n - blk0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_c = offs_c < width
        cols = col0 + offs_c
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R

        h_ptrs = h_ptr + sl * stride_hs + rows[:, None] * stride_hm + offs_r[None, :] * stride_hr
        ht = tl.load(h_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        b_ptrs = (b_ptr + slot.to(tl.int64) * stride_bs
                  + cols[:, None] * stride_bn + offs_r[None, :] * stride_br)  # [BLOCK_N, BLOCK_R]
        bt = tl.load(b_ptrs, mask=mask_c[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        if USE_DOT:
            delta = tl.dot(ht, tl.trans(bt), input_precision=DOT_PRECISION)
        else:
            delta = tl.sum(ht[:, None, :] * bt[None, :, :], axis=2)

        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        mask = mask_m[:, None] & mask_c[None, :]
        yt = tl.load(y_ptrs, mask=mask, other=0.0)
        out = yt.to(tl.float32) + delta
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_items"])
    def _expand_kernel(
        y_ptr, h_ptr, b_ptr, lora_ids_ptr, offsets_ptr, end_ptr,
        N, G, num_slots, n_items,
        stride_ym, stride_yn,
        stride_hs, stride_hm, stride_hr,
        stride_bs, stride_bn, stride_br,
        R: tl.constexpr, G_POW2: tl.constexpr, NUM_SLICES: tl.constexpr, N_COL_BLOCKS: tl.constexpr,
        SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr, SLICE_WIDTH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Semantics: ``y[t, c] = cast(float(y[t, c]) + sum_r h[s(c), t, r] * B[slot(t), c, r])``
        for every work item ``(row tile, column block)`` this program owns.

        y ``[N, out]``; h ``[S, N, R]`` fp32; B ``[num_slots, out, R]`` (strided pool view).
        The slices' column blocks are laid end to end: slice ``i`` owns blocks from
        ``SLICE_BLOCK0[i]`` and columns ``SLICE_COL0[i] + [0, SLICE_WIDTH[i])``. Items are
        numbered ``tile * N_COL_BLOCKS + col_block``; program ``p`` takes ``p, p + num_programs, ...``.
        """
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M)
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            tile = item // N_COL_BLOCKS
            pid_n = item % N_COL_BLOCKS
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            if row0 < hi:
                _expand_tile(y_ptr, h_ptr, b_ptr, slot, row0, hi, pid_n,
                             stride_ym, stride_yn, stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br,
                             R, NUM_SLICES, SLICE_BLOCK0, SLICE_COL0, SLICE_WIDTH,
                             BLOCK_M, BLOCK_N, BLOCK_R, USE_DOT, DOT_PRECISION)

    @triton.jit
    def _fused_tile(
        y_ptr, x_ptr, a_ptr, b_ptr, slot, row0, hi, pid_n, K,
        stride_xm, stride_xk, stride_as, stride_aj, stride_ak,
        stride_ym, stride_yn, stride_bs, stride_bn, stride_br,
        R: tl.constexpr, NUM_SLICES: tl.constexpr,
        SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr, SLICE_WIDTH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        SUB_N: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr,
        SHRINK_PRECISION: tl.constexpr, EXPAND_PRECISION: tl.constexpr,
    ):
        # which slice column block pid_n is in (constexpr block starts, no table in memory)
        sl = pid_n * 0
        blk0 = pid_n * 0 + SLICE_BLOCK0[0]
        col0 = pid_n * 0 + SLICE_COL0[0]
        width = pid_n * 0 + SLICE_WIDTH[0]
        for i in tl.static_range(1, NUM_SLICES):
            hit = pid_n >= SLICE_BLOCK0[i]
            sl = tl.where(hit, i, sl)
            blk0 = tl.where(hit, SLICE_BLOCK0[i], blk0)
            col0 = tl.where(hit, SLICE_COL0[i], col0)
            width = tl.where(hit, SLICE_WIDTH[i], width)

        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < hi
        rows = offs_m.to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        slot64 = slot.to(tl.int64)
        a_rows = a_ptr + slot64 * stride_as + (sl * R + offs_r).to(tl.int64) * stride_aj  # [BLOCK_R]

        # shrink: h[t, r] = sum_k x[t, k] * A[slot, sl*R + r, k], fp32, in registers
        if USE_DOT:
            x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
            a_ptrs = a_rows[None, :] + offs_k[:, None] * stride_ak  # [BLOCK_K, BLOCK_R]
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for kk in range(0, K, BLOCK_K):
                mask_k = offs_k < K - kk
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                at = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
                if CAST_F32:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                acc = tl.dot(xt, at, acc, input_precision=SHRINK_PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                a_ptrs += BLOCK_K * stride_ak
            h = acc
        else:
            # broadcast multiply into a [BLOCK_M, BLOCK_R, BLOCK_K] fp32 accumulator (one
            # 3-D layout, no conversions in the loop); one reduction over k at the end
            x_ptrs = x_ptr + rows[:, None, None] * stride_xm + offs_k[None, None, :] * stride_xk  # [BM, 1, BK]
            a_ptrs = a_rows[None, :, None] + offs_k[None, None, :] * stride_ak  # [1, BR, BK]
            acc3 = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_K), dtype=tl.float32)
            for kk in range(0, K, BLOCK_K):
                mask_k = offs_k < K - kk
                xt = tl.load(x_ptrs, mask=mask_m[:, None, None] & mask_k[None, None, :], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :, None] & mask_k[None, None, :], other=0.0)
                acc3 += xt.to(tl.float32) * at.to(tl.float32)
                x_ptrs += BLOCK_K * stride_xk
                a_ptrs += BLOCK_K * stride_ak
            h = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_R]

        # expand: y[t, c] += sum_r h[t, r] * B[slot, c, r] over this block's columns, SUB_N at a time
        b_rows = b_ptr + slot64 * stride_bs
        y_rows = y_ptr + rows[:, None] * stride_ym
        for c in range(0, BLOCK_N, SUB_N):
            offs_c = (pid_n - blk0) * BLOCK_N + c + tl.arange(0, SUB_N)
            mask_c = offs_c < width
            cols = (col0 + offs_c).to(tl.int64)
            b_ptrs = b_rows + cols[:, None] * stride_bn + offs_r[None, :] * stride_br  # [SUB_N, BLOCK_R]
            bt = tl.load(b_ptrs, mask=mask_c[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
            if USE_DOT:
                delta = tl.dot(h, tl.trans(bt), input_precision=EXPAND_PRECISION)
            else:
                delta = tl.sum(h[:, None, :] * bt[None, :, :], axis=2)
            y_ptrs = y_rows + cols[None, :] * stride_yn
            mask = mask_m[:, None] & mask_c[None, :]
            yt = tl.load(y_ptrs, mask=mask, other=0.0)
            out = yt.to(tl.float32) + delta
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_items"])
    def _fused_kernel(
        y_ptr, x_ptr, a_ptr, b_ptr, lora_ids_ptr, offsets_ptr, end_ptr,
        N, K, G, num_slots, n_items,
        stride_xm, stride_xk,
        stride_as, stride_aj, stride_ak,
        stride_ym, stride_yn,
        stride_bs, stride_bn, stride_br,
        R: tl.constexpr, G_POW2: tl.constexpr, NUM_SLICES: tl.constexpr, N_COL_BLOCKS: tl.constexpr,
        SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr, SLICE_WIDTH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        SUB_N: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr,
        SHRINK_PRECISION: tl.constexpr, EXPAND_PRECISION: tl.constexpr,
    ):
        """Semantics: for every work item ``(row tile, column block)`` this program owns,
        ``h = x[rows] @ A[slot, s*R:(s+1)*R].T`` (fp32, registers; ``s`` the column block's
        slice) then ``y[rows, cols] = cast(float(y[rows, cols]) + h @ B[slot, cols].T)``.

        x ``[N, K]``; A ``[num_slots, S*R, K]``; y ``[N, out]``; B ``[num_slots, out, R]``
        (strided pool views). Column blocks and items are numbered as in ``_expand_kernel``.
        """
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M)
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            tile = item // N_COL_BLOCKS
            pid_n = item % N_COL_BLOCKS
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            if row0 < hi:
                _fused_tile(y_ptr, x_ptr, a_ptr, b_ptr, slot, row0, hi, pid_n, K,
                            stride_xm, stride_xk, stride_as, stride_aj, stride_ak,
                            stride_ym, stride_yn, stride_bs, stride_bn, stride_br,
                            R, NUM_SLICES, SLICE_BLOCK0, SLICE_COL0, SLICE_WIDTH,
                            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, SUB_N, USE_DOT, CAST_F32,
                            SHRINK_PRECISION, EXPAND_PRECISION)


_INTERPRETED = HAVE_TRITON and not isinstance(_shrink_kernel, triton.runtime.JITFunction)


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` was
    set when this module was first imported)."""
    return _INTERPRETED


def _require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("lora_graph.triton_ops needs Triton (pip install triton); use the torch backend")


# --------------------------------------------------------------------------------------
# launch configuration (pure functions of shapes: a captured graph never sees them change)
# --------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


@dataclass(frozen=True)
class ShrinkConfig:
    """Tile sizes of the shrink kernel. ``k_per_split`` is a multiple of ``block_k``;
    ``split_k == cdiv(K, k_per_split)``."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 3
    max_programs: int = 0  # 0: one program per work item; else a grid-stride loop over items

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


@dataclass(frozen=True)
class ExpandConfig:
    """Tile sizes of the expand kernel (``block_r`` covers ``max_rank``)."""

    block_m: int
    block_n: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 1
    max_programs: int = 0  # 0: one program per work item; else a grid-stride loop over items

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


def _finish_shrink(k: int, block_m: int, block_n: int, block_k: int, split_k: int,
                   num_warps: int, num_stages: int, max_programs: int = 0) -> ShrinkConfig:
    split_k = max(1, min(split_k, _cdiv(k, block_k)))
    k_per_split = _cdiv(_cdiv(k, split_k), block_k) * block_k
    return ShrinkConfig(block_m, block_n, block_k, _cdiv(k, k_per_split), k_per_split, num_warps, num_stages,
                        max_programs)


@functools.lru_cache(maxsize=1024)
def shrink_config(n: int, k: int, sr: int, elt_bytes: int = 2, num_sms: int = _DEFAULT_SMS) -> ShrinkConfig:
    """Heuristic tiles for shrink of ``N = n`` rows, ``K = k``, ``S*R = sr`` columns, inputs
    of ``elt_bytes`` bytes.

    ``N <= 4``: broadcast-reduce tiles (``BLOCK_M = next_pow2(N)``); ``N <= 64``: ``tl.dot``
    with 16-row tiles and one ``BLOCK_K`` step per K split (decode: the A block is spread
    over as many programs as possible); larger ``N``: 32/64-row tiles and at least four
    ``BLOCK_K`` steps per split. ``SPLIT_K`` aims at about ``2 * num_sms`` programs when
    every row block is busy. (Chosen so that no variant spills registers on sm_90.)
    """
    f32 = elt_bytes >= 4
    if n <= 4:
        block_m = _next_pow2(n)
        block_n = min(64, max(16, _next_pow2(sr)))
        block_k = max(32, min(128, 4096 // (block_m * block_n)))
        k_min, num_warps, num_stages = block_k, 4, 2
    elif n <= 64:
        block_m, block_n, block_k = 16, min(64, max(16, _next_pow2(sr))), 32 if f32 else 64
        k_min, num_warps, num_stages = block_k, 4, 2
    elif n <= 256:
        block_m, block_n, block_k = 32, min(64, max(16, _next_pow2(sr))), 32 if f32 else 64
        k_min, num_warps, num_stages = 4 * block_k, 4, 3
    else:
        block_m, block_n = 64, min(128, max(16, _next_pow2(sr)))
        block_k = 32 if f32 or block_n > 64 else 64
        k_min, num_warps, num_stages = 4 * block_k, 8, 3
    busy = _cdiv(n, block_m) * _cdiv(sr, block_n)
    split_k = max(1, min(_cdiv(2 * num_sms, busy), _cdiv(k, k_min)))
    return _finish_shrink(k, block_m, block_n, block_k, split_k, num_warps, num_stages,
                          4 * num_sms if n <= 64 else 0)


@functools.lru_cache(maxsize=1024)
def expand_config(n: int, max_width: int, max_rank: int, elt_bytes: int = 2,
                  num_sms: int = _DEFAULT_SMS) -> ExpandConfig:
    """Heuristic tiles for expand of ``N = n`` rows, widest slice ``max_width``, ``y`` of
    ``elt_bytes`` bytes.

    ``N <= 4``: broadcast-reduce tiles; ``N <= 64``: 16 x 64 ``tl.dot`` tiles (many column
    programs at decode); larger ``N``: 32/64 x 128 (x 64 for fp32 ``y``).
    """
    block_r = max(16, _next_pow2(max_rank))
    wide = 64 if elt_bytes >= 4 else 128
    if n <= 4:
        block_m = _next_pow2(n)
        block_n = max(16, min(128, 8192 // (block_m * block_r)))
    elif n <= 64:
        block_m, block_n = 16, 64
    elif n <= 256:
        block_m, block_n = 32, wide
    else:
        block_m, block_n = 64, wide
    block_n = min(block_n, max(16, _next_pow2(max_width)))
    return ExpandConfig(block_m, block_n, block_r, num_warps=8 if block_m * block_n >= 4096 else 4,
                        max_programs=4 * num_sms if n <= 64 else 0)

@dataclass(frozen=True)
class FusedConfig:
    """Tile sizes of the fused shrink + expand kernel: ``block_n`` output columns per work
    item (a column block never straddles a slice), walked ``sub_n`` at a time in the
    expand; ``block_k`` the shrink's K step; ``block_r`` covers ``max_rank``."""

    block_m: int
    block_n: int
    block_k: int
    block_r: int
    sub_n: int
    num_warps: int = 4
    num_stages: int = 3
    max_programs: int = 0  # 0: one program per work item; else a grid-stride loop over items

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


# Row counts up to which :func:`lora_apply_triton_` runs the fused kernel; above it, the
# shrink + expand pair (each fused work item re-reads its rows of x once per column
# block, which only pays while x is tiny and the launches dominate).
FUSED_MAX_ROWS = 64


# Row counts up to which :func:`fused_config` picks broadcast-reduce tiles (``BLOCK_M =
# next_pow2(N)``, no ``tl.dot``) instead of 16-row ``tl.dot`` tiles. 0: never. Compiled for
# sm_90, Triton software-pipelines (``cp.async``, ``num_stages`` deep) only the loads that
# feed a ``tl.dot``; the broadcast path's A loads are issued one K step at a time, so each
# step waits a full L2 round trip. A 16-row dot tile with masked rows costs no extra
# memory traffic (masked loads move nothing) and its MMA work is negligible.
FUSED_BROADCAST_MAX_ROWS = 0


@functools.lru_cache(maxsize=1024)
def fused_config(n: int, k: int, out_features: int, max_width: int, max_rank: int, g: int,
                 elt_bytes: int = 2, num_sms: int = _DEFAULT_SMS, broadcast_max_rows: int | None = None) -> FusedConfig:
    """Heuristic tiles for the fused kernel with ``N = n`` rows, ``K = k``, ``out_features``
    output columns (widest slice ``max_width``), ``G = g`` routing groups.

    ``N <= broadcast_max_rows`` (default :data:`FUSED_BROADCAST_MAX_ROWS`): broadcast-reduce
    tiles (``BLOCK_M = next_pow2(N)``, a ``[BLOCK_M, BLOCK_R, BLOCK_K]`` fp32 accumulator
    of at most 8192 entries); else 16-row ``tl.dot`` tiles with ``BLOCK_K = 256`` (16-bit)
    / 64 (fp32) and a 4 / 3 stage ``cp.async`` pipeline. ``BLOCK_N``: every work item
    re-reads its slice's ``R x K`` A block (from L2), so wider blocks mean less traffic and
    fewer programs; aim at about ``num_sms`` busy items for ``min(N, G)`` distinct groups,
    within ``[64, 256]`` columns. (Every default variant compiles for sm_90 without spills.)
    """
    if broadcast_max_rows is None:
        broadcast_max_rows = FUSED_BROADCAST_MAX_ROWS
    block_r = max(16, _next_pow2(max_rank))
    groups = max(1, min(n, g))
    block_n = _next_pow2(max(1, _cdiv(out_features * groups, num_sms)))
    block_n = max(64, min(256, block_n))
    block_n = min(block_n, max(16, _next_pow2(max_width)))
    k_cap = max(32, _next_pow2(k))  # no K step wider than K itself
    if n <= min(4, broadcast_max_rows):
        block_m = _next_pow2(n)
        block_k = min(k_cap, max(32, min(512, 8192 // (block_m * block_r))))
        sub_n = max(16, min(block_n, 4096 // (block_m * block_r)))
        num_stages = 2
    else:
        block_m = 16
        block_k = min(k_cap, 64 if elt_bytes >= 4 else 256)
        sub_n = min(block_n, 64)
        num_stages = 3 if elt_bytes >= 4 else 4
    return FusedConfig(block_m, block_n, block_k, block_r, sub_n, num_warps=4, num_stages=num_stages,
                       max_programs=4 * num_sms)


def _num_tiles(n: int, g: int, block_m: int) -> int:
    """An upper bound on the row tiles of any routing of ``n`` rows in ``g`` groups: groups
    are disjoint row ranges, each tiled from its own start, so at most one partial tile per
    non-empty group beyond ``cdiv(n, block_m)``. Depends on shapes only."""
    return _cdiv(n, block_m) + min(g, n)


@functools.lru_cache(maxsize=256)
def _slice_meta(out_slices: tuple[int, ...], block_n: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """``(block starts, column starts, widths, total column blocks)`` of the slices."""
    blk, col, b, c = [], [], 0, 0
    for w in out_slices:
        blk.append(b)
        col.append(c)
        b += _cdiv(w, block_n)
        c += w
    return tuple(blk), tuple(col), tuple(out_slices), b


def _check_devices(*tensors: Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors[1:]):
        raise ValueError(f"activations, slots, h and routing must share one device, got {[str(t.device) for t in tensors]}")


def _device_guard(t: Tensor):
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


# --------------------------------------------------------------------------------------
# launchers (no allocation, no synchronisation; usable with a forced config by benches/tests)
# --------------------------------------------------------------------------------------


def launch_shrink(x: Tensor, a: Tensor, h: Tensor, lora_ids: Tensor, grouped_offsets: Tensor, end: Tensor,
                  max_rank: int, config: ShrinkConfig | None = None) -> None:
    """Semantics: ``h[s, t] (+)= x[t] @ a[slot(t), s*R:(s+1)*R].T`` for rows ``t < end``.

    Args:
        x: ``[N, K]`` float32 / bfloat16 / float16 activations.
        a: ``[num_slots, S * max_rank, K]`` strided pool view of the A blocks.
        h: ``[S, N, max_rank]`` float32, zero where no delta applies; written (``SPLIT_K == 1``)
            or accumulated into (``SPLIT_K > 1``): it must be zero on entry.
        lora_ids, grouped_offsets, end: the routing triple (``[G]``, ``[G + 1]``, ``[1]`` int).
        max_rank: ``R``.
        config: tiles; :func:`shrink_config` when None.
    """
    _require_triton()
    n, k = x.shape
    num_slots, sr, k_a = a.shape
    g = lora_ids.numel()
    if n == 0 or g == 0:
        return
    assert k_a == k and h.shape == (sr // max_rank, n, max_rank) and h.dtype == torch.float32
    _check_devices(x, a, h, lora_ids, grouped_offsets, end)
    cfg = config or shrink_config(n, k, sr, x.element_size(), _num_sms(x.device))
    # fp32 operands (or mixed dtypes): exact fp32 products. Triton's CPU interpreter runs
    # tl.dot through numpy, which has no bfloat16 (it multiplies the raw uint16 bits), so
    # there bf16 tiles are upcast before the dot; compiled kernels use bf16 MMA.
    f32 = (x.dtype != a.dtype or x.dtype == torch.float32
           or (x.dtype == torch.bfloat16 and interpreted()))
    n_items = _num_tiles(n, g, cfg.block_m) * _cdiv(sr, cfg.block_n) * cfg.split_k
    grid = (min(n_items, cfg.max_programs) if cfg.max_programs else n_items,)
    with _device_guard(x):
        _shrink_kernel[grid](
            x, a, h, lora_ids, grouped_offsets, end,
            n, k, g, num_slots, cfg.k_per_split, n_items,
            x.stride(0), x.stride(1),
            a.stride(0), a.stride(1), a.stride(2),
            h.stride(0), h.stride(1), h.stride(2),
            R=max_rank, SR=sr, G_POW2=max(16, _next_pow2(g)),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k, USE_DOT=cfg.use_dot, CAST_F32=f32,
            DOT_PRECISION="tf32x3" if f32 else "tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def launch_expand(y: Tensor, h: Tensor, b: Tensor, out_slices: tuple[int, ...], lora_ids: Tensor,
                  grouped_offsets: Tensor, end: Tensor, config: ExpandConfig | None = None) -> None:
    """Semantics: ``y[t, slice_s] += h[s, t] @ b[slot(t), slice_s].T`` for rows ``t < end``.

    Args:
        y: ``[N, sum(out_slices)]`` float32 / bfloat16 / float16, updated in place (only the
            rows that get a delta are written).
        h: ``[S, N, max_rank]`` float32.
        b: ``[num_slots, sum(out_slices), max_rank]`` strided pool view of the B blocks.
        out_slices: the width of each slice (``S`` entries).
        lora_ids, grouped_offsets, end: the routing triple.
        config: tiles; :func:`expand_config` when None.
    """
    _require_triton()
    num_slices, n, max_rank = h.shape
    num_slots, out_features, r_b = b.shape
    g = lora_ids.numel()
    if n == 0 or g == 0:
        return
    assert r_b == max_rank and len(out_slices) == num_slices and y.shape == (n, out_features)
    _check_devices(y, h, b, lora_ids, grouped_offsets, end)
    cfg = config or expand_config(n, max(out_slices), max_rank, y.element_size(), _num_sms(y.device))
    blk0, col0, widths, n_blocks = _slice_meta(tuple(out_slices), cfg.block_n)
    n_items = _num_tiles(n, g, cfg.block_m) * n_blocks
    grid = (min(n_items, cfg.max_programs) if cfg.max_programs else n_items,)
    with _device_guard(y):
        _expand_kernel[grid](
            y, h, b, lora_ids, grouped_offsets, end,
            n, g, num_slots, n_items,
            y.stride(0), y.stride(1),
            h.stride(0), h.stride(1), h.stride(2),
            b.stride(0), b.stride(1), b.stride(2),
            R=max_rank, G_POW2=max(16, _next_pow2(g)), NUM_SLICES=num_slices, N_COL_BLOCKS=n_blocks,
            SLICE_BLOCK0=blk0, SLICE_COL0=col0, SLICE_WIDTH=widths,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
            USE_DOT=cfg.use_dot, DOT_PRECISION="tf32x3" if y.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def launch_fused(y: Tensor, x: Tensor, a: Tensor, b: Tensor, out_slices: tuple[int, ...], lora_ids: Tensor,
                 grouped_offsets: Tensor, end: Tensor, max_rank: int, config: FusedConfig | None = None) -> None:
    """Semantics: ``y[t, slice_s] += (x[t] @ a[slot(t), s*R:(s+1)*R].T) @ b[slot(t), slice_s].T``
    for rows ``t < end``, in one launch, with ``h`` kept in fp32 registers.

    Args:
        y: ``[N, sum(out_slices)]`` float32 / bfloat16 / float16, updated in place (only the
            rows that get a delta are written).
        x: ``[N, K]`` activations.
        a: ``[num_slots, S * max_rank, K]`` strided pool view of the A blocks.
        b: ``[num_slots, sum(out_slices), max_rank]`` strided pool view of the B blocks.
        out_slices: the width of each slice (``S`` entries).
        lora_ids, grouped_offsets, end: the routing triple.
        max_rank: ``R``.
        config: tiles; :func:`fused_config` when None.
    """
    _require_triton()
    n, k = x.shape
    num_slots, sr, k_a = a.shape
    num_slots_b, out_features, r_b = b.shape
    g = lora_ids.numel()
    if n == 0 or g == 0:
        return
    num_slices = len(out_slices)
    assert k_a == k and sr == num_slices * max_rank and r_b == max_rank and num_slots_b == num_slots
    assert y.shape == (n, out_features) and sum(out_slices) == out_features
    _check_devices(y, x, a, b, lora_ids, grouped_offsets, end)
    cfg = config or fused_config(n, k, out_features, max(out_slices), max_rank, g, x.element_size(),
                                 _num_sms(x.device))
    # as in launch_shrink: exact fp32 products for fp32 / mixed operands and for bf16 under
    # the interpreter (numpy has no bfloat16); compiled bf16/fp16 tiles go to the MMA as they are
    f32 = (x.dtype != a.dtype or x.dtype == torch.float32
           or (x.dtype == torch.bfloat16 and interpreted()))
    blk0, col0, widths, n_blocks = _slice_meta(tuple(out_slices), cfg.block_n)
    n_items = _num_tiles(n, g, cfg.block_m) * n_blocks
    grid = (min(n_items, cfg.max_programs) if cfg.max_programs else n_items,)
    with _device_guard(x):
        _fused_kernel[grid](
            y, x, a, b, lora_ids, grouped_offsets, end,
            n, k, g, num_slots, n_items,
            x.stride(0), x.stride(1),
            a.stride(0), a.stride(1), a.stride(2),
            y.stride(0), y.stride(1),
            b.stride(0), b.stride(1), b.stride(2),
            R=max_rank, G_POW2=max(16, _next_pow2(g)), NUM_SLICES=num_slices, N_COL_BLOCKS=n_blocks,
            SLICE_BLOCK0=blk0, SLICE_COL0=col0, SLICE_WIDTH=widths,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
            SUB_N=cfg.sub_n, USE_DOT=cfg.use_dot, CAST_F32=f32,
            SHRINK_PRECISION="tf32x3" if f32 else "tf32",
            EXPAND_PRECISION="tf32x3" if y.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


# --------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------


@torch.library.custom_op("lora_graph::lora_shrink_triton", mutates_args=())
def lora_shrink_triton(
    x: Tensor,
    slots: list[Tensor],
    a_offset: int,
    num_slices: int,
    max_rank: int,
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> Tensor:
    """Semantics: ``h[s, t] = x[t] @ A[slot(t), s].T`` for rows ``t < end``; 0 after.

    The Triton twin of :func:`lora_graph.ops.lora_shrink`: one launch for all slices,
    split-K with fp32 atomics at small ``N``.

    Args:
        x: ``[N, in_features]`` activations (float32, bfloat16 or float16).
        slots: ``num_slots`` flat slot stacks ``[numel]`` (views of one pool).
        a_offset: the A block's offset in every slot (``[num_slices, max_rank, in_features]``).
        num_slices: slices of the fused projection (``S``).
        max_rank: ``R``, the pool's rank; an adapter of rank ``r < R`` is zero beyond ``r``.
        lora_ids: ``[G]`` int32 slot of each group.
        grouped_offsets: ``[G + 1]`` int32 token offsets of the groups.
        end: ``[1]`` int32 rows routed to LoRA.

    Returns:
        ``h`` ``[num_slices, N, max_rank]`` float32, exactly 0 on rows that get no delta.
    """
    _require_triton()
    n, in_features = x.shape
    h = torch.zeros((num_slices, n, max_rank), dtype=torch.float32, device=x.device)
    a = slot_pool_view(slots, a_offset, (num_slices * max_rank, in_features))
    launch_shrink(x, a, h, lora_ids, grouped_offsets, end, max_rank)
    return h


@lora_shrink_triton.register_fake
def _(x, slots, a_offset, num_slices, max_rank, lora_ids, grouped_offsets, end):
    return x.new_empty((num_slices, x.shape[0], max_rank), dtype=torch.float32)


@torch.library.custom_op("lora_graph::lora_expand_triton_", mutates_args=("y",))
def lora_expand_triton_(
    y: Tensor,
    h: Tensor,
    slots: list[Tensor],
    b_offset: int,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> None:
    """Semantics: ``y[t, slice_s] += h[s, t] @ B[slot(t), slice_s].T`` for rows ``t < end``.

    The Triton twin of :func:`lora_graph.ops.lora_expand_`: one launch for all slices; the
    sum is formed in fp32 and cast to ``y``'s dtype once.

    Args:
        y: ``[N, sum(out_slices)]`` base output (float32, bfloat16 or float16), updated in
            place; rows at or after ``end`` are left bit-for-bit unchanged.
        h: ``[num_slices, N, max_rank]`` float32, from :func:`lora_shrink_triton`.
        slots: ``num_slots`` flat slot stacks ``[numel]`` (views of one pool).
        b_offset: the B block's offset in every slot (``[out_features, max_rank]``).
        out_slices: the width of each slice.
        lora_ids: ``[G]`` int32 slot of each group.
        grouped_offsets: ``[G + 1]`` int32 token offsets of the groups.
        end: ``[1]`` int32 rows routed to LoRA.
    """
    _require_triton()
    num_slices, n, max_rank = h.shape
    b = slot_pool_view(slots, b_offset, (sum(out_slices), max_rank))
    launch_expand(y, h, b, tuple(out_slices), lora_ids, grouped_offsets, end)


@lora_expand_triton_.register_fake
def _(y, h, slots, b_offset, out_slices, lora_ids, grouped_offsets, end):
    return None


@torch.library.custom_op("lora_graph::lora_apply_triton_", mutates_args=("y",))
def lora_apply_triton_(
    y: Tensor,
    x: Tensor,
    a_slots: list[Tensor],
    b_slots: list[Tensor],
    a_offset: int,
    b_offset: int,
    num_slices: int,
    max_rank: int,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> None:
    """Semantics: ``h = lora_shrink(x, a_slots, a_offset, num_slices, max_rank, routing)``
    then ``lora_expand_(y, h, b_slots, b_offset, out_slices, routing)``: for rows ``t < end``,
    ``y[t, slice_s] += (x[t] @ A[slot(t), s].T) @ B[slot(t), slice_s].T``.

    For ``N <= FUSED_MAX_ROWS`` rows (decode) one launch of the fused kernel, with no
    memset and no allocation (``h`` lives in registers); for more rows (prefill) the
    shrink + expand pair (:func:`launch_shrink` into a zeroed fp32 ``h``, then
    :func:`launch_expand`). The choice depends on ``x.shape[0]`` only (static per graph).

    Args:
        y: ``[N, sum(out_slices)]`` base output (float32, bfloat16 or float16), updated in
            place; rows at or after ``end`` (and rows of slot 0 / padding groups) are left
            bit-for-bit unchanged.
        x: ``[N, in_features]`` activations.
        a_slots, b_slots: the slot stacks holding the A and B blocks (views of one pool each).
        a_offset, b_offset: the A block's offset in every ``a_slots`` slot
            (``[num_slices, max_rank, in_features]``), the B block's in every ``b_slots`` slot
            (``[sum(out_slices), max_rank]``).
        num_slices, max_rank: ``S``, ``R``.
        out_slices: the width of each slice.
        lora_ids, grouped_offsets, end: the routing triple.
    """
    _require_triton()
    n, in_features = x.shape
    a = slot_pool_view(a_slots, a_offset, (num_slices * max_rank, in_features))
    b = slot_pool_view(b_slots, b_offset, (sum(out_slices), max_rank))
    if n <= FUSED_MAX_ROWS:
        launch_fused(y, x, a, b, tuple(out_slices), lora_ids, grouped_offsets, end, max_rank)
    else:
        h = torch.zeros((num_slices, n, max_rank), dtype=torch.float32, device=x.device)
        launch_shrink(x, a, h, lora_ids, grouped_offsets, end, max_rank)
        launch_expand(y, h, b, tuple(out_slices), lora_ids, grouped_offsets, end)


@lora_apply_triton_.register_fake
def _(y, x, a_slots, b_slots, a_offset, b_offset, num_slices, max_rank, out_slices, lora_ids, grouped_offsets, end):
    return None


# --------------------------------------------------------------------------------------
# the LoRA delta on a side stream (decode): fork before the base linear, join after it
# --------------------------------------------------------------------------------------

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of a CUDA device (one per device, made on first use); None elsewhere."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


@torch.library.custom_op("lora_graph::lora_linear_delta", mutates_args=())
def lora_linear_delta(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    a_slots: list[Tensor],
    b_slots: list[Tensor],
    a_offset: int,
    b_offset: int,
    num_slices: int,
    max_rank: int,
    out_slices: list[int],
    lora_ids: Tensor,
    grouped_offsets: Tensor,
    end: Tensor,
) -> tuple[Tensor, Tensor]:
    """The base linear ``y = x @ weight.T + bias`` and, overlapping it on the device's side
    stream, the LoRA delta ``d[t, slice_s] = (x[t] @ A[slot(t), s].T) @ B[slot(t), slice_s].T``
    for rows ``t < end`` (0 elsewhere). The caller adds them: ``y + d`` in float32, which a
    compiled graph fuses into the next pointwise op.

    At decode the LoRA kernels (one memset, shrink, expand) then run beside the base GEMM
    instead of after it. One op, so that a compiler cannot schedule the GEMM before the
    side-stream work is started; it returns after the caller's stream has been made to wait
    for the side stream, so both outputs are ready for whatever the caller enqueues next.
    Without CUDA (the Triton interpreter) everything runs inline.

    Args:
        x: ``[N, in_features]`` activations.
        weight, bias: the base linear's ``[sum(out_slices), in_features]`` weight and
            optional ``[sum(out_slices)]`` bias.
        a_slots, b_slots, a_offset, b_offset, num_slices, max_rank, out_slices: as
            :func:`lora_apply_triton_`.
        lora_ids, grouped_offsets, end: the routing triple.

    Returns:
        ``(y, buf)``: the base output ``[N, sum(out_slices)]`` in ``x``'s dtype, and one flat
        float32 buffer holding ``d`` ``[N, sum(out_slices)]`` (its first
        ``N * sum(out_slices)`` elements, row-major) then the shrink's ``h``
        ``[num_slices, N, max_rank]`` (one buffer, so one memset clears both).
    """
    _require_triton()
    n, in_features = x.shape
    out_features = sum(out_slices)
    buf = torch.empty(n * out_features + num_slices * n * max_rank, dtype=torch.float32, device=x.device)
    d = buf[: n * out_features].view(n, out_features)
    h = buf[n * out_features :].view(num_slices, n, max_rank)
    a = slot_pool_view(a_slots, a_offset, (num_slices * max_rank, in_features))
    b = slot_pool_view(b_slots, b_offset, (out_features, max_rank))
    side = _side_stream(x.device)
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if side is not None:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        ctx = torch.cuda.stream(side)
    with ctx:
        buf.zero_()
        launch_shrink(x, a, h, lora_ids, grouped_offsets, end, max_rank)
        launch_expand(d, h, b, tuple(out_slices), lora_ids, grouped_offsets, end)
    y = torch.nn.functional.linear(x, weight, bias)
    if side is not None:
        main.wait_stream(side)  # x, buf: allocated on main, so they outlive the side work
    return y, buf


@lora_linear_delta.register_fake
def _(x, weight, bias, a_slots, b_slots, a_offset, b_offset, num_slices, max_rank, out_slices, lora_ids,
      grouped_offsets, end):
    n = x.shape[0]
    return (x.new_empty((n, weight.shape[0])),
            x.new_empty((n * sum(out_slices) + num_slices * n * max_rank,), dtype=torch.float32))
