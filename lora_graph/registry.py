"""The adapter registry: names, versions (digests), holds of requests in flight, hot reload
and deferred unload. It knows nothing of device slots or host images: the manager moves
those when the registry says a version was renamed or freed.

Routing keys: the current version of an adapter is served under its name; a version
replaced (reload) or unloaded while requests still hold it stays served under
``name@<digest prefix>`` (reload) or its name (unload) until the last hold is released.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_graph.loading.adapter_files import AdapterSource

# adapter version serials, unique in the process (LoadedAdapter.version)
_VERSIONS = itertools.count(1)


class LoRAStatus(enum.Enum):
    """The outcome of a load or unload."""

    LOADED = "loaded"
    RELOADED = "reloaded"  # a known name with new weights
    UNCHANGED = "unchanged"  # a known name with the same weights
    UNLOADED = "unloaded"


@dataclass(eq=False)
class AdapterRef:
    """A request's hold on the version of an adapter its name stood for when the request
    arrived. ``key`` is what its batch rows route by: the adapter's name while that version
    is current, ``name@<digest prefix>`` once a reload replaced it (the registry updates it
    in place). ``admitted``: the request has been admitted to run (it then finishes on this
    version even if it is unloaded). ``unloaded``: the version was unloaded while the
    request held it; one not yet admitted is refused. ``version``: the version's serial
    (:attr:`LoadedAdapter.version`), what the prefix cache keys its pages by."""

    name: str
    digest: str
    key: str
    admitted: bool = False
    unloaded: bool = False
    version: int = 0


@dataclass
class LoadedAdapter:
    """A registered adapter version: its routing key ``name``, ``digest``, rank, where its
    weights are read from again if its host image was dropped, and ``version``: a serial
    unique in the process, new for every load that registers weights (a reload with other
    weights, or a load after an unload, even of the same weights), kept while the version
    is served (a load of the same weights under its name leaves it as it is)."""

    name: str
    source: AdapterSource
    digest: str
    rank: int
    pinned: bool
    version: int = field(default_factory=lambda: next(_VERSIONS))
    # the versions of the same weights retired into this one's routing key (their requests
    # now route here; their cached pages are dropped with it)
    merged: list[int] = field(default_factory=list)


class AdapterRegistry:
    """Registered adapter versions by routing key, the holds on them, and which are being
    unloaded (served only to the requests that hold them).

    ``on_forget``, if set, is called with a version's serial when the registry forgets it
    (:meth:`drop`, :meth:`purge`): the prefix cache then drops that version's pages."""

    def __init__(self) -> None:
        self._entries: dict[str, LoadedAdapter] = {}
        self._holds: dict[str, list[AdapterRef]] = {}
        self._unloading: set[str] = set()
        self.on_forget: Callable[[int], None] | None = None

    @property
    def loras(self) -> list[str]:
        """Names new requests may use (versions being unloaded or replaced excluded)."""
        return [n for n in self._entries if n not in self._unloading]

    def is_lora(self, name: str) -> bool:
        return name in self._entries and name not in self._unloading

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> LoadedAdapter:
        """Raises KeyError naming ``key`` if it is not registered."""
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"adapter {key!r} is not loaded") from None

    def entries(self) -> list[LoadedAdapter]:
        return list(self._entries.values())

    def held(self, key: str) -> bool:
        """Whether a request in flight holds ``key``."""
        return bool(self._holds.get(key))

    def held_keys(self, *, admitted: bool = False) -> set[str]:
        """The keys requests in flight hold (``admitted``: only those of admitted requests)."""
        return {
            key
            for key, holds in self._holds.items()
            if any(ref.admitted or not admitted for ref in holds)
        }

    def is_unloading(self, key: str) -> bool:
        return key in self._unloading

    def add(self, entry: LoadedAdapter) -> None:
        """Register ``entry`` as the current version of its name (the previous current
        version must have been retired or dropped first)."""
        self._entries[entry.name] = entry
        self._unloading.discard(entry.name)

    def keep(self, name: str) -> None:
        """Cancel a pending unload of ``name`` (it was loaded again with the same weights)."""
        self._unloading.discard(name)
        for ref in self._holds.get(name, []):
            ref.unloaded = False

    def drop(self, key: str) -> None:
        """Forget an unheld version at once."""
        entry = self._entries.pop(key, None)
        self._unloading.discard(key)
        if entry is not None:
            self._forget(entry)

    def _forget(self, entry: LoadedAdapter) -> None:
        if self.on_forget is not None:
            for version in (entry.version, *entry.merged):
                self.on_forget(version)

    def acquire(self, name: str) -> AdapterRef:
        """Hold the current version of ``name`` for a request that names it.

        Raises:
            KeyError: if ``name`` is not loaded (or is being unloaded).
        """
        if not self.is_lora(name):
            raise KeyError(f"adapter {name!r} is not loaded")
        entry = self._entries[name]
        ref = AdapterRef(name, entry.digest, name, version=entry.version)
        self._holds.setdefault(name, []).append(ref)
        return ref

    def release(self, ref: AdapterRef) -> None:
        """Drop a request's hold; releasing twice is harmless."""
        holds = self._holds.get(ref.key, [])
        if ref in holds:
            holds.remove(ref)
            if not holds:
                del self._holds[ref.key]

    def retire(self, name: str) -> tuple[str, bool]:
        """Move the held current version of ``name`` to the routing key
        ``name@<digest prefix>`` (its holds follow), marked unloading; the same weights
        retired before and still held share that key.

        Returns:
            ``(alias, merged)``: merged is True when the alias already existed.
        """
        entry = self._entries.pop(name)
        alias = f"{name}@{entry.digest[:12]}"
        merged = alias in self._entries
        if not merged:
            entry.name, entry.pinned = alias, False
            self._entries[alias] = entry
        else:
            self._entries[alias].merged += [entry.version, *entry.merged]
        holds = self._holds.pop(name, [])
        for ref in holds:
            ref.key = alias
        self._holds.setdefault(alias, []).extend(holds)
        self._unloading.add(alias)
        return alias, merged

    def begin_unload(self, name: str) -> None:
        """Refuse new requests for ``name``, and mark the holds on it ``unloaded`` (the
        requests not yet admitted are then refused); it is freed by :meth:`purge` once
        unheld.

        Raises:
            KeyError: if ``name`` is not loaded.
        """
        if not self.is_lora(name):
            raise KeyError(f"adapter {name!r} is not loaded")
        self._unloading.add(name)
        for ref in self._holds.get(name, []):
            ref.unloaded = True

    def purge(self, running: frozenset[str]) -> list[str]:
        """Forget versions being unloaded that no request holds and the running batch does
        not name; returns their keys (the caller frees their slots and images)."""
        freed = [k for k in self._unloading if k not in running and not self._holds.get(k)]
        for key in freed:
            self._unloading.discard(key)
            self._forget(self._entries.pop(key))
        return freed
