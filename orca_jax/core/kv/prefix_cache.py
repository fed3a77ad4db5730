"""Prefix caching: full KV pages named by their content, found again by later requests.

As vLLM v1's prefix cache (`vllm/v1/core/kv_cache_utils.py`, `block_pool.py`):
a *full* page of a request's known tokens (prompt and generated alike, so a
later conversation turn finds the earlier turn's answer) is named by a hash
chained over its parent page's hash and its own token ids, so equal names mean
equal token prefixes and hence equal K/V. The cache maps names to the pages
that hold them. A cached page whose last user is gone is *free* but stays
findable, in a least-recently-freed order, until the pool needs it for new
tokens (an eviction drops its name). `CachedPool` owns the reference counts
and the free pool; this module owns the names and the free cached pages.

The hash is blake2b (16 bytes) over the parent's digest and the page's int32
token bytes: deterministic across processes (Python's `hash` of bytes is salted
per process, and its tuple hash is a weak 64-bit mix), collision-resistant (a
collision would silently hand a request another prefix's K/V), and a C call of
about a microsecond per page. A request's names are computed once, as its
pages fill or when it is first looked up, and kept while it lives.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Optional

import numpy as np
from numpy.typing import NDArray

ROOT_HASH = b""  # the parent of a request's first page

# (start, end) -> the request's known tokens [end - start] int32 (prompt, then generated).
TokenReader = Callable[[int, int], NDArray[np.int32]]


def hash_page(parent: bytes, tokens: NDArray[np.int32]) -> bytes:  # tokens: [page_size]
    """The name of a full page: its parent page's name chained with its token ids."""
    return hashlib.blake2b(parent + np.ascontiguousarray(tokens, dtype=np.int32).tobytes(),
                           digest_size=16).digest()


