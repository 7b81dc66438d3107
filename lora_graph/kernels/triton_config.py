"""Launch configuration of the Triton LoRA kernels: pure functions of shapes (cached), so a
captured graph never sees them change."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_DEFAULT_SMS = 132  # H100 / H200


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def device_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


class _Tiles:
    block_m: int

    @property
    def use_dot(self) -> bool:
        """``tl.dot`` row tiles (16 rows and more); below, a broadcast multiply + sum."""
        return self.block_m >= 16


@dataclass(frozen=True)
class ShrinkConfig(_Tiles):
    """Tile sizes of the shrink kernel. ``k_per_split`` is a multiple of ``block_k``;
    ``split_k == cdiv(K, k_per_split)``."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 3
    max_programs: int = 0  # 0: one program per work item; else a grid-stride loop


@dataclass(frozen=True)
class ExpandConfig(_Tiles):
    """Tile sizes of the expand kernel (``block_r`` covers ``max_rank``). An item is a row
    tile and a run of ``blocks_per_item`` column blocks (0: the launcher's choice, one block
    under a capped grid, else runs long enough that about four items a SM cover the step)."""

    block_m: int
    block_n: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 1
    max_programs: int = 0  # 0: one program per work item; else a grid-stride loop over items
    blocks_per_item: int = 0


def _finish_shrink(
    k: int,
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
    max_programs: int = 0,
) -> ShrinkConfig:
    split_k = max(1, min(split_k, cdiv(k, block_k)))
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k
    return ShrinkConfig(
        block_m,
        block_n,
        block_k,
        cdiv(k, k_per_split),
        k_per_split,
        num_warps,
        num_stages,
        max_programs,
    )


@functools.lru_cache(maxsize=1024)
def shrink_config(
    n: int, k: int, sr: int, elt_bytes: int = 2, num_sms: int = _DEFAULT_SMS
) -> ShrinkConfig:
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
        block_m = next_pow2(n)
        block_n = min(64, max(16, next_pow2(sr)))
        block_k = max(32, min(128, 4096 // (block_m * block_n)))
        k_min, num_warps, num_stages = block_k, 4, 2
    elif n <= 64:
        block_m, block_n, block_k = 16, min(64, max(16, next_pow2(sr))), 32 if f32 else 64
        k_min, num_warps, num_stages = block_k, 4, 2
    elif n <= 256:
        block_m, block_n, block_k = 32, min(64, max(16, next_pow2(sr))), 32 if f32 else 64
        k_min, num_warps, num_stages = 4 * block_k, 4, 3
    else:
        block_m, block_n = 64, min(128, max(16, next_pow2(sr)))
        block_k = 32 if f32 or block_n > 64 else 64
        k_min, num_warps, num_stages = 4 * block_k, 8, 3
    busy = cdiv(n, block_m) * cdiv(sr, block_n)
    split_k = max(1, min(cdiv(2 * num_sms, busy), cdiv(k, k_min)))
    return _finish_shrink(
        k, block_m, block_n, block_k, split_k, num_warps, num_stages, 4 * num_sms if n <= 64 else 0
    )


@functools.lru_cache(maxsize=1024)
def expand_config(
    n: int, max_width: int, max_rank: int, elt_bytes: int = 2, num_sms: int = _DEFAULT_SMS
) -> ExpandConfig:
    """Heuristic tiles for expand of ``N = n`` rows, widest slice ``max_width``, ``y`` of
    ``elt_bytes`` bytes.

    ``N <= 4``: broadcast-reduce tiles; ``N <= 64``: 16 x 64 ``tl.dot`` tiles (many column
    programs at decode); larger ``N``: 32/64 x 128 (x 64 for fp32 ``y``).
    """
    block_r = max(16, next_pow2(max_rank))
    wide = 64 if elt_bytes >= 4 else 128
    if n <= 4:
        block_m = next_pow2(n)
        block_n = max(16, min(128, 8192 // (block_m * block_r)))
    elif n <= 64:
        block_m, block_n = 16, 64
    elif n <= 256:
        block_m, block_n = 32, wide
    else:
        block_m, block_n = 64, wide
    block_n = min(block_n, max(16, next_pow2(max_width)))
    return ExpandConfig(
        block_m,
        block_n,
        block_r,
        num_warps=8 if block_m * block_n >= 4096 else 4,
        max_programs=4 * num_sms if n <= 64 else 0,
    )


def num_tiles(n: int, g: int, block_m: int) -> int:
    """An upper bound on the row tiles of any routing of ``n`` rows in ``g`` groups: groups
    are disjoint row ranges, each tiled from its own start, so at most one partial tile per
    non-empty group beyond ``cdiv(n, block_m)``. Depends on shapes only."""
    return cdiv(n, block_m) + min(g, n)


@functools.lru_cache(maxsize=256)
def slice_meta(
    out_slices: tuple[int, ...], block_n: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """``(block starts, column starts, widths, total column blocks)`` of the slices."""
    blk, col, b, c = [], [], 0, 0
    for w in out_slices:
        blk.append(b)
        col.append(c)
        b += cdiv(w, block_n)
        c += w
    return tuple(blk), tuple(col), tuple(out_slices), b
