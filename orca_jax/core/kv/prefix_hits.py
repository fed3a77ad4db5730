"""The scheduler's side of prefix caching: admission lookups, sharing, and naming pages.

`PrefixHits` ties the request table and the `CachedPool` (with its
`PrefixCache`) together for the scheduler, which asks it four things: how many pages an
admission now would take from the cache (plan checks and the view: reads
only), to share them when it admits (`admit`), to name the pages its requests
filled in a step (`commit`), and to drop a finished request's names (`forget`).

An admission shares at most `(known - 1) // page_size` pages: the last known
token is never taken from the cache, since the step that computes it samples
the next token (vLLM's `get_computed_blocks` caps the hit at `num_tokens - 1`
the same way, so a fully cached prompt whose length is a multiple of the page
size recomputes its whole last page).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.cached_pool import CachedPool
from orca_jax.core.kv.prefix_cache import TokenReader
from orca_jax.core.requests.request_table import RequestTable

if TYPE_CHECKING:
    from orca_jax.core.kv.lower_tiers import LinkedTiers

_NONE: tuple[int, ...] = ()  # no page found on a slower tier


class _Memo(NamedTuple):
    """A request's last lookup, and the state of the caches it was made in."""

    version: int  # the prefix cache's version then (any change since makes it stale)
    known: int  # the request's known tokens then
    pages: list[int]  # its device hit
    lower: tuple[int, ...]  # the slower tier of each page after it, as long as found
    evictions: int  # the device cache's evictions then
    reorders: int  # the slower tiers' evictions and moves up then (`LinkedTiers`)
    page_array: NDArray[np.int64]  # [len(pages)] its device hit


