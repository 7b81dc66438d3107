"""LoRA routing: which rows of a step go to which adapter slot.

This module is the one place that defines what the routing tensors mean and builds them.

A step's rows (tokens, in step order) are sorted so that rows of one adapter are adjacent
(:func:`sort_lora_batch`) and base rows come last. The adapter rows form *groups*: runs of
rows under one adapter, each served from the device slot that adapter holds. ``G`` is the
pool's ``max_slots``: a step has at most one group per slot; unused groups are empty, name
slot 0 (the zero adapter) and sit at the end.

:class:`Routing` holds five int32 tensors on the device:

- ``lora_ids`` ``[G]``: the slot of each group.
- ``grouped_offsets`` ``[G + 1]``: row offsets of the groups, non-decreasing; group ``g``
  covers rows ``grouped_offsets[g]:grouped_offsets[g + 1]``; ``grouped_offsets[0] == 0``.
- ``end`` ``[1]``: rows routed to LoRA (``grouped_offsets[G]``); rows at or after it are
  base rows and get no delta (their output is bit-for-bit the base layer's).
- ``segment_offsets`` ``[G + 1]``, ``segment_end`` ``[1]``: the same groups counted in
  *requests* instead of rows, for a per-segment target (the LM head, which sees one row
  per request at decode and at a prefill's last position).

A LoRA layer reads ``(lora_ids, grouped_offsets, end)`` (:attr:`Routing.tokens`) or, for a
per-segment target given one row per request, ``(lora_ids, segment_offsets, segment_end)``
(:attr:`Routing.segments`). The kernels' rule for a row ``t < end`` is
``g(t) = min(#{k >= 1 : grouped_offsets[k] <= t}, G - 1)`` (a ``searchsorted``), which for
offsets built here is exactly the group whose range holds ``t``.

:class:`RoutingBuffer` owns the persistent device buffer the five tensors are views of (a
captured graph reads them in place); :meth:`RoutingBuffer.route` builds a step's routing
from the sorted batch and refills the buffer with one host-to-device copy. Each step,
``PipelineModelWithKVCache.prepare`` calls it through ``LoRAManager.route``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor


class HasAdapter(Protocol):
    """A batch row: the routing key of its adapter (None: the base model)."""

    adapter: str | None


class Routing(NamedTuple):
    """One step's LoRA routing (module docstring): five int32 device tensors, views of one
    persistent buffer. Passed explicitly down the model: a decoder layer hands it to each
    of its LoRA layers; ``None`` in its place means a base-only step."""

    lora_ids: Tensor  # [G] slot of each group
    grouped_offsets: Tensor  # [G + 1] row offsets of the groups
    end: Tensor  # [1] rows routed to LoRA
    segment_offsets: Tensor  # [G + 1] request offsets of the groups
    segment_end: Tensor  # [1] requests routed to LoRA

    @property
    def tokens(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(lora_ids, grouped_offsets, end)``: the groups over the step's rows."""
        return self.lora_ids, self.grouped_offsets, self.end

    @property
    def segments(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(lora_ids, segment_offsets, segment_end)``: the groups over the step's requests."""
        return self.lora_ids, self.segment_offsets, self.segment_end


def sort_lora_batch(batch: Sequence[Any]) -> list[Any]:
    """Order a batch so same-adapter rows are adjacent (in order of first appearance) and
    base rows last; stable within an adapter."""
    first: dict[str | None, int] = {}
    for i, r in enumerate(batch):
        first.setdefault(r.adapter, i)
    return sorted(batch, key=lambda r: (r.adapter is None, first[r.adapter]))


def group_batch(
    batch: Sequence[HasAdapter],
    row_offsets: Sequence[int],
    slot_of: Callable[[str], int | None],
    max_groups: int,
) -> tuple[list[int], list[int], list[int]]:
    """The groups of a sorted batch: ``(slots, row offsets, request offsets)`` with
    ``len(slots)`` groups and ``len(slots) + 1`` offsets each (before padding to ``G``).

    Args:
        batch: requests in step order, sorted by :func:`sort_lora_batch`.
        row_offsets: ``len(batch) + 1`` row offsets of the requests in the step.
        slot_of: the slot an adapter holds (None if it holds none).
        max_groups: ``G``.

    Raises:
        ValueError: if an adapter row follows a base row or the batch has more than ``G``
            groups (it was not sorted), or an adapter holds no slot.
    """
    if len(row_offsets) != len(batch) + 1:
        raise ValueError(f"row offsets need {len(batch) + 1} entries, got {len(row_offsets)}")
    slots: list[int] = []
    offsets = [int(row_offsets[0])]
    segments = [0]
    prev: str | None = None
    seen_base = False
    for i, r in enumerate(batch):
        if r.adapter is None:
            seen_base = True
            continue
        if seen_base:
            raise ValueError(
                "the batch is not sorted: an adapter row follows a base row (use sort_lora_batch)"
            )
        if r.adapter != prev:
            slot = slot_of(r.adapter)
            if slot is None:
                raise ValueError(f"adapter {r.adapter!r} is not active (activate_batch first)")
            if len(slots) == max_groups:
                raise ValueError(
                    f"the batch has more than {max_groups} adapter groups (use sort_lora_batch)"
                )
            slots.append(slot)
            offsets.append(offsets[-1])
            segments.append(segments[-1])
            prev = r.adapter
        offsets[-1] = int(row_offsets[i + 1])
        segments[-1] = i + 1
    return slots, offsets, segments


class RoutingBuffer:
    """The persistent device buffer a step's :class:`Routing` lives in, and its pinned
    staging twin: :meth:`fill` writes a batch's groups into the staging buffer and copies
    it to the device in one non-blocking copy; the :class:`Routing` it returns is always
    the same five views, so a captured graph sees each step's routing in place.

    Args:
        max_groups: ``G`` (the pool's ``max_slots``).
        device: where the routing lives.
    """

    def __init__(self, max_groups: int, device: torch.device) -> None:
        self.max_groups = max_groups
        g = max_groups
        sizes = (g, g + 1, 1, g + 1, 1)
        # each view starts on a 16-byte boundary
        starts = [sum(-(-n // 4) * 4 for n in sizes[:i]) for i in range(len(sizes))]
        self._slices = [slice(start, start + n) for start, n in zip(starts, sizes, strict=True)]
        pin = device.type == "cuda"
        self._device = torch.zeros(self._slices[-1].stop, dtype=torch.int32, device=device)
        self._staging = torch.zeros(self._slices[-1].stop, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None  # the last copy out of staging
        self.routing = Routing(*(self._device[sl] for sl in self._slices))

    @property
    def buffer(self) -> Tensor:
        """The flat int32 device buffer the five tensors are views of."""
        return self._device

    def route(self, batch: Sequence[HasAdapter], row_offsets: Sequence[int],
              slot_of: Callable[[str], int | None]) -> Routing:  # fmt: skip
        """The one way a step's routing is built: the groups of a sorted batch
        (:func:`group_batch`), written in place (:meth:`fill`).

        Raises:
            ValueError: as :func:`group_batch`.
        """
        return self.fill(*group_batch(batch, row_offsets, slot_of, self.max_groups))

    def fill(self, slots: list[int], offsets: list[int], segments: list[int]) -> Routing:
        """Write groups (as :func:`group_batch` returns them) padded to ``G`` with empty
        slot-0 groups at the end, and return :attr:`routing`."""
        g = self.max_groups
        end, seg_end = offsets[-1], segments[-1]
        parts = (
            slots + [0] * (g - len(slots)),
            offsets + [end] * (g + 1 - len(offsets)),
            [end],
            segments + [seg_end] * (g + 1 - len(segments)),
            [seg_end],
        )
        values = [0] * self._staging.numel()
        for sl, part in zip(self._slices, parts, strict=True):
            values[sl] = part
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy must have left the staging buffer
        self._staging.copy_(torch.tensor(values, dtype=torch.int32))
        self._device.copy_(self._staging, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        return self.routing


def row_slots(n_rows: int, lora_ids: Tensor, grouped_offsets: Tensor, end: Tensor) -> Tensor:
    """``[n_rows]`` int64: the slot of each row, ``-1`` for rows at or after ``end`` (the
    kernels' group rule, module docstring)."""
    rows = torch.arange(n_rows, device=lora_ids.device, dtype=grouped_offsets.dtype)
    group = torch.searchsorted(grouped_offsets[1:].contiguous(), rows, right=True).clamp_(
        max=lora_ids.numel() - 1
    )
    return torch.where(rows < end, lora_ids.long()[group], -1)
