"""A buddy allocator: power-of-two blocks of pages in one contiguous address space.

The KV layout the vLLM paper's Orca baselines had: each request's reservation
is one contiguous region, rounded up to a power of two of pages, carved out of
the pool by splitting a larger free block in halves. A freed block merges with
its buddy (the other half of the block it was split from) when that is free
too. A request is admitted only when a free block of its size exists (or a
larger one to split), not when enough pages are free in total: that gap is
the allocator's external fragmentation.

A pool of `num_pages` pages that is not a power of two is cut into its binary
decomposition, largest block first (12 pages: [0, 8) and [8, 12)), so every
top block is aligned to its own size and two blocks of different top blocks
are never buddies.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from numpy.typing import NDArray


def block_order(num_pages: int) -> int:
    """The order k of the smallest block (2**k pages) holding `num_pages` >= 1 pages."""
    if num_pages < 1:
        raise ValueError(f"a block holds at least 1 page, asked for {num_pages}")
    return (num_pages - 1).bit_length()


def block_pages(num_pages: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
    """Each count rounded up to a power of two (0 stays 0), elementwise."""
    orders = np.ceil(np.log2(np.maximum(num_pages, 1))).astype(np.int64)
    return np.where(num_pages > 0, np.left_shift(1, orders), 0)


class BuddyAllocator:
    """Free blocks of pages 0..num_pages-1, by order.

    Args:
      num_pages: pages in the address space (>= 1).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"BuddyAllocator needs num_pages >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.max_order = num_pages.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        offset = 0
        for order in range(self.max_order, -1, -1):
            if num_pages >> order & 1:
                self._free[order].add(offset)
                offset += 1 << order

    @property
    def largest_block(self) -> int:
        """Pages of the largest block the pool can ever give out."""
        return 1 << self.max_order

    @property
    def num_free(self) -> int:
        """Free pages, in blocks of any size."""
        return sum(len(starts) << order for order, starts in enumerate(self._free))

    def free_counts(self) -> NDArray[np.int64]:
        """`[max_order + 1]` free blocks of each order."""
        return np.array([len(starts) for starts in self._free], dtype=np.int64)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as (first page, pages), ascending."""
        return sorted((start, 1 << order) for order, starts in enumerate(self._free)
                      for start in starts)

    def allocate(self, order: int) -> int:
        """Takes a block of 2**order pages (the lowest-addressed of the smallest free
        order that holds it, split down). Returns its first page."""
        source = next((k for k in range(order, self.max_order + 1) if self._free[k]), None)
        if source is None:
            raise RuntimeError(f"buddy allocator: no free block of {1 << order} pages "
                               f"({self.num_free} pages free in smaller blocks)")
        start = min(self._free[source])
        self._free[source].remove(start)
        for k in range(source - 1, order - 1, -1):
            self._free[k].add(start + (1 << k))  # the upper half stays free
        return start

    def release(self, start: int, order: int) -> None:
        """Returns the block at `start` of 2**order pages, merging it with free buddies."""
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    def copy(self) -> "BuddyAllocator":
        """An independent allocator in the same state (for trial allocations)."""
        clone = BuddyAllocator.__new__(BuddyAllocator)
        clone.num_pages, clone.max_order = self.num_pages, self.max_order
        clone._free = [set(starts) for starts in self._free]
        return clone

    def fits(self, orders: Iterable[int]) -> bool:
        """Whether blocks of these orders can all be allocated now, largest first.

        Allocating splits the smallest free block that holds the request, so the
        outcome depends only on how many free blocks each order has.
        """
        counts = self.free_counts()
        for order in sorted(orders, reverse=True):
            held = np.flatnonzero(counts[order:])
            if held.size == 0:
                return False
            source = order + int(held[0])
            counts[source] -= 1
            counts[order:source] += 1  # one upper half left free at each order split
        return True

