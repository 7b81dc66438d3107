"""The paged KV cache's bookkeeping: a pool of fixed-size pages and who holds which.

The KV cache of every attention layer is one tensor of ``num_pages`` pages of
``page_size`` token positions each (``[num_pages, page_size, kv_heads, head_dim]``, the
layout of vLLM's PagedAttention, Kwon et al. 2023). A request holds a *block table*: the
list of its pages, in order, so its token at position ``p`` lives in page
``pages[p // page_size]`` at offset ``p % page_size``. Pages are taken as a request grows
and returned when it finishes, is aborted or is preempted; they need not be contiguous.

Page 0 is never handed out: a captured step's padding tokens write their K and V there.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """:meth:`PagePool.allocate` was asked for more pages than are free."""


class PagePool:
    """Free-list allocator of KV cache pages (page 0 reserved as the scratch page).

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
        self._held = [False] * num_pages

    @property
    def capacity(self) -> int:
        """Pages a request can ever hold (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages.

        Raises:
            OutOfPagesError: if fewer than ``n`` are free (nothing is taken).
        """
        if n > len(self._free):
            raise OutOfPagesError(f"{n} pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._held[p] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool.

        Raises:
            ValueError: for a page that is not held (freed twice, or the scratch page).
        """
        for p in pages:
            if not self._held[p]:
                raise ValueError(f"page {p} is not held")
            self._held[p] = False
            self._free.append(p)


__all__ = ["OutOfPagesError", "PagePool"]
