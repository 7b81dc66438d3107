"""Paged attention over a packed step, as the ``torch.library`` custom op
``lora_graph::paged_attention``: the pure-torch reference on every device, and on CUDA
(with Triton installed) one Triton kernel for prefill chunks and decode tokens alike
(:mod:`lora_graph.kernels.triton_attention`), so ``torch.compile`` sees one opaque node and
a CUDA graph captures the kernel's launch.

Semantics: for each sequence ``s`` with query rows ``q[query_start[s]:query_start[s + 1]]``
(``q_len`` rows, maybe 0) and context length ``L = seq_lens[s] >= q_len``, query row ``i``
sits at absolute position ``p = L - q_len + i`` and attends the keys ``j`` in ``[0, L)``
with ``j <= p`` (causal) and, when ``window > 0``, ``p - j < window`` (a sliding window of
``w`` keeps the last ``w`` positions including ``p``, as transformers' Mistral / Qwen2)::

    out[row, h] = softmax_j(cap(scale * q[row, h] . K[j, h // G])) @ V[·, h // G]

where ``cap(x) = softcap * tanh(x / softcap)`` with a ``softcap > 0`` (Gemma 2's attention
logit soft-capping) and ``cap(x) = x`` otherwise; softmax in float32, ``G = Hq // Hkv``
query heads per kv head (grouped-query attention). Rows at or after ``query_start[S]``
belong to no sequence and are exactly 0.

The KV cache layout is vLLM's paged cache (PagedAttention, Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention"):
``[num_pages, page_size, Hkv, D]`` per layer for K and for V, and a block table per
sequence, so key ``j`` of sequence ``s`` lives at
``cache[block_tables[s, j // page_size], j % page_size]``. The K and V of this step's own
tokens are already written when the op runs. Page 0 is nothing special here (callers use
it as the scratch page of padding tokens).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_graph.kernels.attention_args import check_args


@functools.cache
def _triton():  # the Triton implementation, imported on first use (None without Triton)
    from lora_graph.kernels import triton_attention

    return triton_attention if triton_attention.HAVE_TRITON else None


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    scale: float,
    window: int,
    softcap: float = 0.0,
) -> Tensor:
    """:func:`paged_attention` in plain torch: a Python loop over sequences, each gathering
    its pages into contiguous ``[L, Hkv, D]`` K and V and running float32
    ``F.scaled_dot_product_attention`` with an explicit boolean causal(+window) mask (with
    a soft cap: the scores, capped, softmax and the product written out).
    Reads the metadata on the host (one sync); also checks its values.

    Raises:
        ValueError: for bad shapes / dtypes (:func:`check_args`) or metadata values
            (``query_start`` decreasing or past ``N``, ``seq_lens[s] < q_len``, a block table
            too short for ``seq_lens[s]``).
    """
    check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start)
    n, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    starts, lens = query_start.tolist(), seq_lens.tolist()
    if starts[0] != 0 or starts[-1] > n or any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"query_start must rise from 0 to at most {n}, got {starts}")
    out = torch.zeros_like(q)
    for s, length in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        n_pages = -(-length // page_size)
        if length < q_len or n_pages > block_tables.shape[1]:
            raise ValueError(
                f"sequence {s}: seq_len {length} must be >= its {q_len} query rows and fit "
                f"its block table ({block_tables.shape[1]} pages of {page_size})"
            )
        if q_len == 0:
            continue
        pages = block_tables[s, :n_pages].long()
        k = k_cache[pages].flatten(0, 1)[:length].float()  # [L, Hkv, D]
        v = v_cache[pages].flatten(0, 1)[:length].float()
        pos = torch.arange(length - q_len, length, device=q.device)[:, None]
        key = torch.arange(length, device=q.device)[None, :]
        allowed = key <= pos  # [q_len, L]
        if window > 0:
            allowed &= pos - key < window
        qs = q[q0:q1].float().transpose(0, 1)  # [Hq, q_len, D]
        if softcap > 0:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
            scores = qs @ k.permute(1, 2, 0) * scale  # [Hq, q_len, L]
            scores = softcap * torch.tanh(scores / softcap)
            o = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.transpose(0, 1)
        else:
            o = F.scaled_dot_product_attention(
                qs,
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=allowed,
                scale=scale,
                enable_gqa=hq != hkv,
            )
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


def rotate_half(x: Tensor) -> Tensor:
    """``[-x2, x1]`` of ``x = [x1, x2]`` split in halves along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (Su et al. 2021, "RoFormer") on ``x`` ``[T, heads, head_dim]`` with ``cos`` /
    ``sin`` ``[T, 1, rotary_dim]``: the first ``rotary_dim`` dims rotate, the rest pass
    through (transformers' ``apply_rotary_pos_emb`` with a partial rotary factor)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return (x * cos + rotate_half(x) * sin).to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat(((rot * cos + rotate_half(rot) * sin).to(x.dtype), rest), dim=-1)


def rope_kv_write(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    slot_mapping: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> Tensor:
    """RoPE on a step's queries and keys, and its keys and values written into the paged
    KV cache, in torch ops that ``torch.compile`` fuses (with the q/k/v LoRA delta's add):
    :func:`apply_rope` on q and k, k and v stored with one indexed store each (in ``q``'s
    dtype op by op, as in eager transformers).

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``, in one float dtype (views of a fused
            projection are fine).
        cos, sin: ``[T, rotary_dim]`` each token's rotary tables (``rotary_dim`` even, at
            most ``D``; the first ``rotary_dim`` dims rotate as ``rotate_half``, the rest
            pass through).
        slot_mapping: ``[T]`` int64, each token's flat cache position
            (``page * page_size + offset``).
        k_cache, v_cache: ``[slots, Hkv, D]`` flat caches, written at ``slot_mapping``.

    Returns:
        the rotated ``q``, ``[T, Hq, D]`` contiguous.
    """
    cos, sin = cos[:, None], sin[:, None]
    k_cache[slot_mapping] = apply_rope(k, cos, sin)
    v_cache[slot_mapping] = v
    return apply_rope(q, cos, sin).contiguous()


@torch.library.custom_op("lora_graph::paged_attention", mutates_args=())
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
) -> Tensor:
    """Paged attention of a packed step (module docstring for the semantics).

    Args:
        q: ``[N, Hq, D]`` float32 / bfloat16 / float16, the step's queries (packed rows).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` in ``q``'s dtype, ``Hq`` a
            multiple of ``Hkv`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``).
        block_tables: ``[S, P]`` int32, each sequence's pages in order.
        seq_lens: ``[S]`` int32, each sequence's context length ``L`` (this step's tokens
            included; 0 for padding sequences).
        query_start: ``[S + 1]`` int32, non-decreasing, ``query_start[0] == 0``,
            ``query_start[S] <= N``: sequence ``s`` owns rows ``query_start[s]:[s + 1]``.
        scale: the softmax scale (usually ``D ** -0.5``).
        window: sliding window in positions (0: full causal attention).
        softcap: the attention logits' soft cap (0: none).

    Returns:
        ``[N, Hq, D]`` in ``q``'s dtype; rows from ``query_start[S]`` on are 0.
    """
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window, softcap
    )


