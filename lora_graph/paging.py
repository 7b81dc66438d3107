"""The paged KV cache's bookkeeping: a pool of fixed-size pages, who holds which, and the
full pages kept for reuse (prefix caching, :mod:`lora_graph.prefix_cache`).

The KV cache of every attention layer is one tensor of ``num_pages`` pages of
``page_size`` token positions each (``[num_pages, page_size, kv_heads, head_dim]``, the
layout of vLLM's PagedAttention, Kwon et al. 2023). A request holds a *block table*: the
list of its pages, in order, so its token at position ``p`` lives in page
``pages[p // page_size]`` at offset ``p % page_size``. Pages are taken as a request grows
and given back when it finishes, is aborted or is preempted; they need not be contiguous.

A page is held by reference count: a full page whose K and V are computed may be given a
*key* (:meth:`PagePool.cache`, the hash of its prefix) and shared by every request whose
prompt starts with that prefix (:meth:`PagePool.share`). A keyed page nobody holds stays
cached, its K and V intact, until the pool needs it: :meth:`PagePool.allocate` takes the
never-keyed free pages first, then the least recently released cached ones (LRU). A keyed
page is never written again (its holders' computed positions are past it).

Page 0 is never handed out: a captured step's padding tokens write their K and V there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """:meth:`PagePool.allocate` was asked for more pages than are free."""


class PagePool:
    """Reference-counted allocator of KV cache pages (page 0 reserved as the scratch page),
    with the cached pages' keys.

    Args:
        num_pages: pages in the KV cache tensors, the scratch page included (at least 2).
        page_size: token positions per page.

    Raises:
        ValueError: for fewer than 2 pages or a page size below 1.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        # keyed pages nobody holds, least recently released first (taken in that order)
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._owner_of: dict[int, bytes] = {}  # keyed page -> the identity it was computed by
        self._by_owner: dict[bytes, set[int]] = {}
        self.evictions = 0  # cached pages taken for new contents

    @property
    def capacity(self) -> int:
        """Pages a request can ever hold (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages :meth:`allocate` can hand out: never keyed ones and cached ones nobody
        holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Keyed pages (held or not)."""
        return len(self._key_of)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-tokens // self.page_size)

    def refs(self, page: int) -> int:
        """Holders of ``page`` (0: free or cached and idle)."""
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (each held once): free ones first, then idle cached ones, least
        recently released first (their keys are dropped).

        Raises:
            OutOfPagesError: if fewer than ``n`` are free (nothing is taken).
        """
        if n > self.num_free:
            raise OutOfPagesError(f"{n} pages wanted, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                self._unkey(page)
                self.evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Hold cached pages once more (a request reusing them).

        Raises:
            ValueError: for a page without a key (only cached pages are shared).
        """
        for p in pages:
            if p not in self._key_of:
                raise ValueError(f"page {p} is not cached")
            if self._refs[p] == 0:
                del self._idle[p]
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Release pages once each: one nobody holds then goes back to the pool, or, if it
        has a key, stays cached (idle) until :meth:`allocate` needs it. A request releases
        its block table last page first, so a prefix's tail is taken before its head.

        Raises:
            ValueError: for a page that is not held (released twice, or the scratch page).
        """
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._key_of:
                    self._idle[p] = None
                else:
                    self._free.append(p)

    def lookup(self, key: bytes) -> int | None:
        """The cached page of ``key`` (None: none)."""
        return self._page_of.get(key)

    def cache(self, page: int, key: bytes, owner: bytes) -> bool:
        """Give a held, full, computed page its ``key``, computed by identity ``owner`` (so
        :meth:`forget` can drop it). Returns False, changing nothing, when the page has a
        key already or another page holds ``key`` (the same prefix computed twice: the
        first stays the one shared)."""
        if page in self._key_of or key in self._page_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        self._owner_of[page] = owner
        self._by_owner.setdefault(owner, set()).add(page)
        return True

    def forget(self, owner: bytes) -> int:
        """Drop the keys of every page ``owner`` computed (an adapter version unloaded):
        they can no longer be reused; idle ones are free at once. Returns how many."""
        pages = self._by_owner.pop(owner, set())
        for p in pages:
            del self._page_of[self._key_of.pop(p)]
            del self._owner_of[p]
            if p in self._idle:
                del self._idle[p]
                self._free.append(p)
        return len(pages)

    def forget_all(self) -> int:
        """Drop every page's key (a cold cache); returns how many."""
        return sum(self.forget(owner) for owner in list(self._by_owner))

    def _unkey(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        owner = self._owner_of.pop(page)
        held = self._by_owner[owner]
        held.discard(page)
        if not held:
            del self._by_owner[owner]


__all__ = ["OutOfPagesError", "PagePool"]
