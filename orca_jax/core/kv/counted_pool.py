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

from typing import NoReturn

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

    # `PagedPool.allocate`, `allocate_steps` and `allocate_next_pages` count, check and
    # write `num_held`; what they would place in the page table is only taken off the
    # free total here.
    def _place(self, ids: NDArray[np.int64], need: NDArray[np.int64],  # [g], [g]
               held: NDArray[np.int64], total: int) -> None:  # [g]
        self._num_free -= total

    def _place_steps(self, ids: NDArray[np.int64], need: NDArray[np.int64],  # [n], [k, n]
                     grants: NDArray[np.int64], held: NDArray[np.int64],  # [n], [n]
                     total: int) -> None:
        self._num_free -= total

    def _place_next(self, ids: NDArray[np.int64], held: NDArray[np.int64],  # [g], [g]
                    total: int) -> None:
        self._num_free -= total

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
