"""The adapter pool: registry, host tier, device slots, routing, and the model wrapper.

Adapters ride into the step as inputs: the routing triple, then one stacked adapter per
slot (views of one persistent pool). Loading, evicting or replacing an adapter rewrites a
slot in place; nothing is recompiled and no weight is re-bound.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from lora_graph import ops
from lora_graph.checkpoint import AdapterReader, AdapterSource, ModuleMap, resolve_adapter
from lora_graph.config import AdapterError, AdapterInfo, LoRAConfig
from lora_graph.layers import BoundInputs, LoRAEmbedding, LoRALinear
from lora_graph.layout import SlotLayout
from lora_graph.targets import LoraModuleRef, LoraTarget

WeightsAdapter = Callable[[dict[str, Tensor]], dict[str, Tensor]]
_ROUTING_INPUTS = 5  # lora_ids, grouped_offsets, end, segment_offsets, segment_end


class HasAdapter(Protocol):
    adapter: str | None


class LoRAStatus(enum.Enum):
    """The outcome of a load or unload."""

    LOADED = "loaded"
    RELOADED = "reloaded"  # a known name with new weights
    UNCHANGED = "unchanged"  # a known name with the same weights
    UNLOADED = "unloaded"


class NoFreeSlotError(RuntimeError):
    """Every slot holds a pinned adapter or one of the running batch."""


@dataclass(eq=False)
class AdapterRef:
    """A request's hold on the version of an adapter it was admitted under
    (:meth:`LoRAManager.acquire`). ``key`` is what its batch rows route by: the adapter's
    name while that version is current, ``name@<digest prefix>`` once a reload replaced it
    (the manager updates it in place); the version stays served until its last hold is
    released."""

    name: str
    digest: str
    key: str


class InputSpec(NamedTuple):
    """One compile input: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LoadedAdapter:
    """A registered adapter: its identity (``name``, ``digest``), rank, and host image
    (None once it has left the host tier; it is read from ``source`` again when needed)."""

    name: str
    source: AdapterSource
    digest: str
    rank: int
    pinned: bool
    image: Tensor | None


