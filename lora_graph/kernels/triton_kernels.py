"""The Triton kernels of the segmented LoRA shrink and expand (``@triton.jit`` only; the
launch configuration is in :mod:`lora_graph.kernels.triton_config`, the launchers in
:mod:`lora_graph.kernels.triton_launchers` and :mod:`lora_graph.kernels.triton_delta`).

Semantics (the same as :mod:`lora_graph.kernels.reference`): ``h[s, t] = x[t] @ A[slot(t), s].T``
and ``y[t, slice_s] += h[s, t] @ B[slot(t), slice_s].T`` for rows ``t < end``, ``slot(t)``
the slot of ``t``'s group (:mod:`lora_graph.routing`). Rows at or after ``end``, and rows
whose group names slot 0 (the zero adapter) or no valid slot, get no delta: their ``h`` is
exactly 0 and their ``y`` is left bit-for-bit unchanged.

Design (no host synchronisation; the grid depends only on shapes):

- Work items. Each group's rows are cut into row tiles of ``BLOCK_M`` rows counted from
  the group's own start. Every program reads the routing once (one vector load of ``G``
  entries), drops groups that name slot 0 / an unknown slot / no rows, and takes a
  ``cumsum`` of the groups' tile counts, so tile ``i`` maps to its group and rows in
  registers. The number of tiles of any routing of ``N`` rows in ``G`` groups is at most
  ``cdiv(N, BLOCK_M) + min(G, N)`` (one partial tile per non-empty group): the launch
  covers that bound, so a replay with more groups than before still covers every row.
  A 1-D grid of ``min(items, max_programs)`` programs walks the items grid-stride.
- shrink: one launch for all slices. The A block of a fused target is one ``[S*R, K]``
  matrix per slot, so shrink is a segmented GEMM ``[rows, K] @ [K, S*R]`` whose column
  ``j`` lands in ``h[j // R, t, j % R]``. An item is ``(row tile, column block of
  BLOCK_N, K split)``; with ``SPLIT_K > 1`` an item reduces ``K / SPLIT_K`` of the inner
  dimension and ``tl.atomic_add`` adds its fp32 partial into a zeroed ``h``.
- expand: one launch for all slices. An item is ``(row tile, column block)``; the column
  blocks of every slice are laid end to end and an item finds its slice from constexpr
  block starts. It adds the fp32 product ``h @ B.T`` to ``y`` (upcast) and stores it in
  ``y``'s dtype; only rows that get a delta are written.
- expand + SwiGLU (``_expand_silu_mul_kernel``): the expand of a gated MLP's gate/up
  projection ``[N, 2I]`` fused with its activation: a program takes a row tile and a run of
  column blocks of the ``I`` outputs, loads its rows' ``h`` once, then for each block reads
  the gate and up tiles once, adds their deltas and writes ``silu(g) * u`` (a pipelined
  loop with no branch: rows without a delta mask their ``h`` and ``B`` loads off). Its row
  tiles also cover base and padding rows, since every output row must be written.
- expand with ``OVERWRITE`` (the side-stream delta at decode): the same row tiles over
  every row, storing the delta (0 for rows without one) instead of adding it, so the
  float32 delta buffer needs no memset.
- They use ``tl.dot`` (fp32 accumulation) when ``BLOCK_M >= 16`` and a broadcast multiply
  + ``tl.sum`` for ``BLOCK_M < 16``. bf16/fp16 tiles go to the tensor cores as they are;
  fp32 operands use ``input_precision="tf32x3"``.

Group rule: row ``t < end`` belongs to group
``g(t) = min(#{k >= 1 : grouped_offsets[k] <= t}, G - 1)`` (the reference's
``searchsorted``); for the routing :class:`lora_graph.routing.RoutingBuffer`
holds (``grouped_offsets[0] == 0``, ``grouped_offsets[G] == end``) that is exactly
"group ``g`` covers rows ``grouped_offsets[g]:grouped_offsets[g + 1]``".

Importable without Triton (``HAVE_TRITON`` is then False and nothing is defined).
"""

from __future__ import annotations

try:  # pragma: no cover - exercised by the environment, not by a test
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

