"""The KV page manager: a pool of fixed-size pages and a page table per running request.

Pages are numbered 1..num_kv_pages; page 0 is the null page that padding rows
write to, so the engine's cache holds `num_kv_pages + 1` pages. A running request
owns a row of the page table (`[max_pages_per_seq]` page numbers, 0 past the
pages it holds). Allocation is by target token count: a request that must hold
`t` tokens owns `ceil(t / page_size)` pages, so on-demand allocation (vLLM: grow
a page at a time) and reservation at admission (Orca: the whole context up
front) are the same call with a different target. Everything is vectorized over
request indices: in steady decode the per-step cost does not grow with Python
work per request.

Two layouts (`KV_LAYOUTS`). `paged`: any free page serves any request. `buddy`:
a request's pages are one contiguous power-of-two block from a buddy allocator
(`orca_jax.core.buddy`), taken whole the first time it needs pages and never
grown, as the vLLM paper's Orca baselines reserved memory; only meaningful
with a reservation taken at admission.

With a `PrefixCache` (prefix caching, `paged` only), pages are shared: several
page-table rows may list one page, `ref_count` says how many, and a page is
freed only when its last holder lets it go. A freed page that holds a cached
block joins the cache's free LRU instead of the free stack; allocation takes
the free stack first, then evicts the least recently freed cached pages.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.buddy import BuddyAllocator, block_order, block_pages
from orca_jax.core.prefix_cache import PrefixCache

KV_LAYOUTS = ("paged", "buddy")


class KVPageManager:
    """Pages and page-table rows for up to `num_requests` requests.

    Args:
      num_kv_pages: usable pages in the pool (the null page is extra).
      page_size: tokens per page.
      max_pages_per_seq: page-table width (max context / page size, rounded up).
      num_requests: number of request indices this manager tracks.
      layout: `paged` or `buddy` (see the module docstring). Under `buddy` a
        request holds its whole block (`num_held`), of which its page-table row
        lists the first `max_pages_per_seq` pages.
      prefix_cache: the prefix cache whose pages this pool shares, or None (every
        page private). Not with `buddy`.
    """

    def __init__(self, *, num_kv_pages: int, page_size: int, max_pages_per_seq: int,
                 num_requests: int, layout: str = "paged",
                 prefix_cache: Optional[PrefixCache] = None) -> None:
        if num_kv_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(f"KV pool needs num_kv_pages, page_size and max_pages_per_seq >= 1, "
                             f"got {num_kv_pages}, {page_size}, {max_pages_per_seq}")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"KV layout {layout!r} is not one of {KV_LAYOUTS}")
        if prefix_cache is not None and layout == "buddy":
            raise ValueError("prefix caching shares single pages; the buddy KV layout hands "
                             "out whole blocks: use the paged layout with prefix caching")
        self.cache = prefix_cache
        self.ref_count = np.zeros(num_kv_pages + 1, dtype=np.int64)  # [pages + 1] rows holding it
        self.layout = layout
        self._buddy: Optional[BuddyAllocator] = (BuddyAllocator(num_kv_pages)
                                                 if layout == "buddy" else None)
        self.block_start = np.full(num_requests, -1, dtype=np.int64)  # [N] buddy: first offset
        self.num_kv_pages = num_kv_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        # A stack: the next pages handed out are at the end, so page 1 goes first.
        self._free = np.arange(num_kv_pages, 0, -1, dtype=np.int32)  # [num_kv_pages]
        self._num_free = num_kv_pages
        self.num_held = np.zeros(num_requests, dtype=np.int64)  # [N] pages each request owns
        self.row_of = np.full(num_requests, -1, dtype=np.int64)  # [N] page-table row, -1 none
        self.page_table = np.zeros((0, max_pages_per_seq), dtype=np.int32)  # [rows, P]
        self._free_rows: list[int] = []

    @property
    def num_free(self) -> int:
        """Free pages: on the free stack, or cached and evictable."""
        return self._num_free + (self.cache.num_free if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        return self.num_kv_pages - self.num_free

    def pages_for_tokens(self, num_tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """Pages needed to hold `num_tokens` tokens, elementwise. `[n] -> [n]`."""
        return (num_tokens + (self.page_size - 1)) // self.page_size  # ceil, for any int

    @property
    def largest_block(self) -> int:
        """The most pages one request can ever take at once (the pool, or its largest
        buddy block)."""
        return self._buddy.largest_block if self._buddy else self.num_kv_pages

    def pages_taken(self, num_pages: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Pages the pool gives a request holding none that needs `num_pages`: the same,
        or under `buddy` the power-of-two block."""
        return block_pages(num_pages) if self._buddy else num_pages

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     target_tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """New pages each request needs to hold `target_tokens` tokens. Returns `[n]`.

        Under `buddy`, a request holding nothing takes a whole power-of-two block.
        """
        held = self.num_held[ids]
        need = np.maximum(self.pages_for_tokens(target_tokens) - held, 0)
        if self._buddy is None:
            return need
        return np.where(held == 0, block_pages(need), need)

    def blocks_fit(self, ids: NDArray[np.int64],  # [n]
                   pages: NDArray[np.int64],  # [n] from pages_needed
                   freeing: Optional[NDArray[np.int64]] = None) -> bool:  # [f]
        """Whether the free blocks can give these requests `pages` new pages each, after
        the requests `freeing` give theirs back. Always true under `paged`, where only the
        total counts (the caller checks it); under `buddy` a block of each size must
        exist and a request already holding a block cannot grow it."""
        if self._buddy is None:
            return True
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
                 need: Optional[NDArray[np.int64]] = None) -> None:  # [n]
        """Grows each request's pages to hold `target_tokens`; the caller checked capacity.

        `need`: `pages_needed(ids, target_tokens)`, if the caller has it already.
        """
        if self._buddy is not None:
            self._allocate_blocks(ids, target_tokens)
            return
        if need is None:
            need = self.pages_needed(ids, target_tokens)
        growing_mask = need > 0
        growing = ids[growing_mask]  # [g]
        need = need[growing_mask]  # [g]
        total = int(need.sum())
        if total == 0:
            return
        if total > self.num_free:
            raise RuntimeError(f"KV pool overcommitted: {total} pages asked, {self.num_free} free")
        held = self.num_held[growing]  # [g]
        if int((held + need).max()) > self.max_pages_per_seq:
            raise RuntimeError("a request would exceed max_pages_per_seq")
        self._assign_rows(growing)
        pages = self._take(total)
        self.ref_count[pages] = 1
        rows = self.row_of[growing]
        if total == growing.size:  # one page each: most steps (decodes entering a page)
            self.page_table[rows, held] = pages
        else:
            rows = np.repeat(rows, need)
            starts = np.repeat(held, need)
            within = np.arange(total) - np.repeat(np.cumsum(need) - need, need)
            self.page_table[rows, starts + within] = pages
        self.num_held[growing] = held + need

    def _take(self, count: int) -> NDArray[np.int32]:
        """`[count]` free pages: the free stack's first, then evicted cached ones."""
        stacked = min(count, self._num_free)
        pages = self._free[self._num_free - stacked:self._num_free][::-1]
        self._num_free -= stacked
        if stacked == count:
            return pages
        assert self.cache is not None
        return np.concatenate([pages, self.cache.evict(count - stacked)])

    def share(self, request: int, pages: NDArray[np.int32]) -> None:  # [h]
        """Request `request`, holding nothing, starts with these cached pages (a prefix
        hit): one more holder each; free ones leave the free pool."""
        if self.num_held[request]:
            raise RuntimeError(f"request {request} holds pages; only a new holder shares")
        if pages.size > self.max_pages_per_seq:
            raise RuntimeError("a request would exceed max_pages_per_seq")
        assert self.cache is not None
        self._assign_rows(np.array([request], dtype=np.int64))
        self.page_table[self.row_of[request], :pages.size] = pages
        self.num_held[request] = pages.size
        self.cache.take(pages[self.ref_count[pages] == 0])
        self.ref_count[pages] += 1

    def num_freed_by(self, ids: NDArray[np.int64],  # [n] distinct
                     kept: Optional[NDArray[np.int32]] = None) -> int:  # [k]
        """Pages that become free if these requests let theirs go, leaving out the pages
        `kept` (taken again at once): a shared page only if all its holders are here."""
        held = self.num_held[ids]
        if self.cache is None:
            return int(held.sum())
        holders = ids[held > 0]
        if holders.size == 0:
            return 0
        mask = np.arange(self.max_pages_per_seq)[None, :] < held[held > 0][:, None]
        pages, counts = np.unique(self.page_table[self.row_of[holders]][mask],
                                  return_counts=True)
        freed = pages[self.ref_count[pages] == counts]
        if kept is not None and kept.size:
            freed = freed[~np.isin(freed, kept)]
        return int(freed.size)

    def _allocate_blocks(self, ids: NDArray[np.int64],  # [n]
                         target_tokens: NDArray[np.int64]) -> None:  # [n]
        """Buddy layout: one block to each request that holds none and needs pages."""
        assert self._buddy is not None
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
        """Returns every page of these requests to the pool and releases their rows."""
        held_ids = ids[self.num_held[ids] > 0]
        if held_ids.size and self._buddy is not None:
            for request in held_ids.tolist():
                pages = int(self.num_held[request])
                self._buddy.release(int(self.block_start[request]), block_order(pages))
                self._num_free += pages
            self.page_table[self.row_of[held_ids]] = 0
            self.num_held[held_ids] = 0
            self.block_start[held_ids] = -1
        elif held_ids.size:
            rows = self.row_of[held_ids]
            held = self.num_held[held_ids]
            if held_ids.size == 1:  # most frees: one request finishing
                pages = self.page_table[rows[0], :held[0]].copy()
            else:
                mask = np.arange(self.max_pages_per_seq)[None, :] < held[:, None]
                pages = self.page_table[rows][mask]
            if self.cache is None:
                self.ref_count[pages] = 0
            else:
                pages = self._unhold(pages)
            self._free[self._num_free:self._num_free + pages.size] = pages[::-1]
            self._num_free += pages.size
            self.page_table[rows] = 0
            self.num_held[held_ids] = 0
        with_rows = ids[self.row_of[ids] >= 0]
        if with_rows.size:
            self._free_rows.extend(self.row_of[with_rows].tolist())
            self.row_of[with_rows] = -1

    def _unhold(self, pages: NDArray[np.int32]) -> NDArray[np.int32]:  # [k] -> [u]
        """Drops one holder of each listed page (a page listed twice loses two). Cached
        pages left unheld join the cache's free LRU, each request's last page first;
        returns the uncached ones left unheld, for the free stack."""
        assert self.cache is not None
        np.subtract.at(self.ref_count, pages, 1)
        unheld = pages[self.ref_count[pages] == 0]
        if unheld.size > 1:  # a page two leaving requests shared: once
            _, first = np.unique(unheld, return_index=True)
            unheld = unheld[np.sort(first)]
        cached = self.cache.is_cached[unheld]
        self.cache.release(unheld[cached][::-1])
        return unheld[~cached]

    def pages_of(self, request: int) -> NDArray[np.int32]:
        """The pages request `request` holds, in order (a copy). `-> [held]`."""
        row = self.row_of[request]
        if row < 0:
            return np.zeros(0, dtype=np.int32)
        return self.page_table[row, :self.num_held[request]].copy()

    def _assign_rows(self, ids: NDArray[np.int64]) -> None:
        rowless = ids[self.row_of[ids] < 0]
        if rowless.size == 0:
            return
        shortfall = rowless.size - len(self._free_rows)
        if shortfall > 0:
            old = self.page_table.shape[0]
            grow = max(shortfall, old, 16)
            self.page_table = np.concatenate(
                [self.page_table, np.zeros((grow, self.max_pages_per_seq), np.int32)])
            self._free_rows.extend(range(old + grow - 1, old - 1, -1))
        for request in rowless.tolist():
            self.row_of[request] = self._free_rows.pop()

    def check_consistency(self) -> None:
        """Asserts that every page is either free or in use, never both (tests).

        Without a prefix cache a page in use has exactly one owner. With one, each
        page's `ref_count` is the number of page-table rows holding it (never
        negative), and free pages are on the free stack (uncached) or the cache's
        free LRU (cached). Under `buddy`: the owned and the free blocks tile the
        pool, and each row lists the first pages of its request's block.
        """
        if self._buddy is not None:
            self._check_blocks()
            return
        owned = [self.pages_of(int(i)) for i in np.flatnonzero(self.num_held)]
        holders = np.bincount(np.concatenate(owned + [np.zeros(0, np.int32)]),
                              minlength=self.num_kv_pages + 1)  # [pages + 1]
        if (self.cache is None and (holders > 1).any()) or holders[0]:
            raise AssertionError("KV pages leaked or double-owned")
        if (self.ref_count < 0).any():
            raise AssertionError("a KV page's reference count is negative")
        if not np.array_equal(holders, self.ref_count):
            raise AssertionError("KV reference counts differ from the rows holding the pages")
        free = [self._free[:self._num_free]]
        if self.cache is not None:
            self.cache.check_consistency()
            if self.cache.is_cached[free[0]].any():
                raise AssertionError("a cached KV page is on the uncached free stack")
            free.append(self.cache.free_pages())
        free_pages = np.concatenate(free)
        if (holders[free_pages] > 0).any():
            raise AssertionError("a KV page is both free and in use")
        all_pages = np.concatenate([np.flatnonzero(holders), free_pages])
        if all_pages.size != self.num_kv_pages or not np.array_equal(
                np.sort(all_pages), np.arange(1, self.num_kv_pages + 1)):
            raise AssertionError("KV pages leaked or double-owned")

    def _check_blocks(self) -> None:
        assert self._buddy is not None
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
