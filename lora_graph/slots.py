"""Where adapter weights live between disk and the kernels: the host tier (normalised
images in host memory, pinned on CUDA, LRU) and the device slot pool (LRU over
``max_slots`` slots plus slot 0, the zero adapter).

Both are keyed by routing key and know nothing of versions or holds: the manager says
which keys are protected from eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor


class SlotImage(Protocol):
    """What the host tier holds and a slot is filled from
    (:class:`lora_graph.layout.AdapterImage`): host memory that can be pinned, and that
    writes itself into a flat slot whole."""

    @property
    def nbytes(self) -> int: ...

    def is_pinned(self) -> bool: ...

    def pin_memory(self) -> SlotImage: ...

    def write(self, slot: Tensor) -> None: ...


class NoFreeSlotError(RuntimeError):
    """Every slot holds a pinned adapter or one of the running batch."""


class HostTier:
    """Up to ``capacity`` adapter images in host memory (pinned when ``pin``), least
    recently used dropped first, except keys ``spare(key)`` says to keep."""

    def __init__(self, capacity: int, *, pin: bool, spare: Callable[[str], bool]) -> None:
        self.capacity = capacity
        self.pin = pin
        self._spare = spare
        self._images: OrderedDict[str, SlotImage] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._images

    @property
    def nbytes(self) -> int:
        """Bytes of the images held."""
        return sum(image.nbytes for image in self._images.values())

    def get(self, key: str) -> SlotImage | None:
        """The image of ``key`` (marked most recently used), or None if it left the tier."""
        image = self._images.get(key)
        if image is not None:
            self._images.move_to_end(key)
        return image

    def put(self, key: str, image: SlotImage) -> SlotImage:
        """Store (pinning it on CUDA) and mark most recently used; drop the least recently
        used unspared images beyond ``capacity``. Returns the stored image."""
        if self.pin and not image.is_pinned():
            image = image.pin_memory()
        self._images[key] = image
        self._images.move_to_end(key)
        while len(self._images) > self.capacity:
            victim = next((k for k in self._images if k != key and not self._spare(k)), None)
            if victim is None:
                break
            del self._images[victim]
        return image

    def pop(self, key: str) -> SlotImage | None:
        return self._images.pop(key, None)


class SlotPool:
    """The device slots: one pool ``[num_slots, numel]`` (slot 0 all zeros), and the LRU map
    of which key owns which slot. A slot that changes owner is overwritten whole.

    Args:
        num_slots: slots including slot 0.
        numel: elements of one slot (:class:`~lora_graph.layout.SlotLayout`).
        dtype, device: of the pool.
        writer: writes an image into a slot by index (tensor parallelism's shares); None:
            the image writes itself into the slot.
    """

    def __init__(
        self,
        num_slots: int,
        numel: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        writer: Callable[[int, SlotImage], None] | None = None,
    ) -> None:
        self._writer = writer
        self.pool = torch.zeros(num_slots, numel, dtype=dtype, device=device)
        # each slot's rank (0: slot 0, and slots never written): the kernels skip a slot's
        # A rows and B columns from it on, zeros in every image (the ops' ``ranks``)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self._owner: OrderedDict[str, int] = OrderedDict()  # key -> slot, oldest first
        self.loads = 0  # weight copies into slots; a steady-state step makes none
        self.hits = 0  # activations that found the key in a slot
        self.evictions = 0  # owners that lost their slot to another key

    @property
    def max_slots(self) -> int:
        return self.pool.shape[0] - 1

    def slot_of(self, key: str) -> int | None:
        return self._owner.get(key)

    @property
    def owners(self) -> list[str | None]:
        """The key each slot holds, slot 0 (the zero adapter) included: None."""
        owners: list[str | None] = [None] * self.pool.shape[0]
        for key, slot in self._owner.items():
            owners[slot] = key
        return owners

    def activate(
        self,
        key: str,
        image: Callable[[], SlotImage],
        *,
        protected: Callable[[str], bool],
        prefer: Callable[[str], bool],
        rank: int | None = None,
    ) -> int:
        """Give ``key`` a slot and return it; copy ``image()`` in only if it has none. A
        full pool evicts the least recently used unprotected owner, ``prefer``-ed ones
        first. ``rank``: the image's rank (its blocks are zero from it on; None: the pool's
        full width, every column read).

        Raises:
            NoFreeSlotError: if every owner is protected.
        """
        slot = self._owner.get(key)
        if slot is not None:
            self._owner.move_to_end(key)
            self.hits += 1
            return slot
        slot = self._free_slot(protected, prefer)
        if self._writer is None:
            image().write(self.pool[slot])
        else:
            self._writer(slot, image())
        self.ranks[slot] = torch.iinfo(torch.int32).max if rank is None else rank
        self.loads += 1
        self._owner[key] = slot
        return slot

    def _free_slot(self, protected: Callable[[str], bool], prefer: Callable[[str], bool]) -> int:
        taken = set(self._owner.values())
        free = next((slot for slot in range(1, self.pool.shape[0]) if slot not in taken), None)
        if free is not None:
            return free
        evictable = [k for k in self._owner if not protected(k)]
        if not evictable:
            raise NoFreeSlotError(
                f"all {self.max_slots} slots hold pinned adapters or adapters of the running batch"
            )
        victim = next((k for k in evictable if prefer(k)), evictable[0])
        self.evictions += 1
        return self._owner.pop(victim)

    def evict(self, key: str) -> None:
        self._owner.pop(key, None)

    def rename(self, old: str, new: str) -> None:
        """Move ``old``'s slot to ``new``; if ``new`` already owns one, ``old``'s is freed."""
        slot = self._owner.pop(old, None)
        if slot is not None and new not in self._owner:
            self._owner[new] = slot

    def read(self, key: str) -> Tensor | None:
        """A host copy of ``key``'s slot, or None if it holds no slot."""
        slot = self._owner.get(key)
        return None if slot is None else self.pool[slot].to("cpu", copy=True)