# fmt: off
# (compact argument lists: the formatter would put every kernel argument on a line of its own)
if HAVE_TRITON:

    @triton.jit
    def _group_table(lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots,
                     G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, ALL_ROWS: tl.constexpr):
        """Per group (vectors of ``G_POW2``): slot, rows ``[lo, hi)`` (empty for slot 0, an
        unknown slot, or padding), and its row tiles ``[first, last)`` in the tile sequence.

        With ``ALL_ROWS`` every row is covered: groups of slot 0 or an unknown slot keep their
        rows under slot 0, and one more group ``G`` holds the rows from ``end`` to ``N``
        (``G_POW2`` must exceed ``G``)."""
        gs = tl.arange(0, G_POW2)
        in_g = gs < G
        slot = tl.load(lora_ids_ptr + gs, mask=in_g, other=0).to(tl.int32)
        lo = tl.load(offsets_ptr + gs, mask=in_g, other=0).to(tl.int32)
        hi = tl.load(offsets_ptr + gs + 1, mask=in_g, other=0).to(tl.int32)
        end = tl.load(end_ptr).to(tl.int32)
        # the reference's searchsorted puts rows before offsets[1] in group 0, and rows up to
        # end in group G - 1
        lo = tl.where(gs == 0, 0, lo)
        hi = tl.where(gs == G - 1, end, tl.minimum(hi, end))
        hi = tl.minimum(hi, N)
        known = (slot > 0) & (slot < num_slots)
        if ALL_ROWS:
            tail = gs == G  # the rows after end: no delta
            end_n = tl.minimum(end, N)
            lo = tl.where(tail, end_n, tl.minimum(lo, end_n))
            hi = tl.where(tail, N, hi)
            slot = tl.where(in_g & known, slot, 0)
            valid = (in_g | tail) & (hi > lo)
        else:
            valid = in_g & known & (hi > lo)
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
    def _slot_rank(ranks_ptr, slot, R: tl.constexpr, HAS_RANKS: tl.constexpr):
        """Columns of ``slot``'s blocks that may be nonzero (columns at or above an adapter's
        rank are zero in its slot): ``ranks[slot]`` rounded up to a multiple of 16 and at
        most ``R`` when ``R`` is a multiple of 16 (a mask ``r < rank`` then stays constant
        over runs of 16 columns, so loads along the rank keep their vector width: one
        32-byte sector of bf16), else ``min(ranks[slot], R)``; ``R`` without a rank table."""
        if HAS_RANKS:
            rank = tl.load(ranks_ptr + slot).to(tl.int32)
            if R % 16 == 0:
                rank = tl.minimum((rank + 15) // 16 * 16, R)
                return tl.multiple_of(rank, 16)
            else:
                return tl.minimum(rank, R)
        else:
            return slot * 0 + R

    @triton.jit
    def _live_block(pid_n, rank, R: tl.constexpr, SR: tl.constexpr, BLOCK_N: tl.constexpr,
                    COMPACT: tl.constexpr):
        """Whether shrink column block ``pid_n`` (of ``BLOCK_N`` columns) holds a column
        below the slot's ``rank`` in its slice (else all its A rows are zero: the block is
        skipped). ``COMPACT`` numbers only the slot's ``S * rank`` live columns (the first
        blocks), else all ``S * R``."""
        if COMPACT:
            return pid_n * BLOCK_N < (SR // R) * rank
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            return tl.sum(((cols % R < rank) & (cols < SR)).to(tl.int32), axis=0) > 0

    @triton.jit
    def _shrink_tile(
        x_ptr, a_ptr, h_ptr, slot, rank, row0, hi, pid_n, pid_k, K, k_per_split,
        stride_xm, stride_xk, stride_as, stride_aj, stride_ak, stride_hs, stride_hm, stride_hr,
        R: tl.constexpr, SR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr, COMPACT: tl.constexpr,
    ):
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < hi
        rows = offs_m.to(tl.int64)
        offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if COMPACT:  # column j of the block: slice j // rank, rank column j % rank
            rank_d = tl.maximum(rank, 1)
            s = offs_j // rank_d
            r = offs_j % rank_d
            mask_j = offs_j < (SR // R) * rank
            mask_a = mask_j
        else:  # column j: slice j // R, rank column j % R
            s = offs_j // R
            r = offs_j % R
            mask_j = offs_j < SR
            mask_a = mask_j & (r < rank)  # the A rows past the slot's rank: not read
        offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)

        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + (s * R + r)[None, :] * stride_aj
                  + offs_k[:, None] * stride_ak)  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_per_split, BLOCK_K):
            mask_k = offs_k < K - kk
            xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=mask_k[:, None] & mask_a[None, :], other=0.0)
            if USE_DOT:
                if CAST_F32:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
            else:
                acc += tl.sum(xt.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :], axis=1)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K * stride_ak

        h_ptrs = h_ptr + s[None, :] * stride_hs + rows[:, None] * stride_hm + r[None, :] * stride_hr
        mask = mask_m[:, None] & mask_j[None, :]
        if SPLIT_K == 1:  # not COMPACT: 0 past the rank; COMPACT: h's columns past it untouched
            tl.store(h_ptrs, acc, mask=mask)
        else:
            tl.atomic_add(h_ptrs, acc, mask=mask_m[:, None] & mask_a[None, :], sem="relaxed")

    # Row counts, group counts and item counts are not specialised on (one binary serves
    # every batch bucket with the same tiles); K and the strides are (vectorised loads).
    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_items"])
    def _shrink_kernel(
        x_ptr, a_ptr, h_ptr, lora_ids_ptr, offsets_ptr, end_ptr, ranks_ptr,
        N, K, G, num_slots, k_per_split, n_items,
        stride_xm, stride_xk,
        stride_as, stride_aj, stride_ak,
        stride_hs, stride_hm, stride_hr,
        R: tl.constexpr, SR: tl.constexpr, G_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, CAST_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr, COMPACT: tl.constexpr,
    ):
        """Semantics: ``h[j // R, t, j % R] (+)= sum_k x[t, k] * A[slot(t), j, k]`` for every
        work item ``(row tile, column block, K split)`` this program owns.

        x ``[N, K]``; A ``[num_slots, S*R, K]`` (strided pool view); h ``[S, N, R]`` fp32.
        With ``HAS_RANKS``, ``ranks[slot]`` bounds the nonzero rows of each slice of a slot's A
        (``[num_slots]`` int32): rows ``j % R`` at or above it are not read, and an item whose
        column block holds none below it does nothing (its ``h`` stays as it was: zero).
        With ``COMPACT`` (needs ``HAS_RANKS``) the column blocks number only a slot's
        ``S * rank`` live columns, so a low-rank slot's items past them end at once.
        Items are numbered ``tile * (n_col_blocks * SPLIT_K) + col_block * SPLIT_K + split``;
        program ``p`` takes items ``p, p + num_programs, ...`` below ``n_items``.
        """
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M, False)
        per_tile: tl.constexpr = ((SR + BLOCK_N - 1) // BLOCK_N) * SPLIT_K
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            tile = item // per_tile
            pid_n = (item % per_tile) // SPLIT_K
            pid_k = item % SPLIT_K
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            rank = _slot_rank(ranks_ptr, slot, R, HAS_RANKS)
            if (row0 < hi) & _live_block(pid_n, rank, R, SR, BLOCK_N, COMPACT):
                _shrink_tile(x_ptr, a_ptr, h_ptr, slot, rank, row0, hi, pid_n, pid_k, K,
                             k_per_split,
                             stride_xm, stride_xk, stride_as, stride_aj, stride_ak,
                             stride_hs, stride_hm, stride_hr,
                             R, SR, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, CAST_F32,
                             DOT_PRECISION, COMPACT)

    @triton.jit
    def _expand_tile(
        y_ptr, h_ptr, b_ptr, slot, rank, row0, hi, pid_n,
        stride_ym, stride_yn, stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br,
        R: tl.constexpr, NUM_SLICES: tl.constexpr,
        SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr, SLICE_WIDTH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, OVERWRITE: tl.constexpr,
        RANK_CHUNK: tl.constexpr,
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
        h_rows = h_ptr + sl * stride_hs + rows[:, None] * stride_hm
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn
        if RANK_CHUNK == 0:  # one [*, BLOCK_R] tile, masked past the slot's rank
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank  # B's columns (and h's) past the slot's rank are not read
            if OVERWRITE:  # rows of slot 0 (base rows, padding) store 0 without reading h or B
                mask_r = mask_r & ((offs_r * 0 + slot) > 0)
            ht = tl.load(h_rows + offs_r[None, :] * stride_hr,
                         mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
            bt = tl.load(b_rows + offs_r[None, :] * stride_br,  # [BLOCK_N, BLOCK_R]
                         mask=mask_c[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
            if USE_DOT:
                delta = tl.dot(ht, tl.trans(bt), input_precision=DOT_PRECISION)
            else:
                delta = tl.sum(ht[:, None, :] * bt[None, :, :], axis=2)
        else:  # chunks of RANK_CHUNK columns up to the slot's rank: its cost follows its rank
            tl.static_assert(not USE_DOT, "rank chunks are for broadcast tiles (_rank_chunk)")
            r_stop = rank
            if OVERWRITE:  # rows of slot 0 (base rows, padding) store 0 without reading h or B
                r_stop = tl.where(slot > 0, rank, 0)
            delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, r_stop, RANK_CHUNK):
                offs_r = r0 + tl.arange(0, RANK_CHUNK)
                mask_r = offs_r < rank
                ht = tl.load(h_rows + offs_r[None, :] * stride_hr,
                             mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
                bt = tl.load(b_rows + offs_r[None, :] * stride_br,
                             mask=mask_c[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
                delta += tl.sum(ht[:, None, :] * bt[None, :, :], axis=2)

        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        mask = mask_m[:, None] & mask_c[None, :]
        if OVERWRITE:
            out = delta
        else:
            yt = tl.load(y_ptrs, mask=mask, other=0.0)
            out = yt.to(tl.float32) + delta
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_items"])
    def _expand_kernel(
        y_ptr, h_ptr, b_ptr, lora_ids_ptr, offsets_ptr, end_ptr, ranks_ptr,
        N, G, num_slots, n_items,
        stride_ym, stride_yn,
        stride_hs, stride_hm, stride_hr,
        stride_bs, stride_bn, stride_br,
        R: tl.constexpr, G_POW2: tl.constexpr, NUM_SLICES: tl.constexpr, N_COL_BLOCKS: tl.constexpr,
        SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr, SLICE_WIDTH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCKS_PER_ITEM: tl.constexpr, NUM_STAGES: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, OVERWRITE: tl.constexpr,
        HAS_RANKS: tl.constexpr, RANK_CHUNK: tl.constexpr,
    ):
        """Semantics: ``y[t, c] = cast(float(y[t, c]) + sum_r h[s(c), t, r] * B[slot(t), c, r])``
        for every work item ``(row tile, column block)`` this program owns; with
        ``OVERWRITE``, ``y[t, c] = cast(sum_r ...)`` for every row ``t < N`` (0 for rows that
        get no delta, whose ``h`` and ``B`` are not read), so ``y`` need not be zeroed. With
        ``HAS_RANKS`` the sum runs over ``r < ranks[slot(t)]`` only (the rest are zeros).

        y ``[N, out]``; h ``[S, N, R]`` fp32; B ``[num_slots, out, R]`` (strided pool view).
        The slices' column blocks are laid end to end: slice ``i`` owns blocks from
        ``SLICE_BLOCK0[i]`` and columns ``SLICE_COL0[i] + [0, SLICE_WIDTH[i])``. Items are
        ``(row tile, run of BLOCKS_PER_ITEM column blocks)``, numbered ``tile * runs + run``;
        program ``p`` takes ``p, p + num_programs, ...`` and walks each item's blocks in a
        pipelined loop (prefill: a long run streams ``y`` with its loads in flight).
        """
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M, OVERWRITE)
        runs: tl.constexpr = (N_COL_BLOCKS + BLOCKS_PER_ITEM - 1) // BLOCKS_PER_ITEM
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            tile = item // runs
            first = (item % runs) * BLOCKS_PER_ITEM
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            rank = _slot_rank(ranks_ptr, slot, R, HAS_RANKS)
            if row0 < hi:
                stop = tl.minimum(first + BLOCKS_PER_ITEM, N_COL_BLOCKS)
                for pid_n in tl.range(first, stop, num_stages=NUM_STAGES):
                    _expand_tile(y_ptr, h_ptr, b_ptr, slot, rank, row0, hi, pid_n,
                                 stride_ym, stride_yn, stride_hs, stride_hm, stride_hr,
                                 stride_bs, stride_bn, stride_br,
                                 R, NUM_SLICES, SLICE_BLOCK0, SLICE_COL0, SLICE_WIDTH,
                                 BLOCK_M, BLOCK_N, BLOCK_R, USE_DOT, DOT_PRECISION, OVERWRITE,
                                 RANK_CHUNK)
    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_shrink", "n_expand"])
    def _delta_kernel(
        x_ptr, a_ptr, h_ptr, y_ptr, b_ptr, count_ptr, lora_ids_ptr, offsets_ptr, end_ptr,
        ranks_ptr,
        N, K, G, num_slots, k_per_split, n_shrink, n_expand,
        stride_xm, stride_xk, stride_as, stride_aj, stride_ak,
        stride_hs, stride_hm, stride_hr,
        stride_ym, stride_yn, stride_bs, stride_bn, stride_br,
        R: tl.constexpr, SR: tl.constexpr, G_POW2: tl.constexpr, NUM_SLICES: tl.constexpr,
        N_COL_BLOCKS: tl.constexpr, SLICE_BLOCK0: tl.constexpr, SLICE_COL0: tl.constexpr,
        SLICE_WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, SHRINK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCKS_PER_ITEM: tl.constexpr, NUM_STAGES: tl.constexpr,
        USE_DOT: tl.constexpr, CAST_F32: tl.constexpr, S_PRECISION: tl.constexpr,
        E_PRECISION: tl.constexpr, OVERWRITE: tl.constexpr, HAS_RANKS: tl.constexpr,
        MAX_TILES: tl.constexpr, RANK_CHUNK: tl.constexpr, COMPACT: tl.constexpr,
    ):
        """Semantics: :func:`_shrink_kernel` then :func:`_expand_kernel` in one launch (decode):
        ``y[t, c] (+)= sum_r h[s(c), t, r] * B[slot(t), c, r]`` with ``h = x @ A[slot(t)].T``.

        Programs ``[0, n_shrink)`` are shrink items ``(row tile, column block, K split)``:
        each adds its fp32 partial into ``h`` (atomics when ``SPLIT_K > 1``), then counts
        itself done in ``count[tile]`` (release). Programs ``[n_shrink, n_shrink + n_expand)``
        are expand items ``(row tile, run of BLOCKS_PER_ITEM column blocks)``: one whose rows
        get a delta waits until every shrink item of its tile is counted (acquire), then
        expands; the last expand item of a tile (``count[MAX_TILES + tile]``) sets the
        tile's rows of ``h`` and both counters back to 0. So ``h`` and ``count`` must be zero
        on entry and are zero on exit: a persistent workspace, never memset.

        No deadlock: a 1-D grid's programs start in order, so every shrink program has
        started (and runs to its end without waiting) before any expand program waits; the
        interpreter runs programs in order too.

        x ``[N, K]``; A ``[num_slots, S*R, K]``; h ``[S, N, R]`` fp32 (zero); y ``[N, out]``
        (``OVERWRITE``: every row stored, 0 for rows without a delta; else rows with one
        updated in place); B ``[num_slots, out, R]``; count ``[2 * MAX_TILES]`` int32
        (zero).
        """
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M, OVERWRITE)
        per_tile: tl.constexpr = ((SR + SHRINK_N - 1) // SHRINK_N) * SPLIT_K
        runs: tl.constexpr = (N_COL_BLOCKS + BLOCKS_PER_ITEM - 1) // BLOCKS_PER_ITEM
        pid = tl.program_id(0)
        if pid < n_shrink:
            tile = pid // per_tile
            pid_n = (pid % per_tile) // SPLIT_K
            pid_k = pid % SPLIT_K
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            if (row0 < hi) & (slot > 0):
                rank = _slot_rank(ranks_ptr, slot, R, HAS_RANKS)
                if _live_block(pid_n, rank, R, SR, SHRINK_N, COMPACT):
                    _shrink_tile(x_ptr, a_ptr, h_ptr, slot, rank, row0, hi, pid_n, pid_k, K,
                                 k_per_split,
                                 stride_xm, stride_xk, stride_as, stride_aj, stride_ak,
                                 stride_hs, stride_hm, stride_hr,
                                 R, SR, BLOCK_M, SHRINK_N, BLOCK_K, SPLIT_K, USE_DOT, CAST_F32,
                                 S_PRECISION, COMPACT)
                tl.debug_barrier()  # every thread's partial is out before the count
                tl.atomic_add(count_ptr + tile, 1, sem="release")
        elif pid < n_shrink + n_expand:
            item = pid - n_shrink
            tile = item // runs
            first = (item % runs) * BLOCKS_PER_ITEM
            slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
            if row0 < hi:
                rank = _slot_rank(ranks_ptr, slot, R, HAS_RANKS)
                if slot > 0:  # spin on plain (volatile) loads: atomics would queue at L2
                    done = tl.load(count_ptr + tile, volatile=True)  # behind the counts
                    while done < per_tile:
                        done = tl.load(count_ptr + tile, volatile=True)
                    tl.atomic_add(count_ptr + tile, 0, sem="acquire")  # h's loads after it
                    tl.debug_barrier()
                stop = tl.minimum(first + BLOCKS_PER_ITEM, N_COL_BLOCKS)
                for pid_n in tl.range(first, stop, num_stages=NUM_STAGES):
                    _expand_tile(y_ptr, h_ptr, b_ptr, slot, rank, row0, hi, pid_n,
                                 stride_ym, stride_yn, stride_hs, stride_hm, stride_hr,
                                 stride_bs, stride_bn, stride_br,
                                 R, NUM_SLICES, SLICE_BLOCK0, SLICE_COL0, SLICE_WIDTH,
                                 BLOCK_M, BLOCK_N, BLOCK_R, USE_DOT, E_PRECISION, OVERWRITE,
                                 RANK_CHUNK)
                if slot > 0:
                    tl.debug_barrier()  # every thread has read h
                    last = tl.atomic_add(count_ptr + MAX_TILES + tile, 1, sem="acq_rel")
                    if last == runs - 1:  # the tile's last expand item: leave zeros behind
                        offs_m = row0 + tl.arange(0, BLOCK_M)
                        offs_r = tl.arange(0, BLOCK_R)
                        zero_mask = (offs_m < hi)[:, None] & (offs_r < R)[None, :]
                        zeros = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                        z_ptrs = (h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm
                                  + offs_r[None, :] * stride_hr)
                        for s in tl.static_range(NUM_SLICES):
                            tl.store(z_ptrs + s * stride_hs, zeros, mask=zero_mask)
                        tl.atomic_xchg(count_ptr + tile, 0)
                        tl.atomic_xchg(count_ptr + MAX_TILES + tile, 0)

    # HALF is specialised on (its divisibility by 16 lets the up half's loads vectorise)
    @triton.jit(do_not_specialize=["N", "G", "num_slots", "n_tiles"])
    def _expand_silu_mul_kernel(
        y_ptr, h_ptr, b_ptr, out_ptr, lora_ids_ptr, offsets_ptr, end_ptr, ranks_ptr,
        N, HALF, G, num_slots, n_tiles,
        stride_ym, stride_yn, stride_hs, stride_hm, stride_hr,
        stride_bs, stride_bn, stride_br, stride_om, stride_on,
        R: tl.constexpr, G_POW2: tl.constexpr, N_COL_BLOCKS: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr, USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_RANKS: tl.constexpr, RANK_CHUNK: tl.constexpr,
    ):
        """Semantics: with ``g = cast(y[t, c] + d_0)``, ``u = cast(y[t, HALF + c] + d_1)``
        (``d_s = h[s, t] . B[slot(t), s*HALF + c]``, 0 for rows that get no delta; ``cast``
        rounds to ``y``'s dtype, as :func:`_expand_kernel` storing into ``y`` would),
        ``out[t, c] = cast(g * sigmoid(g) * u)`` for every row ``t < N`` and ``c < HALF``.

        y ``[N, 2*HALF]``; h ``[2, N, R]`` fp32; B ``[num_slots, 2*HALF, R]``; out
        ``[N, HALF]``. Row tiles cover the groups and the rows from ``end`` to ``N`` (base
        rows, padding), so every row of ``out`` is written; rows of slot 0 or an unknown slot
        read neither ``h`` nor ``B`` (masked loads), so their delta is exactly 0. Program
        ``(tile, j)`` (``program_id(0)`` over ``n_tiles``, ``program_id(1)``) loads its rows'
        ``h`` once and walks column blocks ``j * BLOCKS_PER_PROGRAM ...`` in a pipelined loop.
        With ``RANK_CHUNK`` a block instead loops over chunks of ``RANK_CHUNK`` rank columns
        up to its slot's rank, loading ``h``'s chunk with ``B``'s (not pipelined: decode).
        """
        tile = tl.program_id(0)
        gs, slot_v, lo_v, hi_v, first_v, last_v = _group_table(
            lora_ids_ptr, offsets_ptr, end_ptr, N, G, num_slots, G_POW2, BLOCK_M, True)
        slot, row0, hi = _tile_rows(tile, gs, slot_v, lo_v, hi_v, first_v, last_v, BLOCK_M)
        if row0 < hi:
            offs_m = row0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < hi
            rows = offs_m.to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            # rows without a delta read neither h nor B; nor does any row past its slot's rank
            rank = _slot_rank(ranks_ptr, slot, R, HAS_RANKS)
            mask_r = (offs_r < rank) & ((offs_r * 0 + slot) > 0)
            if RANK_CHUNK == 0:  # h loaded once for every column block
                mask_h = mask_m[:, None] & mask_r[None, :]
                h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_r[None, :] * stride_hr
                hg = tl.load(h_ptrs, mask=mask_h, other=0.0)
                hu = tl.load(h_ptrs + stride_hs, mask=mask_h, other=0.0)
            b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[None, :] * stride_br
            y_rows = y_ptr + rows[:, None] * stride_ym
            out_rows = out_ptr + rows[:, None] * stride_om
            first = tl.program_id(1) * BLOCKS_PER_PROGRAM
            stop = tl.minimum(first + BLOCKS_PER_PROGRAM, N_COL_BLOCKS)
            r_stop = tl.where(slot > 0, rank, 0)
            for blk in tl.range(first, stop, num_stages=NUM_STAGES):
                cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
                mask_c = cols < HALF
                mask = mask_m[:, None] & mask_c[None, :]
                y_ptrs = y_rows + cols[None, :] * stride_yn
                if RANK_CHUNK == 0:
                    g = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                    u = tl.load(y_ptrs + HALF * stride_yn, mask=mask, other=0.0).to(tl.float32)
                    mask_b = mask_c[:, None] & mask_r[None, :]
                    b_ptrs = b_base + cols[:, None] * stride_bn
                    bg = tl.load(b_ptrs, mask=mask_b, other=0.0).to(tl.float32)
                    bu = tl.load(b_ptrs + HALF * stride_bn, mask=mask_b, other=0.0).to(tl.float32)
                    if USE_DOT:
                        dg = tl.dot(hg, tl.trans(bg), input_precision=DOT_PRECISION)
                        du = tl.dot(hu, tl.trans(bu), input_precision=DOT_PRECISION)
                    else:
                        dg = tl.sum(hg[:, None, :] * bg[None, :, :], axis=2)
                        du = tl.sum(hu[:, None, :] * bu[None, :, :], axis=2)
                else:
                    tl.static_assert(not USE_DOT, "rank chunks are for broadcast tiles")
                    dg = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    du = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for r0 in range(0, r_stop, RANK_CHUNK):
                        offs_q = r0 + tl.arange(0, RANK_CHUNK)
                        mask_q = offs_q < rank
                        mask_hq = mask_m[:, None] & mask_q[None, :]
                        mask_bq = mask_c[:, None] & mask_q[None, :]
                        hq_ptrs = h_ptr + rows[:, None] * stride_hm + offs_q[None, :] * stride_hr
                        hgq = tl.load(hq_ptrs, mask=mask_hq, other=0.0)
                        huq = tl.load(hq_ptrs + stride_hs, mask=mask_hq, other=0.0)
                        bq_ptrs = (b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn
                                   + offs_q[None, :] * stride_br)
                        bg = tl.load(bq_ptrs, mask=mask_bq, other=0.0).to(tl.float32)
                        bu = tl.load(bq_ptrs + HALF * stride_bn, mask=mask_bq,
                                     other=0.0).to(tl.float32)
                        dg += tl.sum(hgq[:, None, :] * bg[None, :, :], axis=2)
                        du += tl.sum(huq[:, None, :] * bu[None, :, :], axis=2)
                    # y's tiles loaded after the rank loop: not live across it
                    g = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                    u = tl.load(y_ptrs + HALF * stride_yn, mask=mask, other=0.0).to(tl.float32)
                g = (g + dg).to(y_ptr.dtype.element_ty).to(tl.float32)
                u = (u + du).to(y_ptr.dtype.element_ty).to(tl.float32)
                act = g * tl.sigmoid(g) * u
                tl.store(out_rows + cols[None, :] * stride_on, act.to(out_ptr.dtype.element_ty),
                         mask=mask)
# fmt: on
