"""The one capacity question: what a plan's KV needs, and whether the pool can give it.

The core's plan check (`plan_checks`), the rejection of impossible requests
before a run (`admission`), the disaggregated handoff, and every policy through
`SchedulerView` ask a `KVCapacity`, so they never disagree. It knows the
watermark (free pages an admission must leave, vLLM v0's), each request's
reservation at admission (`Policy.kv_reservation`), the pool's layout (through
the `KVPool`: a buddy pool rounds a fresh request's pages up to its block and
needs a free block of each size) and, in `CachedCapacity`, prefix-cache hits
(an admission starts past its hit; a free page several admissions hit is taken
once).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.pool import KVPool, PagedPool
from orca_jax.core.kv.prefix_hits import PrefixHits
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import RequestTable

_WAITING = int(RequestState.WAITING)  # a plain int: IntEnum lookups cost on the hot path
_AWAY = int(RequestState.ROUTED_AWAY)
_add_reduce = np.add.reduce


def reservation_tokens(mode: str, table: RequestTable, max_model_len: int
                       ) -> NDArray[np.int64]:  # [N]
    """`[N]` tokens each request's admission reserves under `kv_reservation` `mode`."""
    total = table.prompt_len + table.output_len
    if mode == "none":
        return np.zeros(len(table), dtype=np.int64)
    if mode == "exact":
        return total
    if mode == "pow2":
        return np.minimum(2 ** np.ceil(np.log2(np.maximum(total, 1))).astype(np.int64),
                          max_model_len)
    return np.full(len(table), max_model_len, dtype=np.int64)  # "max"


def pool_rule_broken(total_needed: int, available: int, watermark: int, *, admitting: bool,
                     blocks_fit: bool = True, freed: int = 0,
                     block_sizes: Optional[list[int]] = None) -> Optional[tuple[str, str]]:
    """`(rule, detail)` if taking `total_needed` pages from `available` breaks the KV
    rule (`kv_pages`, or `kv_watermark` when the step admits a request); None if not.

    The one KV rule: `KVCapacity` asks it of each plan (`rule_broken`) and, before
    the run, of each request alone in the empty pool with its whole context
    (`refusals`), so a request that is not rejected up front can always be
    admitted once the pool drains.
    """
    if total_needed > available:
        return ("kv_pages", f"the plan needs {total_needed} new KV pages, {available} are free"
                + (f" (counting {freed} freed by preemption)" if freed else ""))
    if not blocks_fit:
        return ("kv_pages", f"no free contiguous blocks of {block_sizes} KV "
                f"pages ({available} pages free in smaller blocks; buddy layout)")
    if watermark and admitting and available - total_needed < watermark:
        return ("kv_watermark", f"admitting leaves {available - total_needed} free pages, "
                f"below the watermark of {watermark}")
    return None


