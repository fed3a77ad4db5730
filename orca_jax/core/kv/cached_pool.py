"""Prefix caching as a layer over the paged pool: pages shared by several rows.

A `CachedPool` is a `PagedPool` whose pages a `PrefixCache` names: several
page-table rows may list one page, `ref_count` says how many, and a page is
freed only when its last holder lets it go. A freed page that holds a cached
block joins the cache's free LRU instead of the free stack; allocation takes
the free stack first, then evicts the least recently freed cached pages. The
buddy layout hands out whole blocks and has no cached variant.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.pool import PagedPool
from orca_jax.core.kv.prefix_cache import PrefixCache


class CachedPool(PagedPool):
    """A paged pool sharing its pages with `cache`.

    Args:
      cache: the prefix cache (sized for this pool).
      **shape: `PagedPool`'s arguments.
    """

    shares_pages = True

    def __init__(self, cache: PrefixCache, **shape: int) -> None:
        super().__init__(**shape)
        self.cache = cache

    @property
    def num_free(self) -> int:
        """Free pages: on the free stack, or cached and evictable."""
        return self._num_free + self.cache.num_free

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached

    @property
    def num_evictions(self) -> int:
        return self.cache.num_evictions

    def _take(self, count: int) -> NDArray[np.int32]:
        """`[count]` free pages: the free stack's first, then evicted cached ones."""
        stacked = min(count, self._num_free)
        pages = super()._take(stacked)
        if stacked == count:
            return pages
        return np.concatenate([pages, self.cache.evict(count - stacked)])

    def share(self, request: int, pages: NDArray[np.int32]) -> None:  # [h]
        """Request `request`, holding nothing, starts with these cached pages (a prefix
        hit): one more holder each; free ones leave the free pool."""
        if self.num_held[request]:
            raise RuntimeError(f"request {request} holds pages; only a new holder shares")
        if pages.size > self.max_pages_per_seq:
            raise RuntimeError("a request would exceed max_pages_per_seq")
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

    def _unhold(self, pages: NDArray[np.int32]) -> NDArray[np.int32]:  # [k] -> [u]
        """Drops one holder of each listed page (a page listed twice loses two). Cached
        pages left unheld join the cache's free LRU, each request's last page first;
        returns the uncached ones left unheld, for the free stack."""
        np.subtract.at(self.ref_count, pages, 1)
        unheld = pages[self.ref_count[pages] == 0]
        if unheld.size > 1:  # a page two leaving requests shared: once
            _, first = np.unique(unheld, return_index=True)
            unheld = unheld[np.sort(first)]
        cached = self.cache.is_cached[unheld]
        self.cache.release(unheld[cached][::-1])
        return unheld[~cached]

    def _free_pages(self) -> NDArray[np.int32]:
        """`[f]` every free page: the free stack's (uncached), then the cache's."""
        stacked = super()._free_pages()
        if self.cache.is_cached[stacked].any():
            raise AssertionError("a cached KV page is on the uncached free stack")
        return np.concatenate([stacked, self.cache.free_pages()])

    def check_consistency(self) -> None:
        """`PagedPool.check_consistency`, and the cache's names and free LRU agree."""
        self.cache.check_consistency()
        super().check_consistency()