class PrefixHits:
    """Prefix-cache lookups and updates for one scheduler.

    Args:
      table: the scheduler's request table.
      kv: its KV pool, sharing pages with its prefix cache.
      uses_planned_output: name generated pages by a request's planned answer
        (`Request.planned_output_tokens`) where it has one: the simulator's sampled ids
        are placeholders, and a conversation's next turn holds the planned ones.
    """

    def __init__(self, table: RequestTable, kv: CachedPool, *, uses_planned_output: bool) -> None:
        self._table = table
        self._kv = kv
        self._cache = cache = kv.cache
        # Every request's generated ids, request i's at [start[i], start[i] + output_len[i]):
        # one whole-array write per step, where a list per request costs a Python append each.
        self._start = np.concatenate([[0], np.cumsum(table.output_len)[:-1]])  # [N]
        self._generated = np.zeros(int(table.output_len.sum()), dtype=np.int32)  # [sum output]
        self._uses_planned_output = uses_planned_output
        self._page_size = cache.page_size
        # Requests without token ids (length-only workloads) never hit and are never named.
        self._has_tokens = np.array([spec.prompt_tokens is not None for spec in table.specs],
                                    dtype=np.bool_)  # [N]
        self._memo: dict[int, _Memo] = {}  # request -> its last lookup
        self.tiers: Optional["LinkedTiers"] = None  # slower tiers a hit may go on into
        self.load_s = 0.0  # stall of the loads admissions started (KVMemory.admit takes it)

    def reader(self, request: int) -> TokenReader:
        """Reads the request's known token ids, prompt then generated."""
        spec = self._table.specs[request]
        prompt = spec.prompt_tokens
        assert prompt is not None
        planned = spec.planned_output_tokens
        if self._uses_planned_output and planned is not None:
            answer = planned
        else:
            start = int(self._start[request])
            answer = self._generated[start:start + int(self._table.output_len[request])]

        size = prompt.size

        def read(start: int, end: int) -> NDArray[np.int32]:  # one page: O(page), not O(known)
            if end <= size:
                return prompt[start:end]
            tail = answer[max(start - size, 0):end - size]
            return tail if start >= size else np.concatenate([prompt[start:], tail])

        return read

    def lookup(self, request: int) -> list[int]:
        """The cached pages an admission of `request` now would share (reads only)."""
        return self._lookup(request)[0]

    def _lookup(self, request: int) -> tuple[list[int], tuple[int, ...]]:
        """The device pages an admission now would share, and the slower tier of each
        of its next pages found there (none without tiers; reads only)."""
        tiers = self.tiers
        # A swapped-out request comes back with its own pages, and a received one (a
        # migration, a handoff) waits holding them: neither shares a hit.
        if (not self._has_tokens[request] or (tiers is not None and tiers.tier_of[request])
                or self._kv.num_held[request]):
            return [], _NONE
        known = int(self._table.prompt_len[request] + self._table.num_generated[request])
        cache = self._cache
        memo = self._memo.get(request)
        if memo is not None and memo.known == known and memo.version == cache.version:
            return memo.pages, memo.lower
        num_pages = (known - 1) // self._page_size
        reader = self.reader(request)
        # Since the memo, with no eviction, its run is still cached (the cache only
        # gained pages): go on from its end instead of walking every page again.
        same = memo is not None and memo.known == known
        kept = same and memo.evictions == cache.num_evictions
        pages = cache.lookup(request, num_pages, reader, memo.pages if kept else None)
        lower = _NONE
        if tiers is not None and len(pages) < num_pages:
            names = cache.names(request, num_pages, reader)
            # Likewise below: a run that starts where it did, with no page of a slower
            # tier evicted or moved up since, goes on from its end (the device's
            # evictions only add pages there).
            on = (same and len(pages) == len(memo.pages)
                  and memo.reorders == tiers.num_reorders)
            lower = tuple(tiers.lower_hits(names[len(pages):],
                                           list(memo.lower) if on else None))
        self._memo[request] = _Memo(cache.version, known, pages, lower, cache.num_evictions,
                                    tiers.num_reorders if tiers is not None else 0,
                                    np.asarray(pages, dtype=np.int64))
        return pages, lower

    def hit_counts(self, ids: NDArray[np.int64],  # [n]
                   mask: NDArray[np.bool_], *, device_only: bool = False
                   ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """`([n] hit pages, [n] of those that take a free page)` of each request where
        `mask`, else 0. A page found on a slower tier is a hit that takes a free device
        page (it is loaded into one); `device_only` counts the device's hits alone."""
        hits = np.zeros(ids.size, dtype=np.int64)
        free = np.zeros(ids.size, dtype=np.int64)
        ref_count = self._kv.ref_count
        memos = self._memo
        for k in np.flatnonzero(mask).tolist():
            request = int(ids[k])
            pages, lower = self._lookup(request)
            if pages:
                hits[k] = len(pages)
                free[k] = int(np.count_nonzero(ref_count[memos[request].page_array] == 0))
            if lower and not device_only:
                hits[k] += len(lower)
                free[k] += len(lower)
        return hits, free

    def hit_pages(self, ids: NDArray[np.int64]) -> NDArray[np.int32]:  # [a] -> [h]
        """The distinct pages admissions of these requests now would share."""
        pages = [page for request in ids.tolist() for page in self.lookup(request)]
        return np.unique(np.asarray(pages, dtype=np.int32))

    def free_hit_overcount(self, ids: NDArray[np.int64],  # [a]
                           hit: NDArray[np.int32]) -> int:  # [h] from hit_pages(ids)
        """Free hit pages counted more than once when each admission counts its own."""
        if hit.size == 0:
            return 0
        _, free = self.hit_counts(ids, np.ones(ids.size, dtype=np.bool_), device_only=True)
        return int(free.sum()) - int(np.count_nonzero(self._kv.ref_count[hit] == 0))

    def admit(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [a] -> [a]
        """Shares each admitted request's hit (all before any allocation, so no admission
        evicts another's hit). Returns the tokens each took from the cache."""
        cached = np.zeros(ids.size, dtype=np.int64)
        loads = []
        for k, request in enumerate(ids.tolist()):
            pages, lower = self._lookup(request)
            if pages:
                self._kv.share(request, np.asarray(pages, dtype=np.int32))
            self._cache.start(request, len(pages))
            cached[k] = (len(pages) + len(lower)) * self._page_size
            if lower:
                loads.append((request, len(pages), lower))
        if loads and self.tiers is not None:  # after sharing: a load's evictions spare hits
            for request, shared, lower in loads:
                names = self._cache.names(request, shared + len(lower), self.reader(request))
                self.load_s += self.tiers.load(names[shared:], lower, into=(request, shared))
        return cached

    def prefetch(self, ids: NDArray[np.int64]) -> None:  # [a] just queued
        """Starts the pages of these requests' hits found below the host tier towards it."""
        assert self.tiers is not None
        for request in ids.tolist():
            pages, lower = self._lookup(request)
            if any(tier > 1 for tier in lower):
                names = self._cache.names(request, len(pages) + len(lower),
                                          self.reader(request))
                self.tiers.prefetch(names[len(pages):], lower)

    def generated(self, request: int) -> NDArray[np.int32]:  # [num_generated]
        """The token ids `request` generated here so far (a copy, for its export)."""
        start = int(self._start[request])
        return self._generated[start:start + int(self._table.num_generated[request])].copy()

    def receive(self, request: int, tokens: NDArray[np.int32]) -> None:  # [g]
        """Keeps the token ids a received request generated elsewhere, so that its pages
        are named by them here (its table row counts them). Its names and memo start
        afresh: `commit` names every full page it holds at its next step."""
        start = int(self._start[request])
        self._generated[start:start + tokens.size] = tokens
        self.forget(np.array([request], dtype=np.int64))

    def record(self, sampled: NDArray[np.int64],  # [s] just sampled, counted in the table
               tokens: NDArray[np.int32]) -> None:  # [s]
        """Keeps the tokens just sampled (the table's `num_generated` already counts them)."""
        self._generated[self._start[sampled] + self._table.num_generated[sampled] - 1] = tokens

    def record_span(self, sampled: NDArray[np.int64],  # [s]
                    tokens: NDArray[np.int32]) -> None:  # [c, s]
        """`record` of `c` steps at once, step by step (the table counts all of them)."""
        last = self._start[sampled] + self._table.num_generated[sampled] - 1  # [s]
        steps = np.arange(tokens.shape[0] - 1, -1, -1)[:, None]  # [c, 1] steps before the last
        self._generated[last[None, :] - steps] = tokens

    def commit(self, ids: NDArray[np.int64]) -> None:  # [n] just computed
        """Names the pages these requests filled (before any of them frees its pages)."""
        full = self._table.num_computed[ids] // self._page_size  # [n]
        grew = (full > self._cache.num_committed[ids]) & self._has_tokens[ids]
        if not grew.any():
            return
        kv = self._kv
        for request, num_full in zip(ids[grew].tolist(), full[grew].tolist()):
            self._cache.commit(request, kv.page_table[kv.row_of[request], :num_full],
                               self.reader(request))

    def forget(self, ids: NDArray[np.int64]) -> None:  # [f] finished
        """Drops finished requests' page names (their cached pages stay cached)."""
        for request in ids.tolist():
            self._cache.forget(request)
            self._memo.pop(request, None)
