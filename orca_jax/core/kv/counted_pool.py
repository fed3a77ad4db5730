"""A paged pool that counts pages and keeps no page table: for runs nothing reads pages in.

On the paged layout, which pages a request holds never changes a decision or a
price: admission, growth, preemption and the step's cost see only how many each
request holds (`num_held`) and how many are free (`num_free`). Only readers of
page identities need more: a prefix cache (shared pages), slower KV tiers and
swapping (copies of a request's pages), a KV handoff or migration, an engine
that reads the step descriptor's page rows, and `pages_of`. Where none of these
can happen (`KVMemory.build` decides: `counts_only`), a `CountedPool` answers
every question a `PagedPool` does from two counts, with none of the free stack,
reference counts and page-table rows that `PagedPool` writes each step.

Its page-reading attributes (`page_table`, `row_of`, `ref_count`, `pages_of`)
raise with one line instead of returning pages it never kept.
"""

from __future__ import annotations

from typing import NoReturn, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.pool import PagedPool

_ZERO = np.array(0, dtype=np.int64)


def _no_pages(what: str) -> NoReturn:
    raise RuntimeError(f"KV pool: {what} read from a counts-only pool (CountedPool keeps "
                       "no pages; build the run's KV memory with counts_only=False)")


class CountedPool(PagedPool):
    """A `PagedPool`'s counts alone: `num_held` per request and the free total.

    Args:
      **shape: `PagedPool`'s arguments.
    """

    def __init__(self, **shape: int) -> None:  # no PageTable.__init__: no table to hold
        self._set_shape(**shape)
        self._num_free = self.num_kv_pages

    @property
    def page_table(self) -> NoReturn:  # type: ignore[override]
        _no_pages("page_table")

    @property
    def row_of(self) -> NoReturn:  # type: ignore[override]
        _no_pages("row_of")

    @property
    def ref_count(self) -> NoReturn:  # type: ignore[override]
        _no_pages("ref_count")

    def pages_of(self, request: int) -> NoReturn:
        _no_pages(f"pages_of({request})")

    def allocate(self, ids: NDArray[np.int64],  # [n] distinct
                 target_tokens: NDArray[np.int64],  # [n]
                 need: Optional[NDArray[np.int64]] = None) -> None:  # [n]
        """`PagedPool.allocate`'s counts and checks: each of `ids` grows to hold
        `target_tokens` (`need`: `pages_needed(ids, target_tokens)`, if known)."""
        if need is None:
            need = self.pages_needed(ids, target_tokens)
        growing_at = need.nonzero()[0]  # [g]
        if growing_at.size == 0:
            return
        if growing_at.size < need.size:
            ids, need = ids[growing_at], need[growing_at]
        total = sum(need.tolist())
        grown = self.num_held[ids] + need  # [g]
        self._check_grant(total, max(grown.tolist()))
        self._num_free -= total
        self.num_held[ids] = grown

    def allocate_steps(self, ids: NDArray[np.int64],  # [n] distinct
                       need: NDArray[np.int64]) -> None:  # [k, n]
        """`PagedPool.allocate_steps`' counts and checks (a leap's `k` steps at once)."""
        grants = need.sum(axis=0)  # [n]
        total = int(grants.sum())
        if total == 0:
            return
        grown = self.num_held[ids] + grants  # [n]
        self._check_grant(total, int(grown.max()))
        self._num_free -= total
        self.num_held[ids] = grown

    def allocate_next_pages(self, ids: NDArray[np.int64]) -> None:  # [g] distinct
        """A short leap's pages, one for each of `ids`: `PagedPool.allocate_next_pages`'
        counts and checks."""
        total = ids.size
        if total == 0:
            return
        held = self.num_held[ids]  # [g]
        self._check_grant(total, max(held.tolist()) + 1)
        self._num_free -= total
        held += 1
        self.num_held[ids] = held

    def free(self, ids: NDArray[np.int64]) -> None:  # [n] distinct
        """Gives back every page of these requests."""
        held = self.num_held[ids]  # [n]
        self._num_free += sum(held.tolist())
        self.num_held[ids] = _ZERO

    def trim(self, ids: NDArray[np.int64],  # [n] distinct
             num_tokens: NDArray[np.int64]) -> int:  # [n]
        """Gives back each request's pages past those its first `num_tokens` tokens fill;
        returns how many."""
        keep = self.pages_for_tokens(num_tokens)  # [n]
        held = self.num_held[ids]  # [n]
        kept = np.minimum(held, keep)  # [n]
        freed = int(held.sum() - kept.sum())
        self.num_held[ids] = kept
        self._num_free += freed
        return freed

    def check_consistency(self) -> None:
        """Asserts that the counts add up: no request holds a negative number of pages,
        and the held and free pages are the pool (tests)."""
        if (self.num_held < 0).any() or self._num_free < 0:
            raise AssertionError("a KV page count is negative")
        if int(self.num_held.sum()) + self._num_free != self.num_kv_pages:
            raise AssertionError("KV pages leaked or double-counted")
