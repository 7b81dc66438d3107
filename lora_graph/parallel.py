"""Tensor parallelism's sharding rules: which part of a base weight and of an adapter's A
and B each rank holds, from the target's declared ``parallel`` mode
(:class:`~lora_graph.targets.LoraTarget`). Pure functions over tensors: the runner and the
adapter loader call them, the tests check them against slices cut by hand.

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"), as vLLM and SGLang apply it, with LoRA
following its base layer (S-LoRA, Sheng et al. 2023, section 5; vLLM's
``ColumnParallelLinearWithLoRA`` / ``RowParallelLinearWithLoRA``):

- ``column`` (q/k/v, gate/up, the LM head): each rank computes some output rows. Every
  slice of a fused projection is split by its own units (heads; rows for a slice without
  units), so rank ``r`` holds the ``r``-th part of q, of k and of v. A slice with fewer
  units than ranks (GQA's K/V heads) is *replicated*: ranks ``r`` with ``r * units //
  size == u`` share unit ``u``. LoRA: A replicated (the shrink is the same on every rank),
  B's rows split as the base's.
- ``row`` (o, down): each rank holds a slice of the input columns and computes a partial
  sum, all-reduced once. LoRA: A split along the input as the base, B replicated; the
  delta ``x_r @ A_r^T @ B^T`` is a partial sum too, added before that all-reduce (no
  collective of its own).
- an ``embedding`` target is vocabulary-parallel: rank ``r`` holds the rows of its vocabulary
  range (tokens outside it give zeros, summed by an all-reduce). LoRA: A ``[r, vocab]``
  split along the vocabulary the same way, B replicated.
- ``none``: whole on every rank.

Shapes follow PEFT's: A ``[rank, in_features]``, B ``[out_features, rank]``, one pair per
slice of a fused target; a base linear weight is ``[out_features, in_features]``, an
embedding's ``[vocab, dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lora_graph.targets import LoraTarget


@dataclass(frozen=True)
class TPRank:
    """One rank of a tensor-parallel group of ``size`` ranks.

    Raises:
        ValueError: for a size below 1 or a rank outside ``[0, size)``.
    """

    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is invalid")


def unit_rows(width: int, units: int | None, tp: TPRank, what: str = "a slice") -> tuple[int, int]:
    """``(start, stop)`` of the rows of a slice ``width`` rows wide, made of ``units`` equal
    units (None: every row is one), that ``tp`` holds: ``units / size`` units each when
    ``units >= size``, one unit shared by ``size / units`` ranks when fewer.

    Raises:
        ValueError: naming ``what``, when the units do not divide among the ranks (or the
            ranks among the units), or ``width`` is not a whole number of units.
    """
    units = width if units is None else units
    if units < 1 or width % units:
        raise ValueError(f"{what}: {width} rows are not {units} equal units")
    unit = width // units
    if units >= tp.size:
        if units % tp.size:
            raise ValueError(
                f"{what}: {units} units (heads or rows) do not split among {tp.size} ranks"
            )
        per = units // tp.size
        return tp.rank * per * unit, (tp.rank + 1) * per * unit
    if tp.size % units:
        raise ValueError(f"{what}: {tp.size} ranks do not split among its {units} units (heads)")
    u = tp.rank * units // tp.size  # replicated: a group of size / units ranks per unit
    return u * unit, (u + 1) * unit


def column_rows(target: LoraTarget, tp: TPRank) -> list[tuple[int, int]]:
    """For a ``column`` target, the rows of each slice ``tp`` holds, as ``(start, stop)`` in
    the slice's own rows (one pair a slice, in order)."""
    units = target.slice_units or (None,) * target.num_slices
    names = target.slice_names or tuple(range(target.num_slices))
    return [
        unit_rows(width, u, tp, f"slice {name!r}")
        for width, u, name in zip(target.out_slices, units, names, strict=True)
    ]


def input_columns(target: LoraTarget, tp: TPRank) -> tuple[int, int]:
    """For a ``row`` target (or an embedding's vocabulary), the input columns ``tp`` holds."""
    what = "the vocabulary" if target.kind == "embedding" else "the input"
    return unit_rows(target.in_features, None, tp, what)


def shard_weight(target: LoraTarget, weight: Tensor, tp: TPRank) -> Tensor:
    """The part of a base weight ``tp`` holds: a linear's ``[out, in]`` (its fused slices in
    order) or an embedding's ``[vocab, dim]``.

    Raises:
        ValueError: for a weight not of the target's shape, or units that do not split.
    """
    if target.kind == "embedding":
        want = (target.in_features, target.out_features)
    else:
        want = (target.out_features, target.in_features)
    if tuple(weight.shape) != want:
        raise ValueError(f"weight {tuple(weight.shape)} is not the target's {want}")
    if target.kind == "embedding":
        start, stop = input_columns(target, tp)
        return weight[start:stop]
    if target.parallel == "row":
        start, stop = input_columns(target, tp)
        return weight[:, start:stop]
    if target.parallel == "column":
        parts = []
        for s, (start, stop) in enumerate(column_rows(target, tp)):
            offset = target.slice_rows(s)[0]
            parts.append(weight[offset + start : offset + stop])
        return torch.cat(parts)
    return weight


def shard_lora(
    target: LoraTarget, a: list[Tensor], b: list[Tensor], tp: TPRank
) -> tuple[list[Tensor], list[Tensor]]:
    """The part of one adapter's A and B ``tp`` holds, slice by slice: ``a[s]``
    ``[rank, in_features]`` and ``b[s]`` ``[out_slice, rank]`` (an embedding's A is PEFT's
    ``lora_embedding_A`` ``[rank, vocab]``, its B ``[dim, rank]``). Column: A whole, B's rows
    as the base's; row and embedding: A's columns as the base's input, B whole; none: both
    whole.

    Raises:
        ValueError: for a count of slices or a shape that is not the target's.
    """
    if len(a) != target.num_slices or len(b) != target.num_slices:
        raise ValueError(f"{target.num_slices} slices of A and B expected, got {len(a)}, {len(b)}")
    for s, (a_s, b_s) in enumerate(zip(a, b, strict=True)):
        if a_s.shape[1] != target.in_features or b_s.shape[0] != target.out_slices[s]:
            raise ValueError(
                f"slice {s}: A {tuple(a_s.shape)} and B {tuple(b_s.shape)} do not fit "
                f"{target.in_features} in, {target.out_slices[s]} out"
            )
    if target.kind == "embedding" or target.parallel == "row":
        start, stop = input_columns(target, tp)
        return [a_s[:, start:stop] for a_s in a], list(b)
    if target.parallel == "column":
        rows = column_rows(target, tp)
        return list(a), [b_s[start:stop] for b_s, (start, stop) in zip(b, rows, strict=True)]
    return list(a), list(b)


__all__ = ["TPRank", "column_rows", "input_columns", "shard_lora", "shard_weight", "unit_rows"]