class KVCapacity:
    """Answers the capacity question for one scheduler (no prefix caching).

    Args:
      table: the scheduler's request table.
      pool: its KV pool.
      reservation: the policy's `kv_reservation`.
      reserve_tokens: `[N]` from `reservation_tokens`.
      watermark_pages: free pages an admission must leave.
    """

    def __init__(self, table: RequestTable, pool: KVPool, *, reservation: str,
                 reserve_tokens: NDArray[np.int64], watermark_pages: int) -> None:
        self._table = table
        self._pool = pool
        self._reserves = reservation != "none"
        self._reserve_tokens = reserve_tokens  # [N]
        self.watermark_pages = watermark_pages
        # Pages requests in a step in flight need for their next token, which an admission
        # must leave too: set by a pipeline's executor (`orca_jax.core.loop.pipeline`), so
        # micro-batches admitted beside them cannot take the pages they come back for.
        # 0 otherwise.
        self.held_back_pages = 0
        # Whether `pages_needed` counts exactly what the step's allocation takes (no page
        # reserved at admission, no hit shared): the plan check's count is then reused.
        self.needed_is_allocation = not self._reserves
        # Whether summing each request's `pages_needed` against `room` answers `kv_fits`
        # (no blocks to place, no free hit page counted once for several admissions).
        self.totals_decide = pool.totals_decide
        # Whether `cached_tokens` can be other than 0 (prefix caching): the plan check
        # skips asking it, and subtracting its zeros, on every step otherwise.
        self.counts_hits = False
        # Whether `pages_for_context` is the pool's `pages_needed` as it is (no
        # reservation, no hits): `pages_needed`, asked several times a step, asks the
        # pool directly.
        self._plain = not self._reserves
        # Whether `admission_needs` may count in Python ints: plain, and the pool counts a
        # request's pages as the paged layout does (`PagedPool.pages_needed_of` then
        # answers as its `pages_needed`).
        self._counts_in_ints = self._plain and type(pool).pages_needed is PagedPool.pages_needed

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """New pages to run `tokens` of each request now (admissions reserve first)."""
        if self._plain:  # the pool's count of the context, without a call between
            return self._pool.pages_needed(ids, self._table.num_computed[ids] + tokens)
        return self.pages_for_context(ids, self._table.num_computed[ids] + tokens)

    def pages_for_context(self, ids: NDArray[np.int64],  # [n]
                          target: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """`pages_needed` given each request's context after the step (`target`: its
        `num_computed` plus the tokens), for a caller that has read `num_computed`
        already (the plan check: it reads it for the uncomputed counts too)."""
        if self._reserves:
            admitting = self._table.state[ids] == _WAITING
            target = np.where(admitting, np.maximum(target, self._reserve_tokens[ids]), target)
        return self._pool.pages_needed(ids, target)

    def cached_tokens(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens an admission of each request now would take from the prefix cache."""
        return np.zeros(ids.size, dtype=np.int64)

    def uncomputed_and_pages(self, ids: NDArray[np.int64]  # [n]
                             ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:  # [n], [n]
        """`(num_uncomputed(ids), pages_needed(ids, num_uncomputed(ids)))`: what each
        request has left to compute and the new pages to compute all of it now. Where
        nothing is reserved or hit, its context after those tokens is the tokens it knows
        (`prompt_len + num_generated`), read once for both."""
        table = self._table
        if self._plain:
            known = table.prompt_len[ids] + table.num_generated[ids]  # [n]
            return known - table.num_computed[ids], self._pool.pages_needed(ids, known)
        uncomputed = table.num_uncomputed(ids)  # [n]
        return uncomputed, self.pages_needed(ids, uncomputed)

    def admission_needs(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """For each of a few requests (a list), what its admission now would compute and
        take: `(num_uncomputed - cached_tokens, pages_needed of those tokens)`, as lists of
        Python ints, the same integers as the arrays' `tolist()`.

        Where nothing is reserved or hit and pages are counted as the paged layout counts
        them, in Python ints (`PagedPool.pages_needed_of`): on the few requests at the head
        of a queue, each numpy call costs more than the whole loop. The uncomputed tokens
        end at the known ones (`prompt_len + num_generated`), so the pages are those of
        the known tokens.
        """
        table = self._table
        if self._counts_in_ints:
            prompt, generated, computed = table.prompt_len, table.num_generated, table.num_computed
            pages_of = self._pool.pages_needed_of
            wants, pages = [], []
            for request in ids:
                known = prompt.item(request) + generated.item(request)
                wants.append(known - computed.item(request))
                pages.append(pages_of(request, known))
            return wants, pages
        array = np.array(ids, dtype=np.int64)  # [c]
        uncached = table.num_uncomputed(array)  # [c]
        if self.counts_hits:
            uncached = uncached - self.cached_tokens(array)
        return uncached.tolist(), self.pages_needed(array, uncached).tolist()

    def reserved_tokens(self, ids: NDArray[np.int64],  # [n]
                        tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """`[n]` tokens whose pages each request's admission holds once it has `tokens`
        known: its reservation (`kv_reservation`), if larger. A transfer into this pool
        takes these pages up front, so the request's admission takes none: a received
        request waiting for its reservation's rest could hold pages that nothing frees."""
        return np.maximum(tokens, self._reserve_tokens[ids]) if self._reserves else tokens

    def pool_demand(self, ids: NDArray[np.int64],  # [n]
                    needed: NDArray[np.int64],  # [n] from pages_needed
                    preempt: NDArray[np.int64]) -> tuple[int, int]:  # [p]
        """(pages the plan takes from the free pool, pages its preemptions free)."""
        return (int(_add_reduce(needed)),  # the ufunc: `sum` adds a Python frame
                int(self._pool.num_held[preempt].sum()) if preempt.size else 0)

    def rule_broken(self, ids: NDArray[np.int64],  # [n]
                    needed: NDArray[np.int64],  # [n] from pages_needed
                    preempt: NDArray[np.int64],  # [p]
                    admitting: Optional[bool] = None,
                    total_needed: Optional[int] = None) -> Optional[tuple[str, str]]:
        """`(rule, detail)` of the KV rule that running `ids` (after preempting `preempt`)
        breaks: `kv_pages` or `kv_watermark`; None if the KV fits. Reads only.
        `admitting`: whether one of `ids` is waiting, and `total_needed`: `needed`
        summed, if the caller knows."""
        if self.totals_decide and not preempt.size and admitting is not None:
            # Most plans (the plan check's, every step): the total alone decides (the
            # blocks fit), nothing is freed first, and `pool_demand` is the sum: the one
            # rule asked at once, without the general path's calls.
            if total_needed is None:
                total_needed = int(_add_reduce(needed))
            return pool_rule_broken(total_needed, self._pool.num_free,
                                    self.watermark_pages + self.held_back_pages,
                                    admitting=admitting)
        total_needed, freed = self.pool_demand(ids, needed, preempt)
        available = self._pool.num_free + freed
        if admitting is None:
            admitting = bool((self._table.state[ids] == _WAITING).any())
        # The total is not always enough: a buddy pool needs a free block per admission.
        blocks_fit = not total_needed or self._pool.blocks_fit(ids, needed, preempt)
        return pool_rule_broken(total_needed, available,
                                self.watermark_pages + self.held_back_pages, admitting=admitting,
                                blocks_fit=blocks_fit, freed=freed,
                                block_sizes=None if blocks_fit else needed[needed > 0].tolist())

    def kv_fits(self, ids: NDArray[np.int64],  # [n]
                tokens: NDArray[np.int64],  # [n]
                preempt: NDArray[np.int64]) -> bool:  # [p]
        """Whether the pool can give the KV to run `tokens` of each of `ids`, all
        together, now, after preempting `preempt` (`rule_broken` is None)."""
        return self.rule_broken(ids, self.pages_needed(ids, tokens), preempt) is None

    def room(self, free_pages: Union[int, NDArray[np.int64], None] = None, *,
             admitting: bool = True) -> Union[int, NDArray[np.int64]]:
        """Pages a plan may take from `free_pages` free pages (default: the pool's free
        pages now), elementwise: less the watermark when the plan admits a request."""
        free = self._pool.num_free if free_pages is None else free_pages
        return free - (self.watermark_pages + self.held_back_pages) if admitting else free

    def refusals(self, total_tokens: NDArray[np.int64]  # [N]
                 ) -> tuple[NDArray[np.int64], dict[int, str]]:
        """Each request alone in the empty pool with its whole context (`total_tokens`,
        or its reservation if larger): `([N] pages it takes, {pages: reason})` for the
        page counts the KV rule refuses (asked once per distinct count)."""
        pool, watermark = self._pool, self.watermark_pages
        pages = pool.pages_taken(pool.pages_for_tokens(
            np.maximum(total_tokens, self._reserve_tokens)))  # [N]
        refused: dict[int, str] = {}
        for count in np.unique(pages).tolist():
            broken = pool_rule_broken(count, pool.num_kv_pages, watermark, admitting=True,
                                      blocks_fit=count <= pool.largest_block,
                                      block_sizes=[count])
            if broken is None:
                continue
            if broken[0] == "kv_watermark":
                refused[count] = (f"needs {count} KV pages, the pool has "
                                  f"{pool.num_kv_pages - watermark} beside the watermark of "
                                  f"{watermark}")
            elif pool.largest_block < count and pool.largest_block < pool.num_kv_pages:
                refused[count] = (f"needs {count} KV pages, the pool has {pool.largest_block} "
                                  "in its largest buddy block")
            else:
                refused[count] = f"needs {count} KV pages, the pool has {pool.num_kv_pages}"
        return pages, refused


class KVBudget:
    """A plan's KV built one request at a time (a greedy admission loop): `take` answers
    whether the plan so far and one more request fit, as `KVCapacity.kv_fits` of the
    whole plan would, in O(1) where page totals decide it (`totals_decide`), else by
    asking the whole plan (a buddy pool's blocks, prefix-cache hits several admissions
    share).

    Args:
      capacity: the scheduler's capacity question.
      ids: `[n]` the plan so far (running requests, say), whose new pages are counted
        by the whole question only: `room` starts at the pages admissions may take.
      num_tokens: `[n]` their tokens.
    """

    def __init__(self, capacity: KVCapacity, ids: Sequence[int],
                 num_tokens: Sequence[int]) -> None:
        self._capacity = capacity
        self._ids = list(ids)
        self._tokens = list(num_tokens)
        self.room = int(capacity.room())  # pages the admissions taken so far left

    def take(self, request: int, num_tokens: int) -> bool:
        """Adds `request` with `num_tokens` tokens if the plan then still fits (its pages
        within `room`, and the whole question where totals do not decide); False leaves
        the budget as it was."""
        capacity = self._capacity
        pages = int(capacity.pages_needed(np.array([request], dtype=np.int64),
                                          np.array([num_tokens], dtype=np.int64))[0])
        if pages > self.room:
            return False
        if not capacity.totals_decide and not capacity.kv_fits(
                np.array(self._ids + [request], dtype=np.int64),
                np.array(self._tokens + [num_tokens], dtype=np.int64),
                np.zeros(0, dtype=np.int64)):
            return False
        self._ids.append(request)
        self._tokens.append(num_tokens)
        self.room -= pages
        return True


class CachedCapacity(KVCapacity):
    """`KVCapacity` with prefix caching: an admission's tokens start past its hit.

    Args:
      hits: the scheduler's prefix-cache lookups (over the same pool).
      **kwargs: `KVCapacity`'s arguments.
    """

    def __init__(self, table: RequestTable, pool: KVPool, hits: PrefixHits, **kwargs) -> None:
        super().__init__(table, pool, **kwargs)
        self._hits = hits
        self._page_size = pool.page_size
        self.needed_is_allocation = False
        self.totals_decide = False  # a free page several admissions hit is taken once
        self.counts_hits = True
        self._plain = self._counts_in_ints = False

    def pages_for_context(self, ids: NDArray[np.int64],  # [n]
                          target: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """An admission needs the pages past its hit, plus each hit page that is free
        now (sharing takes it out of the free pool)."""
        table = self._table
        admitting = table.state[ids] == _WAITING
        hit_pages = free_hits = None
        if admitting.any():
            hit_pages, free_hits = self._hits.hit_counts(ids, admitting)
            target = target + hit_pages * self._page_size
        if self._reserves:
            target = np.where(admitting, np.maximum(target, self._reserve_tokens[ids]), target)
        needed = self._pool.pages_needed(ids, target)
        if hit_pages is None:
            return needed
        return needed - hit_pages + free_hits

    def cached_tokens(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """0 for a request running or done; a request not held here counts as if it
        were sent here (a cache-aware router asks every replica)."""
        state = self._table.state[ids]
        return self._hits.hit_counts(ids, (state <= _WAITING) | (state == _AWAY))[0] * (
            self._page_size)

    def pool_demand(self, ids: NDArray[np.int64],  # [n]
                    needed: NDArray[np.int64],  # [n] from pages_needed
                    preempt: NDArray[np.int64]) -> tuple[int, int]:  # [p]
        """`needed.sum()` counts a free page that several admissions hit once for each;
        the pool gives it once. A page freed by preemption that an admission hits is
        taken again at once, so it counts on neither side."""
        admitted = ids[self._table.state[ids] == _WAITING]
        if admitted.size == 0 and preempt.size == 0:  # most steps: nothing shared is taken
            return int(needed.sum()), 0
        hit = self._hits.hit_pages(admitted)  # [h] distinct
        overcount = self._hits.free_hit_overcount(admitted, hit)
        freed = self._pool.num_freed_by(preempt, hit) if preempt.size else 0
        return int(needed.sum()) - overcount, freed