@paged_attention.register_kernel("cuda")
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window, softcap=0.0):
    impl = _triton()
    fn = impl.paged_attention if impl is not None else paged_attention_reference
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window, softcap)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window, softcap=0.0):
    check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start)
    return torch.empty_like(q)


def paged_attention_impl(backend: str, device: torch.device) -> Callable[..., Tensor]:
    """The paged attention a ``backend`` calls, with :func:`paged_attention`'s signature:

    - ``"auto"``: the op (Triton on CUDA when installed, the reference elsewhere).
    - ``"torch"``: :func:`paged_attention_reference` on any device.
    - ``"triton"``: the Triton kernel: the op on CUDA; on the CPU under Triton's interpreter
      (``TRITON_INTERPRET=1`` set when :mod:`lora_graph.kernels.triton_attention` is first
      imported), the Triton implementation called directly.

    Raises:
        ValueError: for ``"triton"`` without Triton, or off CUDA without the interpreter;
            for an unknown backend.
    """
    if backend == "torch":
        return paged_attention_reference
    if backend == "auto":
        return paged_attention
    if backend == "triton":
        impl = _triton()
        if impl is None:
            raise ValueError("backend='triton' but Triton is not installed")
        if device.type == "cuda":
            return paged_attention
        if not impl.interpreted():
            raise ValueError(
                "backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
            )
        return impl.paged_attention
    raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
