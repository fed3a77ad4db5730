"""The buddy KV layout: power-of-two blocks of pages in one contiguous address space.

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
are never buddies. `BuddyPool` is the KV pool (`orca_jax.core.kv.pool.KVPool`)
over a `BuddyAllocator`.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.pool import PageTable


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



class BuddyPool(PageTable):
    """Each request's pages are one contiguous power-of-two block from a
    `BuddyAllocator`, taken whole the first time it needs pages and never grown,
    as the vLLM paper's Orca baselines reserved memory; only meaningful with a
    reservation taken at admission. A request holds its whole block (`num_held`),
    of which its page-table row lists the first `max_pages_per_seq` pages.
    """

    layout = "buddy"
    totals_decide = False  # an admission needs a free block of its size

    def __init__(self, **shape: int) -> None:
        super().__init__(**shape)
        self._buddy = BuddyAllocator(self.num_kv_pages)
        self.block_start = np.full(self.num_held.size, -1, dtype=np.int64)  # [N] first offset
        self._num_free = self.num_kv_pages  # the allocator's count, kept: read every step

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def largest_block(self) -> int:
        return self._buddy.largest_block

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as (first page, pages), ascending."""
        return self._buddy.free_blocks()

    def pages_taken(self, num_pages: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        return block_pages(num_pages)

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     target_tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """A request holding nothing takes a whole power-of-two block."""
        held = self.num_held[ids]
        need = np.maximum(self.pages_for_tokens(target_tokens) - held, 0)
        return np.where(held == 0, block_pages(need), need)

    def blocks_fit(self, ids: NDArray[np.int64],  # [n]
                   pages: NDArray[np.int64],  # [n] from pages_needed
                   freeing: Optional[NDArray[np.int64]] = None) -> bool:  # [f]
        """A block of each size must exist (after `freeing` give theirs back), and a
        request already holding a block cannot grow it."""
        growing = pages > 0
        if (self.num_held[ids[growing]] > 0).any():
            return False
        buddy = self._buddy
        if freeing is not None and (self.num_held[freeing] > 0).any():
            buddy = buddy.copy()
            for request in freeing[self.num_held[freeing] > 0].tolist():
                buddy.release(int(self.block_start[request]),
                              block_order(int(self.num_held[request])))
        return buddy.fits(block_order(int(p)) for p in pages[growing].tolist())

    def allocate(self, ids: NDArray[np.int64],  # [n] distinct
                 target_tokens: NDArray[np.int64],  # [n]
                 need: Optional[NDArray[np.int64]] = None,  # [n]
                 growing_at: Optional[NDArray[np.int64]] = None) -> None:  # [g]
        """One block to each request that holds none and needs pages (`need` and
        `growing_at` are counted again here)."""
        need = self.pages_needed(ids, target_tokens)
        growing = need > 0
        if (self.num_held[ids[growing]] > 0).any():
            raise RuntimeError("buddy KV layout: a request's block cannot grow")
        if not self._buddy.fits(block_order(int(p)) for p in need[growing].tolist()):
            raise RuntimeError(f"KV pool overcommitted: no free blocks for {need[growing]} pages "
                               "(buddy layout)")
        ids, need = ids[growing], need[growing]
        order = np.argsort(-need, kind="stable")  # largest first, as `BuddyAllocator.fits`
        ids, need = ids[order], need[order]
        self._assign_rows(ids)
        for request, pages in zip(ids.tolist(), need.tolist()):
            start = self._buddy.allocate(block_order(pages))
            listed = min(pages, self.max_pages_per_seq)
            self.page_table[self.row_of[request], :listed] = np.arange(
                start + 1, start + 1 + listed, dtype=np.int32)  # page 0 is the null page
            self.block_start[request] = start
            self.num_held[request] = pages
            self._num_free -= pages

    def free(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Returns each request's block and releases its row."""
        held_ids = ids[self.num_held[ids] > 0]
        if held_ids.size:
            for request in held_ids.tolist():
                pages = int(self.num_held[request])
                self._buddy.release(int(self.block_start[request]), block_order(pages))
                self._num_free += pages
            self.page_table[self.row_of[held_ids]] = 0
            self.num_held[held_ids] = 0
            self.block_start[held_ids] = -1
        self._release_rows(ids)

    def num_freed_by(self, ids: NDArray[np.int64],  # [n] distinct
                     kept: Optional[NDArray[np.int32]] = None) -> int:  # [k]
        return int(self.num_held[ids].sum())

    def check_consistency(self) -> None:
        """Asserts that the owned and the free blocks tile the pool, and each row lists
        the first pages of its request's block (tests)."""
        holders = np.flatnonzero(self.num_held)
        blocks = self._buddy.free_blocks() + [
            (int(self.block_start[i]), int(self.num_held[i])) for i in holders]
        blocks.sort()
        ends = np.cumsum([size for _, size in blocks])
        starts = [start for start, _ in blocks]
        if starts != [0] + ends[:-1].tolist() or ends[-1] != self.num_kv_pages:
            raise AssertionError("buddy KV blocks leaked, overlap or leave gaps")
        if any(size & (size - 1) or start % size for start, size in blocks):
            raise AssertionError("a buddy KV block is not an aligned power of two")
        if self._buddy.num_free != self._num_free:
            raise AssertionError("buddy KV free count out of step with its blocks")
        for i in holders.tolist():
            listed = min(int(self.num_held[i]), self.max_pages_per_seq)
            start = int(self.block_start[i])
            if not np.array_equal(self.page_table[self.row_of[i], :listed],
                                  np.arange(start + 1, start + 1 + listed)):
                raise AssertionError(f"request {i}'s page-table row is not its block")
