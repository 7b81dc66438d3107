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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lora_graph.targets import LoraTarget

if TYPE_CHECKING:
    from lora_graph.layout import AdapterImage, SlotLayout


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


def vocab_rows(vocab: int, tp: TPRank) -> tuple[int, int, int]:
    """A vocabulary-parallel embedding's share: ``(start, stop, rows)``, the token ids
    ``[start, stop)`` rank ``tp`` looks up, held in ``rows = ceil(vocab / size)`` rows
    (ranges of that many ids in rank order); the rows past ``stop - start`` are zeros that
    no token reaches (a vocabulary the size does not divide; vLLM's
    ``VocabParallelEmbedding`` pads too): every rank's table, and every rank's slot layout,
    the same shape."""
    rows = -(-vocab // tp.size)
    start = min(tp.rank * rows, vocab)
    return start, min(start + rows, vocab), rows


def pad_rows(t: Tensor, rows: int, dim: int = 0) -> Tensor:
    """``t`` with zeros appended along ``dim`` up to ``rows`` (``t`` itself if it has them)."""
    short = rows - t.shape[dim]
    if short <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


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
    """For a ``row`` target, the input columns ``tp`` holds; for an embedding, the token
    ids (:func:`vocab_rows`: its table then padded to the same rows on every rank)."""
    if target.kind == "embedding":
        return vocab_rows(target.in_features, tp)[:2]
    return unit_rows(target.in_features, None, tp, "the input")


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
        start, stop, rows = vocab_rows(target.in_features, tp)
        return pad_rows(weight[start:stop], rows)
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
    if target.kind == "embedding":
        start, stop, held = vocab_rows(target.in_features, tp)
        return [pad_rows(a_s[:, start:stop], held, dim=1) for a_s in a], list(b)
    if target.parallel == "row":
        start, stop = input_columns(target, tp)
        return [a_s[:, start:stop] for a_s in a], list(b)
    if target.parallel == "column":
        rows = column_rows(target, tp)
        return list(a), [b_s[start:stop] for b_s, (start, stop) in zip(b, rows, strict=True)]
    return list(a), list(b)


def local_target(target: LoraTarget, tp: TPRank) -> LoraTarget:
    """The target as rank ``tp`` holds it: a column target's slices at the rows it holds
    (a replicated slice's units: 1), a row target's (or an embedding's) input at its
    columns; a ``none`` target whole.

    Raises:
        ValueError: for units that do not split (:func:`unit_rows`).
    """
    if tp.size == 1:
        return target
    if target.kind == "embedding":
        return replace(target, in_features=vocab_rows(target.in_features, tp)[2])
    if target.parallel == "row":
        start, stop = input_columns(target, tp)
        return replace(target, in_features=stop - start)
    if target.parallel == "column":
        rows = column_rows(target, tp)
        units = target.slice_units
        if units is not None:
            units = tuple(max(1, u // tp.size) for u in units)
        return replace(target, out_slices=tuple(b - a for a, b in rows), slice_units=units)
    return target


def shard_image(image: AdapterImage, layout: SlotLayout, tp: TPRank) -> AdapterImage:
    """Rank ``tp``'s share of an adapter image (:class:`~lora_graph.layout.AdapterImage`,
    made for the whole targets) as an image of ``layout``, the slot layout of the targets
    as that rank holds them (:func:`local_target`): every block through :func:`shard_lora`.
    The result is a new CPU image (same blocks, rank and dtype)."""
    from lora_graph.layout import AdapterImage

    out = AdapterImage(layout, list(image.offsets), image.rank, image.data.dtype)
    for name, layer in image.offsets:
        t = image.targets[name]
        a, b = image.a(name, layer), image.b(name, layer)
        if t.kind == "embedding":  # (stored transposed: [vocab, rank])
            a_parts, b_parts = shard_lora(t, [a.T], [b], tp)
            out.a(name, layer).copy_(a_parts[0].T)
        else:
            rows = [t.slice_rows(s) for s in range(t.num_slices)]
            a_parts, b_parts = shard_lora(t, list(a), [b[o : o + w] for o, w in rows], tp)
            out.a(name, layer).copy_(torch.stack(a_parts))
        out.b(name, layer).copy_(torch.cat(b_parts))
    return out


def checkpoint_share(
    target: LoraTarget, slices: tuple[int, ...], param: str, shape: tuple[int, ...], tp: TPRank
) -> list[tuple[slice, ...]] | None:
    """Which part of a checkpoint tensor of a base module rank ``tp`` reads: the index of
    each piece it holds (concatenated along dim 0), or None for a row-parallel bias on a
    rank other than 0 (zeros: the bias is added once, before the all-reduce sums the
    partial outputs). An embedding's rows are its token ids alone; the reader pads them
    (:func:`vocab_rows`, :func:`pad_rows`).

    Args:
        target: the module's target (its whole shapes).
        slices: the target's slices the module holds, in its rows' order (one, or a
            packed module's several: :meth:`LoraTarget.module_slices`).
        param: ``"weight"`` or ``"bias"``.
        shape: the tensor's shape.

    Raises:
        ValueError: for units that do not split.
    """
    everything = tuple(slice(None) for _ in shape)
    if target.kind == "embedding":
        start, stop = input_columns(target, tp)
        return [(slice(start, stop), *everything[1:])]
    if target.parallel == "row":
        if param != "weight":
            return [everything] if tp.rank == 0 else None
        start, stop = input_columns(target, tp)
        return [(slice(None), slice(start, stop))]
    if target.parallel == "column":
        rows = column_rows(target, tp)
        pieces, offset = [], 0
        for s in slices:
            start, stop = rows[s]
            pieces.append((slice(offset + start, offset + stop), *everything[1:]))
            offset += target.out_slices[s]
        return pieces
    return [everything]


__all__ = [
    "TPRank",
    "checkpoint_share",
    "column_rows",
    "input_columns",
    "local_target",
    "pad_rows",
    "shard_image",
    "shard_lora",
    "shard_weight",
    "unit_rows",
    "vocab_rows",
]
