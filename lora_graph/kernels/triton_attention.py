"""The Triton implementation of :func:`lora_graph.attention.paged_attention`: one "unified"
kernel for prefill chunks and decode tokens of a packed step over vLLM's paged KV cache
(PagedAttention, Kwon et al. 2023), in the manner of vLLM's Triton
``kernel_unified_attention_2d``, with an optional split of the keys (flash-decoding,
Dao et al. 2023) for decode steps of few sequences.

Semantics (those of the op; :mod:`lora_graph.attention`): query row ``i`` of sequence
``s`` (``q_len`` rows from ``query_start[s]``, context ``L = seq_lens[s]``) sits at position
``p = L - q_len + i`` and attends keys ``j < L`` with ``j <= p`` and, if ``window > 0``,
``p - j < window``; ``out = softmax(scale * q k^T) v`` in float32, stored in ``q``'s dtype;
rows at or after ``query_start[S]`` stay 0.

Design (no host synchronisation; the grid depends only on shapes, so a CUDA graph can
capture the launch and replay it with new metadata):

- Query tiles. Sequence ``s``'s rows are cut into tiles of ``BLOCK_Q`` tokens counted from
  its own first row. Tile numbers of ``s`` start at ``query_start[s] // BLOCK_Q + s``; this
  is increasing in ``s`` and leaves room for ``cdiv(q_len, BLOCK_Q)`` tiles, so a program
  finds its sequence by binary search over these starts, and ``N // BLOCK_Q + S`` tiles
  cover any metadata of ``N`` rows and ``S`` sequences. Spare tiles return at once.
- A program owns one query tile and one kv head: ``BLOCK_Q`` tokens x the ``GROUPS``
  query heads that read that kv head (grouped-query attention), ``BLOCK_Q * GROUPS`` rows
  padded to ``BLOCK_M`` (a power of two, at least 16 for ``tl.dot``); row ``r`` is token
  ``r // GROUPS``, head ``kv_head * GROUPS + r % GROUPS``. Each K/V tile it loads serves
  every query head of the group.
- Keys in blocks of ``BLOCK_N`` positions, which may span several pages: each key's page
  comes from the block table (a gather), so any page size works. The loop runs over
  ``[lo, hi)``: ``hi`` the tile's last position + 1 (causal), ``lo`` the first key of the
  window of its first row (blocks wholly before the window are never loaded).
- Online softmax in float32 with ``exp2`` (``log2(e)`` folded into the scale); masks for
  causality, the window, ``L`` and padding rows. A row that has no key yet (only padding
  rows in the end) keeps max ``-inf``: the update uses 0 in its place, so nothing is NaN.
- Head dim ``D`` padded to ``D_PAD`` (a power of two >= 16) with masked loads and stores.
- Split-KV (``SPLITS > 1``, decode steps of few sequences): program ``(tile, head, k)``
  reduces the ``k``-th of ``SPLITS`` equal runs of the tile's key blocks and writes its
  partial max, sum and unnormalised output in float32; ``_reduce_splits_kernel`` combines
  them (``out = sum_k 2^(m_k - M) acc_k / sum_k 2^(m_k - M) l_k``).

Kernels decorated while ``TRITON_INTERPRET=1`` is set run under Triton's CPU interpreter
(:func:`interpreted`); the launcher then sets it around each launch too. Importable
without Triton (``HAVE_TRITON`` is then False and nothing is defined).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from lora_graph.kernels.attention_args import check_args
from lora_graph.kernels.triton_config import cdiv, device_sms, next_pow2

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
    def _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr,
                  SEQS_PAD: tl.constexpr):
        """The last sequence ``s`` whose first tile ``query_start[s] // BLOCK_Q + s`` is at
        or before ``tile`` (the starts are non-decreasing in ``s``). With ``SEQS_PAD`` (a
        power of two >= ``num_seqs``) every start is loaded at once and those at or before
        ``tile`` counted: one load instead of a binary search's ``log2(num_seqs)`` dependent
        loads (``SEQS_PAD`` 0: the binary search)."""
        if SEQS_PAD > 0:
            idx = tl.arange(0, SEQS_PAD)
            ok = idx < num_seqs
            first = tl.load(query_start_ptr + idx, mask=ok, other=0) // BLOCK_Q + idx
            found = tl.sum(((first <= tile) & ok).to(tl.int32), axis=0) - 1
        else:
            lo = 0
            hi = num_seqs
            while lo < hi:
                mid = (lo + hi) // 2
                start = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
                if start <= tile:
                    lo = mid + 1
                else:
                    hi = mid
            found = lo - 1
        return found

    @triton.jit(do_not_specialize=["num_seqs", "n_rows", "window", "q_len_min", "q_len_max"])
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        num_seqs, n_rows, qk_scale, softcap_log2, window, q_len_min, q_len_max,
        stride_qn, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd, stride_on, stride_oh, stride_od, stride_bt,
        NUM_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, GROUPS: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, CAST_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SEQS_PAD: tl.constexpr,
    ):
        """Semantics: ``out[t, h] = softmax_j(q[t, h] . k[j, h // GROUPS] * scale) v[j, ...]``
        over the keys row ``t`` may see, for the query tile ``program_id(0)``, the kv head
        ``program_id(1)`` and (``SPLITS > 1``) the key split ``program_id(2)``.

        ``qk_scale`` is ``scale * log2(e)``; with ``HAS_SOFTCAP`` the logits are capped at
        ``softcap_log2 = softcap * log2(e)`` (``c * tanh(x / c)``, in the log2 domain the
        same cap). Only sequences of ``q_len_min <= q_len <=
        q_len_max`` query rows are served (a mixed step runs one launch for its decode rows
        and one for its prefill chunks, each with its own tiles). With ``SPLITS > 1`` the
        partials go to ``part`` (float32 ``[SPLITS, n_rows, NUM_HEADS, D + 2]``: output, then
        max and sum), else the normalised output to ``out``. A split that gets no key
        writes only its max (``-inf``), and the reduction reads nothing else of it; a tile
        whose keys fit one block (a short context) is served by split 0 alone, which writes
        the normalised output itself and ``-inf`` as its max, so the reduction skips the row.
        """
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        s = _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q, SEQS_PAD)
        q_start = tl.load(query_start_ptr + s)
        q_len = tl.load(query_start_ptr + s + 1) - q_start
        q_tile0 = (tile - (q_start // BLOCK_Q + s)) * BLOCK_Q  # first token of the tile
        if (q_tile0 >= q_len) | (q_len < q_len_min) | (q_len > q_len_max):
            return
        seq_len = tl.load(seq_lens_ptr + s)

        offs_m = tl.arange(0, BLOCK_M)
        tok = q_tile0 + offs_m // GROUPS
        head = kv_head * GROUPS + offs_m % GROUPS
        row_ok = (offs_m < BLOCK_Q * GROUPS) & (tok < q_len)
        pos = seq_len - q_len + tok  # absolute position of each row
        rows = (q_start + tok).to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D

        # keys [lo, hi): up to the tile's last position; from the window of its first row.
        # Keys in [full_lo, first_pos] are visible to every row of the tile: blocks wholly
        # inside need no mask.
        first_pos = seq_len - q_len + q_tile0
        hi = seq_len - q_len + tl.minimum(q_tile0 + BLOCK_Q, q_len)
        lo = 0
        full_lo = 0
        if window > 0:
            lo = tl.maximum(first_pos - window + 1, 0)
            full_lo = hi - window  # the last row's window starts here
        lo = (lo // BLOCK_N) * BLOCK_N
        direct = True  # this program writes the normalised output itself
        part = part_ptr + ((tl.program_id(2) * n_rows + rows) * NUM_HEADS + head) * (D + 2)
        if SPLITS > 1:
            blocks = tl.cdiv(hi - lo, BLOCK_N)
            per_split = tl.cdiv(blocks, SPLITS) * BLOCK_N
            direct = blocks <= 1  # one block of keys: split 0 has them all
            lo = lo + tl.program_id(2) * per_split
            hi = tl.minimum(hi, lo + per_split)
            if (lo >= hi) | direct:
                # no partials: the reduction skips a split whose max is -inf, and a row
                # whose every max is -inf (its keys fit one block: written here)
                tl.store(part + D, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            if lo >= hi:
                return

        q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh
                    + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if CAST_F32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        table = block_tables_ptr + s.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % PAGE_SIZE
            k = tl.load(k_base + page[None, :] * stride_kp + slot[None, :] * stride_ks
                        + offs_d[:, None] * stride_kd,
                        mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # [D_PAD, BLOCK_N]
            v = tl.load(v_base + page[:, None] * stride_vp + slot[:, None] * stride_vs
                        + offs_d[None, :] * stride_vd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            if CAST_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            if HAS_SOFTCAP:  # c * tanh(x / c); tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|)
                e = tl.exp(-2.0 * tl.abs(qk) / softcap_log2)  # in (0, 1]: no overflow
                qk = tl.where(qk < 0, -softcap_log2, softcap_log2) * (1.0 - e) / (1.0 + e)
            if (start < full_lo) | (start + BLOCK_N > first_pos + 1):
                ok = (row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
                      & ((window <= 0) | (pos[:, None] - offs_n[None, :] < window)))
                qk = tl.where(ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = tl.math.exp2(qk - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        mask = row_ok[:, None] & d_ok[None, :]
        if direct:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh
                     + offs_d[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part[:, None] + offs_d[None, :], acc, mask=mask)
            tl.store(part + D, m_i, mask=row_ok)
            tl.store(part + D + 1, l_i, mask=row_ok)

    @triton.jit(do_not_specialize=["num_seqs", "n_rows"])
    def _reduce_splits_kernel(
        part_ptr, out_ptr, query_start_ptr, num_seqs, n_rows, stride_on, stride_oh, stride_od,
        NUM_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        """Semantics: ``out[t, h] = sum_k 2^(m_k - M) acc_k / sum_k 2^(m_k - M) l_k`` over the
        splits ``k`` of row ``t = program_id(0)``, head ``h = program_id(1)``, ``M = max m_k``;
        rows at or after ``query_start[num_seqs]`` are written 0 (so ``out`` needs no memset
        before a split launch); a row whose every ``m_k`` is ``-inf`` was written by the
        attention kernel (its keys fit one block) and is left alone."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        if row >= tl.load(query_start_ptr + num_seqs):
            tl.store(out_ptr + row.to(tl.int64) * stride_on + head * stride_oh
                     + offs_d * stride_od, tl.zeros([D_PAD], dtype=out_ptr.dtype.element_ty),
                     mask=d_ok)
            return
        ks = tl.arange(0, SPLITS_PAD)
        k_ok = ks < SPLITS
        part = part_ptr + ((ks.to(tl.int64) * n_rows + row) * NUM_HEADS + head) * (D + 2)
        m = tl.load(part + D, mask=k_ok, other=float("-inf"))
        m_max = tl.max(m, axis=0)
        if m_max == float("-inf"):  # keys in one block: the attention kernel wrote the row
            return
        live = m > float("-inf")  # splits that saw a key (the others wrote their max only)
        l_k = tl.load(part + D + 1, mask=live, other=0.0)
        acc = tl.load(part[:, None] + offs_d[None, :], mask=live[:, None] & d_ok[None, :],
                      other=0.0)
        w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_k * w, axis=0)
        tl.store(out_ptr + row.to(tl.int64) * stride_on + head * stride_oh + offs_d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=d_ok)
# fmt: on

_INTERPRETED = HAVE_TRITON and not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
_LOG2E = 1.0 / math.log(2.0)
# a program finds its sequence with one vector load of the step's query starts up to this
# many sequences, by binary search past it (:func:`_find_seq`)
SEQS_VECTOR_MAX = 256


def seqs_pad(s: int) -> int:
    """``_find_seq``'s ``SEQS_PAD`` for a step of ``s`` sequences (0: binary search)."""
    return max(16, next_pow2(s)) if s <= SEQS_VECTOR_MAX else 0


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` was
    set when this module was first imported)."""
    return _INTERPRETED


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the paged attention kernel: ``block_q`` query tokens x ``GROUPS`` heads per
    program (``block_m`` rows, a power of two >= 16, >= ``block_q * GROUPS``), keys in
    blocks of ``block_n``, and ``splits`` key splits (1: no split-KV)."""

    block_q: int
    block_m: int
    block_n: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


def make_config(
    groups: int,
    *,
    block_q: int,
    block_n: int,
    splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
) -> AttentionConfig:
    """An :class:`AttentionConfig` of ``block_q`` tokens per tile (``block_m`` derived)."""
    return AttentionConfig(
        block_q, max(16, next_pow2(block_q * groups)), block_n, splits, num_warps, num_stages
    )


@functools.lru_cache(maxsize=1024)
def attention_config(
    n: int,
    s: int,
    groups: int,
    head_dim: int,
    max_ctx: int,
    kv_heads: int,
    elt_bytes: int = 2,
    num_sms: int = 132,
) -> AttentionConfig:
    """Heuristic tiles from shapes only (so a captured graph never sees them change):
    ``n`` query rows, ``s`` sequences, ``groups`` query heads per kv head, ``max_ctx`` the
    block table's reach (``P * page_size``).

    Decode-like steps (``n <= 2 * s``): 16-row tiles (``block_q = 16 // groups`` tokens),
    keys in blocks of 64, and split-KV towards ``8 * num_sms`` programs (``s * kv_heads``
    without splits), at most 32 splits and at least 128 keys of the block table's reach per
    split, with 128-key blocks when split. Otherwise (prefill chunks): 64-row tiles, keys in
    blocks of 32. (Measured on an H200 at Llama-3-8B shapes, bf16: bench/attention.py
    --sweep; blocks halve where a row of K is over 256 bytes, for shared memory.)
    """
    d_pad = max(16, next_pow2(head_dim))
    wide = d_pad * elt_bytes <= 256
    if n <= 2 * s:
        splits = max(1, min(cdiv(8 * num_sms, max(1, s * kv_heads)), cdiv(max_ctx, 128), 32))
        block_n = (128 if splits > 1 else 64) if wide else 32
        return make_config(groups, block_q=max(1, 16 // groups), block_n=block_n, splits=splits)
    return make_config(groups, block_q=max(1, 64 // groups), block_n=32 if wide else 16)


@functools.lru_cache(maxsize=1024)
def attention_plan(
    n: int,
    s: int,
    groups: int,
    head_dim: int,
    max_ctx: int,
    kv_heads: int,
    elt_bytes: int = 2,
    num_sms: int = 132,
) -> tuple[tuple[AttentionConfig, int, int], ...]:
    """The launches of one step, ``(config, q_len_min, q_len_max)`` each (arguments as
    :func:`attention_config`; shapes only). A decode-like step is one launch. A step that
    may mix prefill chunks with decode rows (``n > 2 * s``) is two: sequences of at most
    ``16 // groups`` query rows (decodes) with decode tiles (16 rows, keys in blocks of 64,
    no split), the longer ones with prefill tiles. One launch with prefill tiles for both
    left a decode row alone in a 64-row tile streaming its keys 32 at a time: in a
    512-token step of 64 decodes at context ~600 beside prefill chunks (Llama-3-8B shapes,
    H200), attention took 87 µs a layer where its KV bytes need ~20 µs."""
    cfg = attention_config(n, s, groups, head_dim, max_ctx, kv_heads, elt_bytes, num_sms)
    unbounded = 1 << 30
    if n <= 2 * s:
        return ((cfg, 0, unbounded),)
    wide = max(16, next_pow2(head_dim)) * elt_bytes <= 256
    short = max(1, 16 // groups)
    decode = make_config(groups, block_q=short, block_n=64 if wide else 32)
    return ((decode, 0, short), (cfg, short + 1, unbounded))


@contextlib.contextmanager
def _launch_env(t: Tensor):
    """The launch's device, and for interpreted kernels ``TRITON_INTERPRET=1`` (Triton reads
    it lazily while launching too), set for the launch only."""
    with contextlib.ExitStack() as stack:
        if t.is_cuda and t.device.index is not None:
            stack.enter_context(torch.cuda.device(t.device))
        prev = os.environ.get("TRITON_INTERPRET")
        if _INTERPRETED and prev != "1":
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            yield
        finally:
            if _INTERPRETED and prev != "1":
                if prev is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = prev


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    scale: float,
    window: int,
    softcap: float = 0.0,
    config: AttentionConfig | None = None,
) -> Tensor:
    """:func:`lora_graph.attention.paged_attention`: the arguments and result of the op.
    The launches follow :func:`attention_plan` (one for a decode step, plus the split-KV
    reduction when split; two for a step that may mix decodes and prefill chunks);
    ``config`` forces one launch with those tiles. The output is allocated with
    ``torch.zeros`` (rows of no sequence stay 0), or with ``torch.empty`` for a split launch
    (its reduction writes every row, 0 past the step's); the split-KV partials with
    ``torch.empty``; nothing is read back to the host.

    Raises:
        RuntimeError: without Triton.
        ValueError: for bad shapes / dtypes (:func:`lora_graph.kernels.attention_args.check_args`).
    """
    if not HAVE_TRITON:
        raise RuntimeError("the Triton paged attention needs Triton; use the torch backend")
    check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start)
    # the kernels index these by position: a strided view is copied (no copy otherwise)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens, query_start = seq_lens.contiguous(), query_start.contiguous()
    n, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    s = block_tables.shape[0]
    groups = hq // hkv
    if n == 0 or s == 0:
        return torch.zeros_like(q)
    if config is not None:
        plan: tuple[tuple[AttentionConfig, int, int], ...] = ((config, 0, 1 << 30),)
    else:
        plan = attention_plan(
            n,
            s,
            groups,
            d,
            block_tables.shape[1] * page_size,
            hkv,
            q.element_size(),
            device_sms(q.device),
        )
    # fp32: near-fp32 products (tf32x3); the interpreter runs tl.dot through numpy, which has
    # no bfloat16, so there 16-bit tiles are upcast first; compiled kernels use bf16/fp16 MMA
    cast_f32 = q.dtype != torch.float32 and _INTERPRETED
    # a split launch's reduction writes every row (0 past the step's rows): no memset then
    split = len(plan) == 1 and plan[0][0].splits > 1
    out = torch.empty_like(q) if split else torch.zeros_like(q)
    for cfg, q_len_min, q_len_max in plan:
        assert cfg.block_m >= max(16, cfg.block_q * groups), cfg
        splits = cfg.splits
        # the reduction writes every row of the step: a split launch must be the only one
        assert splits == 1 or len(plan) == 1, plan
        part = q  # unused without splits
        if splits > 1:
            part = torch.empty((splits, n, hq, d + 2), dtype=torch.float32, device=q.device)
        grid = (n // cfg.block_q + s, hkv, splits)
        with _launch_env(q):
            # fmt: off
            _paged_attention_kernel[grid](
                q, k_cache, v_cache, out, part, block_tables, seq_lens, query_start,
                s, n, scale * _LOG2E, max(softcap, 1.0) * _LOG2E, window, q_len_min, q_len_max,
                *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
                block_tables.stride(0),
                NUM_HEADS=hq, D=d, D_PAD=max(16, next_pow2(d)), GROUPS=groups,
                PAGE_SIZE=page_size, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, SPLITS=splits, CAST_F32=cast_f32,
                DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
                HAS_SOFTCAP=softcap > 0, SEQS_PAD=seqs_pad(s),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
            if splits > 1:
                _reduce_splits_kernel[(n, hq)](
                    part, out, query_start, s, n, *out.stride(),
                    NUM_HEADS=hq, D=d, D_PAD=max(16, next_pow2(d)), SPLITS=splits,
                    SPLITS_PAD=next_pow2(splits), num_warps=4,
                )
            # fmt: on
    return out
