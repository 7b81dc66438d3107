"""The argument checks the paged-attention op's torch reference and its Triton kernel share
(:func:`check_args`), in a file of their own so that neither imports the other."""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
) -> None:
    """Checks what can be checked from shapes, dtypes and devices alone (no host sync).

    Raises:
        ValueError: naming the first argument that does not fit.
    """
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be [N, Hq, D] float32/bfloat16/float16, got {q.dtype} {q.shape}")
    n, hq, d = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != d or c.dtype != q.dtype:
            raise ValueError(
                f"{name} must be [num_pages, page_size, Hkv, {d}] {q.dtype}, "
                f"got {c.dtype} {tuple(c.shape)}"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [S, P] int32, got {block_tables.dtype}")
    s = block_tables.shape[0]
    if seq_lens.shape != (s,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [{s}] int32, got {seq_lens.dtype} {seq_lens.shape}")
    if query_start.shape != (s + 1,) or query_start.dtype != torch.int32:
        raise ValueError(
            f"query_start must be [{s + 1}] int32, got {query_start.dtype} {query_start.shape}"
        )
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must share one device, got {sorted(map(str, devices))}")