class LoRAManager:
    """Loads adapters, keeps them in device slots (LRU), and routes a batch through them.

    Args:
        config: pool sizes and served adapters.
        targets: the model's LoRA targets by name (narrowed by ``config.targets``).
        module_map: places a checkpoint module name on a target slice.
        module_path: ``(target, layer) -> attribute path`` of the base linear in the model.
        num_layers: layers of the model.
        dtype: slot dtype (``config.dtype`` wins when set).
        device: where slots and routing live.

    Slot 0 is the zero adapter; slots ``1..max_slots`` hold adapters. A slot that changes
    owner is overwritten whole from the adapter's normalised image, so targets the new
    adapter lacks and ranks above its rank are zero.
    """

    def __init__(self, config: LoRAConfig, *, targets: dict[str, LoraTarget], module_map: ModuleMap,
                 module_path: Callable[[str, int], str], num_layers: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if config.targets is not None:
            unknown = set(config.targets) - set(targets)
            if unknown:
                raise ValueError(f"unknown LoRA targets {sorted(unknown)} (the model has {sorted(targets)})")
            targets = {k: v for k, v in targets.items() if k in config.targets}
        self.config = config
        self.targets = targets
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.dtype = config.dtype or dtype
        self.layout = SlotLayout(targets, num_layers, config.max_rank)
        self.reader = AdapterReader(targets, module_map, num_layers)
        self._module_path = module_path
        num_slots = config.num_slots
        self.pool = torch.zeros(num_slots, self.layout.numel, dtype=self.dtype, device=self.device)
        self._slot_views = tuple(self.pool[s] for s in range(num_slots))
        self._active: OrderedDict[str, int] = OrderedDict()  # adapter -> its slot, LRU order, oldest first
        self._adapters: dict[str, LoadedAdapter] = {}
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self._running: frozenset[str] = frozenset()
        self._unloading: set[str] = set()  # unloaded or replaced while requests still hold them
        self._holds: dict[str, list[AdapterRef]] = {}  # routing key -> requests in flight on it
        self.kernels = ops.kernels(config.backend, self.device)
        self._bound = BoundInputs()
        self._bound_slots: tuple[Tensor, ...] = ()  # the slot stacks the layers hold views of
        self._layer_at: dict[tuple[str, int], LoRALinear | LoRAEmbedding] = {}  # filled by wrap()
        pin = self.device.type == "cuda"
        # the five routing tensors are views of one device buffer, refilled by one copy a step:
        # lora_ids [g] | grouped_offsets [g + 1] | end [1] | segment_offsets [g + 1] | segment_end [1],
        # each from a 16-byte boundary
        g = config.max_slots
        sizes = (g, g + 1, 1, g + 1, 1)
        starts = [sum(-(-n // 4) * 4 for n in sizes[:i]) for i in range(len(sizes))]
        self._routing_slices = [slice(start, start + n) for start, n in zip(starts, sizes, strict=True)]
        total = self._routing_slices[-1].stop
        self._routing = torch.zeros(total, dtype=torch.int32, device=self.device)
        self._lora_ids, self._offsets, self._end, self._segment_offsets, self._segment_end = (
            self._routing[sl] for sl in self._routing_slices)
        self._staging = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        # the last non-blocking copy out of the staging buffer: it must land before a refill
        self._staged = torch.cuda.Event() if pin else None
        self.slot_loads = 0  # weight copies into slots; a steady-state step makes none

    # ---- registry -------------------------------------------------------------------
    @property
    def loras(self) -> list[str]:
        """The loaded adapter names (those being unloaded excluded)."""
        return [n for n in self._adapters if n not in self._unloading]

    def is_lora(self, name: str) -> bool:
        """Whether ``name`` is a loaded adapter (one being unloaded is not)."""
        return name in self._adapters and name not in self._unloading

    def is_active_lora(self, name: str) -> bool:
        """Whether ``name`` holds a device slot."""
        return name in self._active

    @property
    def slot_owners(self) -> list[str | None]:
        """The adapter (routing key) each slot holds, slot 0 (the zero adapter) included: None."""
        owners: list[str | None] = [None] * self.config.num_slots
        for name, slot in self._active.items():
            owners[slot] = name
        return owners

    def adapter(self, name: str) -> LoadedAdapter:
        """The registry entry of a loaded adapter.

        Raises:
            KeyError: if ``name`` is not loaded.
        """
        try:
            return self._adapters[name]
        except KeyError:
            raise KeyError(f"adapter {name!r} is not loaded") from None

    def adapter_info(self, path: str) -> AdapterInfo:
        """Rank, unmapped modules and misfits of the adapter at ``path``, from its header."""
        src = resolve_adapter(path)
        return self.reader.info(path, src)

    def check_adapter(self, path: str, *, name: str | None = None) -> AdapterInfo:
        """Validate the adapter at ``path`` from its ``adapter_config.json`` and safetensors
        header alone (no tensor data is read; a ``.bin`` checkpoint has no header and is
        read whole), as :meth:`load_adapter` would before loading it. Its saved base
        weights, if any, are compared with the model's only at load.

        Returns:
            its :class:`AdapterInfo`.

        Raises:
            AdapterError: naming the module and the cause: ``use_dora``, a ``bias`` other
                than ``"none"``, ``modules_to_save``, no LoRA tensors, a rank above
                ``max_rank``, a module outside the served targets, or a shape that does not
                fit its target.
        """
        label = name or path
        src = resolve_adapter(path)
        self.reader.check_config(label, src.config)
        info = self.reader.info(label, src)
        self.reader.check(label, info, max_rank=self.config.max_rank)
        return info

    def load_adapter(self, path: str, *, name: str | None = None, pin: bool = False) -> LoRAStatus:
        """Load one adapter into the host tier (``"name=path"``, or ``path`` as its name).

        A known name with the same weights is left as it is (``UNCHANGED``); with other
        weights it is replaced (``RELOADED``) and the load does not wait: requests admitted
        after it get the new weights, and requests in flight (those holding the old version
        through :meth:`acquire`) finish on the old ones, which keep their slot under the
        routing key ``name@<digest prefix>`` until the last hold is released.

        Raises:
            AdapterError: if the adapter cannot be served (the message names the cause), or
                its digest differs from ``config.adapter_digests[name]``.
            NoFreeSlotError: if ``pin`` and no slot can be given to it.
        """
        if name is None:
            name, _, rest = path.partition("=")
            if rest and not os.path.exists(path):  # an existing path may contain "=" itself
                path = rest
            else:
                name = path
        if not name:
            raise AdapterError(f"{path}: an adapter needs a non-empty name")
        src = resolve_adapter(path)
        digest = src.digest()
        expected = self.config.adapter_digests.get(name)
        if expected is not None and expected != digest:
            raise AdapterError(f"adapter {name!r}: weights digest {digest[:12]}… does not match the expected {expected[:12]}…")
        old = self._adapters.get(name)
        if old is not None and old.digest == digest:
            if pin and not old.pinned:
                self._check_pin(name)
                old.pinned = True
                self.activate_adapter(name)
            self._unloading.discard(name)
            return LoRAStatus.UNCHANGED
        image, rank, saved_base = self.reader.load(name, src, self.layout, max_rank=self.config.max_rank, dtype=self.dtype)
        self._check_saved_base(name, saved_base)
        if pin:
            self._check_pin(name)
        if old is not None:
            if self._holds.get(name):
                self._retire(name)
            else:
                self._active.pop(name, None)
        self._unloading.discard(name)
        self._adapters[name] = LoadedAdapter(name, src, digest, rank, pin, self._to_host(image))
        self._touch_host(name)
        if pin:
            self.activate_adapter(name)
        return LoRAStatus.RELOADED if old is not None else LoRAStatus.LOADED

    def _check_saved_base(self, name: str, saved_base: dict[LoraModuleRef, Tensor]) -> None:
        """Refuse an adapter whose file carries base weights (PEFT saves the targeted
        embedding's and LM head's) that differ from the served model's beyond the rounding
        of the two dtypes: it was trained with its own embedding (new or trained tokens),
        and serving only its LoRA pairs would be a silent wrong answer."""
        if not self._layer_at:
            return
        for ref, saved in saved_base.items():
            layer = self._layer_at.get((ref.target, ref.layer))
            if layer is None:
                continue
            served = layer.base.weight
            coarse = [torch.finfo(d) for d in (saved.dtype, served.dtype)]
            rtol = 2 * max(f.eps for f in coarse)
            atol = max(f.tiny for f in coarse)  # below it half precision rounds to subnormals
            rows = 4096  # compared in row blocks: a vocabulary-sized float32 copy at once is gigabytes
            if not all(torch.allclose(saved[i : i + rows].to(served.device, torch.float32), served[i : i + rows].float(),
                                      rtol=rtol, atol=atol) for i in range(0, saved.shape[0], rows)):
                raise AdapterError(f"adapter {name!r}: its saved base weight of {ref.target} differs from the served model's "
                                   "(trained with its own embedding or LM head?); only LoRA pairs can be served")

    def _check_pin(self, name: str) -> None:
        """Refuse a pin that would leave too few slots: at most ``max_slots - 1`` pinned, and
        the adapters requests in flight hold must still fit beside the pinned ones (a decode
        step names them all at once).

        Raises:
            NoFreeSlotError: naming the limit.
        """
        pinned = {a.name for a in self._adapters.values() if a.pinned and a.name != name}
        if len(pinned) >= self.config.max_slots - 1:
            raise NoFreeSlotError(f"adapter {name!r}: at most max_slots - 1 = {self.config.max_slots - 1} adapters can be pinned")
        held = {key for key, holds in self._holds.items() if holds}
        needed = held | pinned | {name}
        if len(needed) > self.config.max_slots:
            raise NoFreeSlotError(f"adapter {name!r}: pinning it would leave too few of the {self.config.max_slots} slots "
                                  f"for the {len(held)} adapters that requests in flight use")

    def _retire(self, name: str) -> None:
        """Move the current version of ``name`` to its own routing key ``name@<digest>``, for
        the requests that hold it; it is freed when they are done. It keeps its slot, and a
        host image (copied back from the slot if it had left the host tier: its file may be
        rewritten). The same weights retired before and still held share that entry."""
        entry = self._adapters.pop(name)
        alias = f"{name}@{entry.digest[:12]}"
        slot = self._active.pop(name, None)
        self._host_lru.pop(name, None)
        if entry.image is None and slot is not None:
            entry.image = self._to_host(self._slot_views[slot].to("cpu", copy=True))
        existing = self._adapters.get(alias)
        if existing is None:
            entry.name, entry.pinned = alias, False
            self._adapters[alias] = existing = entry
        elif existing.image is None:
            existing.image = entry.image
        if slot is not None and alias not in self._active:  # (else a duplicate of the same weights: its slot is freed)
            self._active[alias] = slot
        if existing.image is not None:
            self._host_lru[alias] = None  # kept while held: _touch_host spares unloading versions
        holds = self._holds.pop(name)
        for ref in holds:
            ref.key = alias
        self._holds.setdefault(alias, []).extend(holds)
        self._unloading.add(alias)

    def acquire(self, name: str) -> AdapterRef:
        """Hold the current version of ``name`` for a request admitted under it: an unload
        or a reload leaves that version served until :meth:`release`.

        Raises:
            KeyError: if ``name`` is not loaded (or is being unloaded).
        """
        if not self.is_lora(name):
            raise KeyError(f"adapter {name!r} is not loaded")
        ref = AdapterRef(name, self._adapters[name].digest, name)
        self._holds.setdefault(name, []).append(ref)
        return ref

    def release(self, ref: AdapterRef) -> None:
        """Drop a request's hold (it finished or was aborted); a version that was unloaded or
        replaced is freed with its last hold. Releasing twice is harmless."""
        holds = self._holds.get(ref.key, [])
        if ref in holds:
            holds.remove(ref)
            if not holds:
                del self._holds[ref.key]
        self._purge_unloaded(between_steps=True)

    def unload_adapter(self, name: str) -> LoRAStatus:
        """Stop serving ``name``: new requests naming it are refused at once; requests that
        hold it (:meth:`acquire`) finish on it, and its slot and host image are freed when
        the last is released and no running batch names it.

        Raises:
            KeyError: if ``name`` is not loaded.
        """
        if not self.is_lora(name):
            raise KeyError(f"adapter {name!r} is not loaded")
        self._unloading.add(name)
        self._purge_unloaded()
        return LoRAStatus.UNLOADED

    def _purge_unloaded(self, *, between_steps: bool = False) -> None:
        """Free unloaded or replaced versions that no request holds and, unless called
        between steps, that the batch being activated does not name."""
        running = frozenset() if between_steps else self._running
        for name in [n for n in self._unloading if n not in running and not self._holds.get(n)]:
            self._unloading.discard(name)
            self._active.pop(name, None)
            del self._adapters[name]
            self._host_lru.pop(name, None)

    def _to_host(self, image: Tensor) -> Tensor:
        return image.pin_memory() if self.device.type == "cuda" else image

    def _touch_host(self, name: str) -> None:
        """Mark ``name`` most recently used in the host tier and drop the least recently
        used images beyond ``cpu_capacity``. Versions being unloaded or replaced keep their
        image while requests still hold them: their files may be gone or rewritten, and
        those requests must finish on them."""
        self._host_lru[name] = None
        self._host_lru.move_to_end(name)
        while len(self._host_lru) > self.config.cpu_capacity:
            victim = next((k for k in self._host_lru if k != name and k not in self._unloading), None)
            if victim is None:
                break
            self._host_lru.pop(victim)
            self._adapters[victim].image = None

    def _host_image(self, entry: LoadedAdapter) -> Tensor:
        """The adapter's host image, read back from its file if it left the host tier.

        Raises:
            AdapterError: with ``adapter`` set, if the file is gone, unreadable, or changed
                since the adapter was loaded.
        """
        if entry.image is None:
            try:
                if entry.source.digest() != entry.digest:
                    raise AdapterError(f"adapter {entry.name!r}: its file changed on disk since it was loaded; load it again")
                image, _, _ = self.reader.load(entry.name, entry.source, self.layout, max_rank=self.config.max_rank,
                                            dtype=self.dtype)
            except (OSError, AdapterError) as e:
                message = str(e) if isinstance(e, AdapterError) else (
                    f"adapter {entry.name!r}: cannot read it back from {entry.source.weights_path} ({e})")
                raise AdapterError(message, adapter=entry.name) from e
            entry.image = self._to_host(image)
        self._touch_host(entry.name)
        return entry.image

    # ---- slots ----------------------------------------------------------------------
    def activate_adapter(self, name: str) -> int:
        """Give ``name`` a device slot (LRU) and return it; copies its weights in only if
        the slot does not already hold them. Never evicts a pinned adapter or one of the
        running batch.

        Raises:
            KeyError: if ``name`` is not loaded.
            NoFreeSlotError: if every slot is pinned or in use by the running batch.
            AdapterError: with ``adapter=name``, if its weights left the host tier and cannot
                be read back (the file is gone or changed).
        """
        entry = self.adapter(name)
        slot = self._active.get(name)
        if slot is not None:
            self._active.move_to_end(name)
            return slot
        slot = self._free_slot()
        image = self._host_image(entry)
        self._slot_views[slot].copy_(image, non_blocking=True)
        self.slot_loads += 1
        self._active[name] = slot
        return slot

    def _free_slot(self) -> int:
        """A free slot, else the least recently used one whose adapter is neither pinned nor
        in the running batch, preferring adapters no request in flight holds."""
        taken = set(self._active.values())
        free = next((slot for slot in range(1, self.config.num_slots) if slot not in taken), None)
        if free is not None:
            return free
        evictable = [(v, s) for v, s in self._active.items() if v not in self._running and not self._adapters[v].pinned]
        if evictable:
            victim, slot = next(((v, s) for v, s in evictable if not self._holds.get(v)), evictable[0])
            del self._active[victim]
            return slot
        raise NoFreeSlotError(f"all {self.config.max_slots} slots hold pinned adapters or adapters of the running batch")

    def can_activate(self, names: set[str]) -> bool:
        """Whether every adapter in ``names`` can hold a slot at once (the scheduler asks
        this before admitting a request)."""
        pinned_other = sum(1 for a in self._adapters.values() if a.pinned and a.name not in names)
        return len(names) <= self.config.max_slots - pinned_other

    def activate_batch(self, batch: Sequence[HasAdapter]) -> None:
        """Make every adapter of ``batch`` active, protecting them from each other's eviction.

        Raises:
            ValueError: if the batch names more distinct adapters than there are slots.
            KeyError, NoFreeSlotError: as :meth:`activate_adapter`.
        """
        names = {r.adapter for r in batch if r.adapter is not None}
        if len(names) > self.config.max_slots:
            raise ValueError(f"a batch names {len(names)} distinct adapters but there are {self.config.max_slots} slots")
        self._running = frozenset(names)
        self._purge_unloaded()
        for name in names:
            self.activate_adapter(name)

    def active_adapters_by_slot(self, batch: Sequence[HasAdapter]) -> dict[int, LoadedAdapter]:
        """Slot -> adapter for the batch's active adapters (base rows and inactive skipped)."""
        out = {}
        for r in batch:
            if r.adapter is not None and r.adapter in self._active:
                out[self._active[r.adapter]] = self._adapters[r.adapter]
        return out

    # ---- routing --------------------------------------------------------------------
    @staticmethod
    def sort_lora_batch(batch: Sequence[Any]) -> list[Any]:
        """Order a batch so same-adapter requests are adjacent (in order of first
        appearance) and base requests last; stable within an adapter."""
        first: dict[str | None, int] = {}
        for i, r in enumerate(batch):
            first.setdefault(r.adapter, i)
        return sorted(batch, key=lambda r: (r.adapter is None, first[r.adapter]))

    def get_lora_graph_inputs(self, batch: Sequence[HasAdapter], input_row_offsets: Sequence[int],
                              device: torch.device | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The routing triple ``(lora_ids, grouped_offsets, end)`` of a sorted batch.

        Args:
            batch: requests in step order, sorted by :meth:`sort_lora_batch`; their adapters
                active.
            input_row_offsets: ``len(batch) + 1`` token offsets of the rows in the step.
            device: must be the manager's device if given.

        Returns:
            the persistent device buffers ``lora_ids [max_slots]``,
            ``grouped_offsets [max_slots + 1]`` and ``end [1]`` (int32), refilled in place;
            unused groups are empty and point at slot 0.

        Raises:
            ValueError: if an adapter row follows a base row, or the batch has more groups
                than slots (it was not sorted), or an adapter is not active.
        """
        if device is not None and torch.device(device) != self.device:
            raise ValueError(f"routing lives on {self.device}, not {device}")
        if len(input_row_offsets) != len(batch) + 1:
            raise ValueError(f"input_row_offsets needs {len(batch) + 1} entries, got {len(input_row_offsets)}")
        max_groups = self.config.max_slots
        ids: list[int] = []
        offsets: list[int] = [int(input_row_offsets[0])]
        end = offsets[0]
        segments: list[int] = [0]  # the same groups, counted in requests
        prev: str | None = None
        seen_base = False
        for i, r in enumerate(batch):
            if r.adapter is None:
                seen_base = True
                continue
            if seen_base:
                raise ValueError("the batch is not sorted: an adapter row follows a base row (use sort_lora_batch)")
            slot = self._active.get(r.adapter)
            if slot is None:
                raise ValueError(f"adapter {r.adapter!r} is not active (activate_batch first)")
            if r.adapter != prev:
                if len(ids) == max_groups:
                    raise ValueError(f"the batch has more than {max_groups} adapter groups (use sort_lora_batch)")
                ids.append(slot)
                offsets.append(end)
                segments.append(i)
                prev = r.adapter
            end = int(input_row_offsets[i + 1])
            offsets[-1] = end
            segments[-1] = i + 1
        staging = self._staging
        if self._staged is not None:
            self._staged.synchronize()
        # unused groups: slot 0, empty at the end (in tokens and in requests)
        g = max_groups
        seg_end = segments[-1]
        parts = (ids + [0] * (g - len(ids)), offsets + [end] * (g + 1 - len(offsets)), [end],
                 segments + [seg_end] * (g + 1 - len(segments)), [seg_end])
        values = [0] * staging.numel()
        for sl, part in zip(self._routing_slices, parts, strict=True):
            values[sl] = part
        staging.copy_(torch.tensor(values, dtype=torch.int32))
        self._routing.copy_(staging, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        return self._lora_ids, self._offsets, self._end

    def input_buffers(self, batch: Sequence[HasAdapter], input_row_offsets: Sequence[int],
                      device: torch.device | None = None) -> tuple[Tensor, ...]:
        """The per-call LoRA inputs in :meth:`symbolic_inputs` order: the routing triple, the
        segment pair (the groups' offsets and end counted in requests rather than tokens,
        for a per-segment target such as the LM head; request ``i`` is ``batch[i]``), then
        one stacked adapter per slot. Every tensor is a persistent buffer; only the routing
        is refilled."""
        routing = self.get_lora_graph_inputs(batch, input_row_offsets, device)
        return (*routing, self._segment_offsets, self._segment_end, *self._slot_views)

    def symbolic_inputs(self) -> list[InputSpec]:
        """The LoRA compile inputs: the routing triple, the segment pair, then one
        ``[numel]`` stack per slot."""
        g = self.config.max_slots
        specs = [InputSpec("lora_ids", (g,), torch.int32), InputSpec("grouped_offsets", (g + 1,), torch.int32),
                 InputSpec("end", (1,), torch.int32), InputSpec("segment_offsets", (g + 1,), torch.int32),
                 InputSpec("segment_end", (1,), torch.int32)]
        specs += [InputSpec(f"slot_{s}", (self.layout.numel,), self.dtype) for s in range(self.config.num_slots)]
        return specs

    def bind_inputs(self, model: nn.Module, lora_inputs: Sequence[Tensor]) -> None:
        """Fan the LoRA inputs into every LoRA layer of ``model`` (a module :meth:`wrap`
        returned): the routing triple to every layer, and each slot's stack to the layers as
        views of their blocks (re-derived only when other slot tensors are given than
        last time). An empty ``lora_inputs`` binds no routing: a base-only step.

        Raises:
            ValueError: if the count is neither 0 nor the routing triple plus one per slot.
        """
        expected = _ROUTING_INPUTS + self.config.num_slots
        if len(lora_inputs) == 0:
            self._bound.clear()
            return
        if len(lora_inputs) != expected:
            raise ValueError(f"expected {expected} LoRA inputs (routing triple + segment pair + {self.config.num_slots} slots), "
                             f"got {len(lora_inputs)}")
        slots = tuple(lora_inputs[_ROUTING_INPUTS:])
        if len(slots) != len(self._bound_slots) or any(a is not b for a, b in zip(slots, self._bound_slots, strict=True)):
            for layer in self._layer_at.values():
                layer.bind_slots(slots)
            self._bound_slots = slots
        self._bound.routing = (lora_inputs[0], lora_inputs[1], lora_inputs[2])
        self._bound.segments = (lora_inputs[0], lora_inputs[3], lora_inputs[4])

    # ---- model ----------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> LoRAWrapper:
        """Replace each target linear of ``model`` with a :class:`LoRALinear`, in place, and
        return a wrapper that takes the LoRA inputs and holds ``model`` at ``.model``."""
        for target_name, target in self.targets.items():
            for layer in target.layer_ids(self.num_layers):
                path = self._module_path(target_name, layer)
                parent_path, _, attr = path.rpartition(".")
                parent = model.get_submodule(parent_path) if parent_path else model
                base = getattr(parent, attr)
                lora: LoRALinear | LoRAEmbedding
                if target.kind == "embedding":
                    if not isinstance(base, nn.Embedding):
                        raise TypeError(f"{path} is a {type(base).__name__}, not an nn.Embedding")
                    lora = LoRAEmbedding(base, target_name=target_name, target=target, layer=layer, layout=self.layout,
                                         bound=self._bound, expand=self.kernels.expand)
                else:
                    if not isinstance(base, nn.Linear):
                        raise TypeError(f"{path} is a {type(base).__name__}, not an nn.Linear")
                    lora = LoRALinear(base, target_name=target_name, target=target, layer=layer, layout=self.layout,
                                      bound=self._bound, kernels=self.kernels)
                lora.bind_slots(self._slot_views)
                setattr(parent, attr, lora)
                self._layer_at[(target_name, layer)] = lora
        self._bound_slots = self._slot_views
        return LoRAWrapper(model, self)

    def lora_weight_adapter(self, base_adapter: WeightsAdapter, *, wrapper_prefix: str = "model") -> WeightsAdapter:
        """Wrap a checkpoint key adapter so its output loads into the wrapped model: the
        base linear of each LoRA layer sits at ``<path>.base``, and everything under
        ``wrapper_prefix``."""
        wrapped = {self._module_path(target, layer) + "." for target, layer in self._layer_at}

        def adapter(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
            out = {}
            for key, value in base_adapter(state_dict).items():
                module, _, leaf = key.rpartition(".")
                if module + "." in wrapped:
                    key = f"{module}.base.{leaf}"
                out[f"{wrapper_prefix}.{key}" if wrapper_prefix else key] = value
            return out

        return adapter


class LoRAWrapper(nn.Module):
    """The top-level module of a LoRA-ready model: binds the LoRA inputs, then runs the
    inner model (at ``.model``), whose forward stays LoRA-oblivious."""

    def __init__(self, model: nn.Module, manager: LoRAManager) -> None:
        super().__init__()
        self.model = model
        self.manager = manager

    def forward(self, *args: Any, lora_inputs: tuple[Tensor, ...] = ()) -> Any:
        self.manager.bind_inputs(self, lora_inputs)
        out = self.model(*args)
        self.manager.bind_inputs(self, ())
        return out


__all__ = ["AdapterError", "AdapterRef", "InputSpec", "LoRAManager", "LoRAStatus", "LoRAWrapper", "LoadedAdapter", "NoFreeSlotError"]