class PrefixCache:
    """Page names, the cached pages by name, and the free cached pages (LRU).

    Args:
      num_kv_pages: pages in the pool (page 0, the null page, is never cached).
      page_size: tokens per page.
      num_requests: request indices tracked.
    """

    def __init__(self, *, num_kv_pages: int, page_size: int, num_requests: int) -> None:
        self.page_size = page_size
        self._names: list[list[bytes]] = [[] for _ in range(num_requests)]
        self._page_of: dict[bytes, int] = {}  # name -> the page holding it
        self._name_of: dict[int, bytes] = {}  # page -> its name
        self.is_cached = np.zeros(num_kv_pages + 1, dtype=np.bool_)  # [pages + 1]
        # Free cached pages, least recently freed first (the next to evict).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_committed = np.zeros(num_requests, dtype=np.int64)  # [N] row pages examined
        self.num_evictions = 0
        self.version = 0  # changes whenever a name is cached or evicted (lookups' memo key)
        # With slower KV tiers (`lower_tiers.LinkedTiers`): told the names evicted
        # (write-back) and the names just filled (write-through), with their device pages
        # (an engine's host tier copies them). None without tiers.
        self.spill: Optional[Callable[[list[bytes], NDArray[np.int32]], None]] = None
        self.fill: Optional[Callable[[list[bytes], NDArray[np.int32]], None]] = None

    @property
    def num_cached(self) -> int:
        """Pages that hold a cached block, in use or free."""
        return len(self._page_of)

    @property
    def num_free(self) -> int:
        """Free pages that still hold a cached block (evictable)."""
        return len(self._free)

    def bump_version(self) -> None:
        """Lookups' memos are stale (a slower tier cached or evicted a page)."""
        self.version += 1

    def names(self, request: int, num_pages: int, tokens: TokenReader) -> list[bytes]:
        """The names of the request's first `num_pages` full pages (computed once each)."""
        names = self._names[request]
        while len(names) < num_pages:
            self._name_next(names, tokens)
        return names[:num_pages]

    def _name_next(self, names: list[bytes], tokens: TokenReader) -> None:
        """Appends the name of the page after `names` (a request's names so far)."""
        start = len(names) * self.page_size
        names.append(hash_page(names[-1] if names else ROOT_HASH,
                               tokens(start, start + self.page_size)))

    def lookup(self, request: int, num_pages: int, tokens: TokenReader,
               pages: Optional[list[int]] = None) -> list[int]:
        """The pages of the longest cached run of the request's first `num_pages` pages;
        `pages`: a run found for it before, to go on from (a new list is returned).
        Only an eviction can break a run (`num_evictions`), so with none since, the
        run found then is still cached.

        Reads only: a rejected plan's lookups leave the cache as it was.
        """
        pages = [] if pages is None else list(pages)
        page_of = self._page_of
        names = self._names[request]
        for k in range(len(pages), num_pages):
            if k == len(names):  # name pages lazily: a miss ends the walk early
                self._name_next(names, tokens)
            page = page_of.get(names[k])
            if page is None:
                break
            pages.append(page)
        return pages

    def commit(self, request: int, row: NDArray[np.int32],  # [num_full] the row's pages
               tokens: TokenReader) -> None:
        """Names the request's newly full pages (`row` is its page-table row up to its
        last full page) and caches each whose name is not cached yet.

        A page whose name another page already holds (two requests computed the same
        prefix at once) stays private: one page per name keeps eviction exact.
        """
        first = int(self.num_committed[request])
        names = self.names(request, row.size, tokens)
        for k in range(first, row.size):
            name, page = names[k], int(row[k])
            if name not in self._page_of and not self.is_cached[page]:
                self._page_of[name] = page
                self._name_of[page] = name
                self.is_cached[page] = True
                self.version += 1
        self.num_committed[request] = row.size
        if self.fill is not None and row.size > first:
            self.fill(names[first:row.size], row[first:])

    def start(self, request: int, num_shared: int) -> None:
        """A request (re)starts holding `num_shared` shared pages: those are named."""
        self.num_committed[request] = num_shared

    def forget(self, request: int) -> None:
        """The request is done: drop its page names (its cached pages stay cached)."""
        self._names[request] = []
        self.num_committed[request] = 0

    def take(self, pages: NDArray[np.int32]) -> None:  # [k] free cached pages now in use
        """Takes free cached pages out of the free LRU (a hit is sharing them)."""
        for page in pages.tolist():
            del self._free[page]

    def release(self, pages: NDArray[np.int32]) -> None:  # [k] cached pages now unused
        """Cached pages whose last user left join the free LRU, in the given order."""
        for page in pages.tolist():
            self._free[page] = None

    def evict(self, count: int) -> NDArray[np.int32]:
        """Takes the `count` least recently freed cached pages and drops their names.

        Returns `[count]` pages, now uncached and owned by the caller.
        """
        pages = np.empty(count, dtype=np.int32)
        evicted = []
        for k in range(count):
            page, _ = self._free.popitem(last=False)
            name = self._name_of.pop(page)
            del self._page_of[name]
            evicted.append(name)
            pages[k] = page
        self.is_cached[pages] = False
        self.num_evictions += count
        self.version += 1
        if self.spill is not None:
            self.spill(evicted, pages)
        return pages

    def free_pages(self) -> NDArray[np.int32]:
        """`[f]` the free cached pages, least recently freed first (a copy)."""
        return np.fromiter(self._free, dtype=np.int32, count=len(self._free))

    def check_consistency(self) -> None:
        """Asserts that names and pages map one to one and the flags agree (tests)."""
        if len(self._page_of) != len(self._name_of) or any(
                self._name_of.get(page) != name for name, page in self._page_of.items()):
            raise AssertionError("prefix cache: names and pages do not map one to one")
        if not np.array_equal(np.flatnonzero(self.is_cached), np.sort(list(self._name_of))):
            raise AssertionError("prefix cache: is_cached disagrees with the cached pages")
        if not all(self.is_cached[page] for page in self._free):
            raise AssertionError("prefix cache: an uncached page is on the free LRU")
