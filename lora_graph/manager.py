"""The LoRA manager: one façade over the parts of the adapter pool.

- :class:`~lora_graph.registry.AdapterRegistry`: names, versions, holds, reload, unload.
- :class:`~lora_graph.slots.HostTier` and :class:`~lora_graph.slots.SlotPool`: where the
  normalised weights live (host memory, device slots).
- :class:`~lora_graph.routing.RoutingBuffer`: the step's routing.
- :mod:`lora_graph.wrapping`: the model's LoRA layers, holding views of the slot pool.

The parts import nothing of each other; the manager moves slots and images when the
registry renames or frees a version. Adapters ride into the step as inputs (the slot pool
the layers view, and the routing); loading, evicting or replacing one rewrites a slot in
place, so nothing is recompiled and no weight is re-bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from lora_graph import ops
from lora_graph.config import AdapterError, AdapterInfo, LoRAConfig
from lora_graph.layout import AdapterImage, SlotLayout
from lora_graph.loading.adapter_files import (
    AdapterReader,
    AdapterSource,
    ModuleMap,
    resolve_adapter,
)
from lora_graph.parallel import TPRank, local_target, shard_image, shard_weight
from lora_graph.registry import AdapterRef, AdapterRegistry, LoadedAdapter, LoRAStatus
from lora_graph.routing import HasAdapter, Routing, RoutingBuffer, sort_lora_batch
from lora_graph.slots import HostTier, NoFreeSlotError, SlotImage, SlotPool
from lora_graph.targets import LoraModuleRef, LoraTarget
from lora_graph.wrapping import LoRALayer, WeightsAdapter, lora_weight_adapter, wrap_model


@dataclass(frozen=True)
class ReadAdapter:
    """An adapter read and normalised by :meth:`LoRAManager.read_adapter`, not yet served:
    its name, source, weight digest, slot image (CPU; None when the name already serves
    these weights) and rank."""

    name: str
    src: AdapterSource
    digest: str
    image: AdapterImage | None
    rank: int


class LoRAManager:
    """Loads adapters, keeps them in device slots (LRU), and routes a batch through them.

    Args:
        config: pool sizes and served adapters.
        targets: the model's LoRA targets by name (narrowed by ``config.targets``).
        module_map: places a checkpoint module name on a target slice.
        module_path: ``(target, layer) -> attribute path`` of the base module in the model.
        num_layers: layers of the model.
        dtype: slot dtype (``config.dtype`` wins when set).
        device: where slots and routing live.
        ignored_modules: checkpoint modules whose LoRA pairs cannot change what the model
            serves: skipped when an adapter has them (every other unmapped module is
            refused).
        tied_modules: checkpoint modules the model ties to its input embedding, each to the
            embedding's module (PEFT's ``ensure_weight_tying``; see
            :func:`lora_graph.loading.peft_config.peft_weight_ties`).
        tp: this rank of a tensor-parallel group (None: none). Adapters are read and kept
            in the host tier whole (:attr:`layout`); the slots hold each rank's share
            (:attr:`slot_layout`, :func:`lora_graph.parallel.local_target`), written
            through :attr:`slot_writer` (the runner hands every rank its share).

    Slot 0 is the zero adapter; slots ``1..max_slots`` hold adapters. A slot that changes
    owner is overwritten whole from the adapter's normalised image, so targets the new
    adapter lacks and ranks above its rank are zero.

    Raises:
        ValueError: for a ``config.targets`` name the model does not have.
    """

    def __init__(
        self,
        config: LoRAConfig,
        *,
        targets: dict[str, LoraTarget],
        module_map: ModuleMap,
        module_path: Callable[[str, int], str],
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ignored_modules: Collection[str] = (),
        tied_modules: Mapping[str, str] | None = None,
        tp: TPRank | None = None,
    ) -> None:
        if config.targets is not None:
            unknown = set(config.targets) - set(targets)
            if unknown:
                raise ValueError(
                    f"unknown LoRA targets {sorted(unknown)} (the model has {sorted(targets)})"
                )
            targets = {k: v for k, v in targets.items() if k in config.targets}
        self.config = config
        self.targets = targets
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.dtype = config.dtype or dtype
        self.tp = tp
        self.layout = SlotLayout(targets, num_layers, config.max_rank)
        self.slot_layout = self.layout
        if tp is not None:
            local = {name: local_target(t, tp) for name, t in targets.items()}
            self.slot_layout = SlotLayout(local, num_layers, config.max_rank)
        #: tensor parallel: writes the shares of an image (one per rank) into a slot on
        #: every rank (set by the runner); None: rank 0's share written here
        self.slot_writer: Callable[[int, list[AdapterImage]], None] | None = None
        self.reader = AdapterReader(
            targets, module_map, num_layers, frozenset(ignored_modules), tied_modules
        )
        self.kernels = ops.kernels(config.backend, self.device, config.kernel_policy)
        self.registry = AdapterRegistry()
        self.host = HostTier(
            config.cpu_capacity, pin=self.device.type == "cuda", spare=self.registry.is_unloading
        )
        self.slots = SlotPool(
            config.num_slots,
            self.slot_layout.numel,
            dtype=self.dtype,
            device=self.device,
            writer=self._write_shares if tp is not None else None,
        )
        self.routing = RoutingBuffer(config.max_slots, self.device)
        self._module_path = module_path
        self._running: frozenset[str] = frozenset()
        self.layers: dict[tuple[str, int], LoRALayer] = {}  # filled by wrap()

    # ---- registry -------------------------------------------------------------------
    @property
    def loras(self) -> list[str]:
        """The loaded adapter names (those being unloaded excluded)."""
        return self.registry.loras

    def is_lora(self, name: str) -> bool:
        """Whether ``name`` is a loaded adapter (one being unloaded is not)."""
        return self.registry.is_lora(name)

    def is_active_lora(self, name: str) -> bool:
        """Whether ``name`` holds a device slot."""
        return self.slots.slot_of(name) is not None

    @property
    def pool(self) -> Tensor:
        """The slot pool ``[num_slots, layout.numel]`` every LoRA layer views."""
        return self.slots.pool

    @property
    def slot_owners(self) -> list[str | None]:
        """The adapter (routing key) each slot holds, slot 0 included: None."""
        return self.slots.owners

    @property
    def slot_loads(self) -> int:
        """Weight copies into slots so far; a steady-state decode step makes none."""
        return self.slots.loads

    def adapter(self, name: str) -> LoadedAdapter:
        """The registry entry of an adapter version (by routing key).

        Raises:
            KeyError: if ``name`` is not loaded.
        """
        return self.registry.get(name)

    def adapter_info(self, path: str) -> AdapterInfo:
        """Rank, unmapped modules and misfits of the adapter at ``path``, from its header."""
        return self.reader.info(path, resolve_adapter(path))

    def check_adapter(self, path: str, *, name: str | None = None) -> AdapterInfo:
        """Validate the adapter at ``path`` from its ``adapter_config.json`` and safetensors
        header alone (no tensor data is read; a ``.bin`` checkpoint is read whole), as
        :meth:`load_adapter` would before loading it. Saved base weights, if any, are
        compared with the model's only at load.

        Raises:
            AdapterError: naming the module or config field and the cause (see
                :meth:`AdapterReader.check_config` and :meth:`AdapterReader.check`).
        """
        label = name or path
        src = resolve_adapter(path)
        self.reader.check_config(label, src.config)
        info = self.reader.info(label, src)
        self.reader.check(label, info, max_rank=self.config.max_rank)
        return info

    def load_adapter(self, path: str, *, name: str | None = None, pin: bool = False) -> LoRAStatus:
        """Load one adapter into the host tier (``"name=path"``, or ``path`` as its name):
        :meth:`read_adapter` then :meth:`add_adapter`.

        A known name with the same weights is left as it is (``UNCHANGED``); with other
        weights it is replaced (``RELOADED``) and the load does not wait: requests that arrive
        after it get the new weights, and requests that arrived before (holding the old
        version through :meth:`acquire`, queued or running) are served by the old ones,
        which keep their slot under the routing key ``name@<digest prefix>`` until the last
        hold is released.

        Raises:
            AdapterError: if the adapter cannot be served (the message names the cause), or
                its digest differs from ``config.adapter_digests[name]``.
            NoFreeSlotError: if ``pin`` and no slot can be given to it.
        """
        return self.add_adapter(self.read_adapter(path, name=name), pin=pin)

    def read_adapter(self, path: str, *, name: str | None = None) -> ReadAdapter:
        """Read, validate and normalise an adapter (the slow part of a load: files, the
        digest, the slot image) without changing what is served, so a server can do it on
        another thread than the one stepping the engine. A name already loaded with the
        same weights is not read again (``image`` None).

        Raises:
            AdapterError: as :meth:`load_adapter`.
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
            raise AdapterError(
                f"adapter {name!r}: weights digest {digest[:12]}… does not match the expected "
                f"{expected[:12]}…"
            )
        old = self.registry.get(name) if name in self.registry else None
        if old is not None and old.digest == digest:
            return ReadAdapter(name, src, digest, None, old.rank)
        image, rank, saved_base = self.reader.load(
            name, src, self.layout, max_rank=self.config.max_rank, dtype=self.dtype
        )
        self._check_saved_base(name, saved_base)
        if self.host.pin and not image.is_pinned():
            image = image.pin_memory()
        return ReadAdapter(name, src, digest, image, rank)

    def add_adapter(self, read: ReadAdapter, *, pin: bool = False) -> LoRAStatus:
        """Serve an adapter :meth:`read_adapter` read (on the thread that steps the engine).

        Raises:
            AdapterError: if it was read as unchanged but the name's weights changed since.
            NoFreeSlotError: if ``pin`` and no slot can be given to it.
        """
        name = read.name
        old = self.registry.get(name) if name in self.registry else None
        if old is not None and old.digest == read.digest:
            if pin and not old.pinned:
                self._check_pin(name)
                old.pinned = True
                self.activate_adapter(name)
            self.registry.keep(name)
            return LoRAStatus.UNCHANGED
        if read.image is None:
            raise AdapterError(f"adapter {name!r} changed while it was read; load it again")
        if pin:
            self._check_pin(name)
        if old is not None:
            if self.registry.held(name):
                self._retire(name)
            else:
                self.registry.drop(name)
                self.slots.evict(name)
                self.host.pop(name)
        self.registry.add(LoadedAdapter(name, read.src, read.digest, read.rank, pin))
        self.host.put(name, read.image)
        if pin:
            self.activate_adapter(name)
        return LoRAStatus.RELOADED if old is not None else LoRAStatus.LOADED

    def load_configured(self) -> None:
        """Load ``config.adapters`` (checked against ``config.adapter_digests``).

        Raises:
            AdapterError: for the first that cannot be served, naming it.
        """
        for name, path in self.config.adapters.items():
            self.load_adapter(path, name=name)

    def _check_saved_base(self, name: str, saved_base: dict[LoraModuleRef, Tensor]) -> None:
        """Refuse an adapter whose file carries base weights (PEFT saves the targeted
        embedding's and LM head's) that differ from the served model's beyond the rounding
        of the two dtypes: it was trained with its own embedding (new or trained tokens),
        and serving only its LoRA pairs would be a silent wrong answer."""
        for ref, saved in saved_base.items():
            layer = self.layers.get((ref.target, ref.layer))
            if layer is None:
                continue
            served = cast(Tensor, layer.base.weight)
            if self.tp is not None:
                saved = shard_weight(self.targets[ref.target], saved, self.tp)
            coarse = [torch.finfo(d) for d in (saved.dtype, served.dtype)]
            rtol = 2 * max(f.eps for f in coarse)
            atol = max(f.tiny for f in coarse)  # below it half precision rounds to subnormals
            rows = (
                4096  # compared in row blocks: a vocabulary-sized float32 copy at once is gigabytes
            )
            if not all(
                torch.allclose(
                    saved[i : i + rows].to(served.device, torch.float32),
                    served[i : i + rows].float(),
                    rtol=rtol,
                    atol=atol,
                )
                for i in range(0, saved.shape[0], rows)
            ):
                raise AdapterError(
                    f"adapter {name!r}: its saved base weight of {ref.target} differs from the "
                    "served model's (trained with its own embedding or LM head?); only LoRA "
                    "pairs can be served"
                )

    def _check_pin(self, name: str) -> None:
        """Refuse a pin that would leave too few slots: at most ``max_slots - 1`` pinned, and
        the adapters requests in flight hold must still fit beside the pinned ones.

        Raises:
            NoFreeSlotError: naming the limit.
        """
        pinned = {a.name for a in self.registry.entries() if a.pinned and a.name != name}
        if len(pinned) >= self.config.max_slots - 1:
            raise NoFreeSlotError(
                f"adapter {name!r}: at most max_slots - 1 = {self.config.max_slots - 1} adapters "
                "can be pinned"
            )
        held = self.registry.held_keys(admitted=True)
        if len(held | pinned | {name}) > self.config.max_slots:
            raise NoFreeSlotError(
                f"adapter {name!r}: pinning it would leave too few of the "
                f"{self.config.max_slots} slots for the {len(held)} adapters that requests in "
                "flight use"
            )

    def _retire(self, name: str) -> None:
        """Move the held current version of ``name`` to ``name@<digest>`` for the requests
        that hold it. It keeps its slot and a host image (copied back from the slot if it
        had left the host tier: its file may be rewritten)."""
        image = self.host.pop(name)
        if image is None and self.tp is None:  # (a tensor-parallel slot holds only a share)
            slot = self.slots.read(name)
            if slot is not None:
                image = self.layout.read(slot, self.registry.get(name).rank)
        alias, _ = self.registry.retire(name)
        self.slots.rename(name, alias)
        if alias not in self.host and image is not None:
            self.host.put(alias, image)

    def acquire(self, name: str) -> AdapterRef:
        """Hold the current version of ``name`` for a request that names it, from its
        arrival: a reload leaves that version served to it until :meth:`release`; an unload
        refuses it unless it was admitted already (:meth:`admit`).

        Raises:
            KeyError: if ``name`` is not loaded (or is being unloaded).
        """
        return self.registry.acquire(name)

    def release(self, ref: AdapterRef) -> None:
        """Drop a request's hold (it finished or was aborted); a version that was unloaded or
        replaced is freed with its last hold. Releasing twice is harmless."""
        self.registry.release(ref)
        self._purge(frozenset())

    def unload_adapter(self, name: str) -> LoRAStatus:
        """Stop serving ``name``: new requests naming it are refused at once; requests that
        hold it finish on it, and its slot and host image are freed when the last is
        released and no running batch names it.

        Raises:
            KeyError: if ``name`` is not loaded.
        """
        self.registry.begin_unload(name)
        self._purge(self._running)
        return LoRAStatus.UNLOADED

    def batch_finished(self) -> None:
        """The last batch has run and none follows yet (an idle engine): its adapters are no
        longer protected as running; an unloaded one no request holds is freed now."""
        self._running = frozenset()
        self._purge(self._running)

    def _purge(self, running: frozenset[str]) -> None:
        for key in self.registry.purge(running):
            self.slots.evict(key)
            self.host.pop(key)

    def _host_image(self, entry: LoadedAdapter) -> AdapterImage:
        """The adapter's host image, read back from its file if it left the host tier.

        Raises:
            AdapterError: with ``adapter`` set, if the file is gone, unreadable, or changed
                since the adapter was loaded.
        """
        image = self.host.get(entry.name)
        if image is not None:
            return cast(AdapterImage, image)
        try:
            if entry.source.digest() != entry.digest:
                raise AdapterError(
                    f"adapter {entry.name!r}: its file changed on disk since it was loaded; load "
                    "it again"
                )
            image, _, _ = self.reader.load(
                entry.name,
                entry.source,
                self.layout,
                max_rank=self.config.max_rank,
                dtype=self.dtype,
            )
        except (OSError, AdapterError) as e:
            message = (
                str(e)
                if isinstance(e, AdapterError)
                else (
                    f"adapter {entry.name!r}: cannot read it back from "
                    f"{entry.source.weights_path} ({e})"
                )
            )
            raise AdapterError(message, adapter=entry.name) from e
        return cast(AdapterImage, self.host.put(entry.name, image))

    # ---- slots ----------------------------------------------------------------------
    def _write_shares(self, slot: int, image: SlotImage) -> None:
        """Tensor parallel: each rank's share of ``image`` into ``slot``."""
        assert self.tp is not None
        whole = cast(AdapterImage, image)
        shares = [
            shard_image(whole, self.slot_layout, TPRank(r, self.tp.size))
            for r in range(self.tp.size)
        ]
        if self.slot_writer is not None:
            self.slot_writer(slot, shares)
        else:
            shares[self.tp.rank].write(self.slots.pool[slot])

    def activate_adapter(self, name: str) -> int:
        """Give ``name`` a device slot (LRU) and return it; copies its weights in only if
        the slot does not already hold them. Never evicts a pinned adapter or one of the
        running batch; prefers to evict adapters no request in flight holds.

        Raises:
            KeyError: if ``name`` is not loaded.
            NoFreeSlotError: if every slot is pinned or in use by the running batch.
            AdapterError: with ``adapter=name``, if its weights left the host tier and cannot
                be read back (the file is gone or changed).
        """
        entry = self.registry.get(name)
        return self.slots.activate(
            name,
            lambda: self._host_image(entry),
            protected=lambda k: k in self._running or self.registry.get(k).pinned,
            prefer=lambda k: not self.registry.held(k),
            rank=entry.rank,
        )

    def can_activate(self, names: set[str]) -> bool:
        """Whether every adapter in ``names`` can hold a slot at once (the scheduler asks
        this before admitting a request)."""
        pinned_other = sum(1 for a in self.registry.entries() if a.pinned and a.name not in names)
        return len(names) <= self.config.max_slots - pinned_other

    def admit(self, ref: AdapterRef, running: set[str]) -> bool:
        """The scheduler's one call to admit a request holding ``ref`` (taken by
        :meth:`acquire` when it arrived) beside the adapters of ``running``: whether the
        slots can take it now (it is then marked admitted).

        Raises:
            KeyError: ``"adapter 'x' was unloaded"`` if its version was unloaded before it
                was first admitted (a request admitted before, then preempted, runs on).
        """
        if ref.unloaded and not ref.admitted:
            raise KeyError(f"adapter {ref.name!r} was unloaded")
        if not self.can_activate(running | {ref.key}):
            return False
        ref.admitted = True
        return True

    def activate_batch(self, batch: Sequence[HasAdapter]) -> None:
        """Make every adapter of ``batch`` active, protecting them from each other's eviction.

        Raises:
            ValueError: if the batch names more distinct adapters than there are slots.
            KeyError, NoFreeSlotError, AdapterError: as :meth:`activate_adapter`.
        """
        names = {r.adapter for r in batch if r.adapter is not None}
        if len(names) > self.config.max_slots:
            raise ValueError(
                f"a batch names {len(names)} distinct adapters but there are "
                f"{self.config.max_slots} slots"
            )
        self._running = frozenset(names)
        self._purge(self._running)
        for name in names:
            self.activate_adapter(name)

    def active_adapters_by_slot(self, batch: Sequence[HasAdapter]) -> dict[int, LoadedAdapter]:
        """Slot -> adapter for the batch's active adapters (base rows and inactive skipped)."""
        out = {}
        for r in batch:
            if r.adapter is None:
                continue
            slot = self.slots.slot_of(r.adapter)
            if slot is not None:
                out[slot] = self.registry.get(r.adapter)
        return out

    # ---- routing --------------------------------------------------------------------
    sort_lora_batch = staticmethod(sort_lora_batch)

    def route(self, batch: Sequence[HasAdapter], row_offsets: Sequence[int]) -> Routing:
        """The step's :class:`~lora_graph.routing.Routing` for a sorted batch whose adapters
        are active, refilled in place in the persistent routing buffer.

        Args:
            batch: requests in step order (:meth:`sort_lora_batch`).
            row_offsets: ``len(batch) + 1`` row offsets of the requests in the step.

        Raises:
            ValueError: as :func:`lora_graph.routing.group_batch`.
        """
        return self.routing.route(batch, row_offsets, self.slots.slot_of)

    def get_lora_graph_inputs(
        self,
        batch: Sequence[HasAdapter],
        input_row_offsets: Sequence[int],
        device: torch.device | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The routing triple ``(lora_ids, grouped_offsets, end)`` of :meth:`route`.

        Raises:
            ValueError: as :meth:`route`, or for a device other than the manager's.
        """
        if device is not None and torch.device(device) != self.device:
            raise ValueError(f"routing lives on {self.device}, not {device}")
        return self.route(batch, input_row_offsets).tokens

    # ---- model ----------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """Replace each target module of ``model`` with its LoRA layer, in place, and return
        ``model``. Its forward then takes the step's routing (:mod:`lora_graph.routing`)
        and hands it to each LoRA layer; there is no wrapper module."""
        self.layers = wrap_model(
            model,
            self.slot_layout.targets,
            num_layers=self.num_layers,
            module_path=self._module_path,
            layout=self.slot_layout,
            pool=self.slots.pool,
            kernels=self.kernels,
            ranks=self.slots.ranks,
        )
        return model

    def lora_weight_adapter(
        self, base_adapter: WeightsAdapter, *, wrapper_prefix: str = ""
    ) -> WeightsAdapter:
        """Wrap a checkpoint key adapter so its output loads into the wrapped model: the
        base module of each LoRA layer sits at ``<path>.base``."""
        paths = {self._module_path(target, layer) for target, layer in self.layers}
        return lora_weight_adapter(base_adapter, paths, wrapper_prefix=wrapper_prefix)


__all__ = [
    "AdapterError",
    "AdapterRef",
    "LoRAManager",
    "LoRAStatus",
    "LoadedAdapter",
    "NoFreeSlotError",
    "ReadAdapter",
]
