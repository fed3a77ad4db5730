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
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


class KVPageManager:
    """Pages and page-table rows for up to `num_requests` requests.

    Args:
      num_kv_pages: usable pages in the pool (the null page is extra).
      page_size: tokens per page.
      max_pages_per_seq: page-table width (max context / page size, rounded up).
      num_requests: number of request indices this manager tracks.
    """

    def __init__(self, *, num_kv_pages: int, page_size: int, max_pages_per_seq: int,
                 num_requests: int) -> None:
        if num_kv_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(f"KV pool needs num_kv_pages, page_size and max_pages_per_seq >= 1, "
                             f"got {num_kv_pages}, {page_size}, {max_pages_per_seq}")
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
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_kv_pages - self._num_free

    def pages_for_tokens(self, num_tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """Pages needed to hold `num_tokens` tokens, elementwise. `[n] -> [n]`."""
        return -(-num_tokens // self.page_size)

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     target_tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """New pages each request needs to hold `target_tokens` tokens. Returns `[n]`."""
        return np.maximum(self.pages_for_tokens(target_tokens) - self.num_held[ids], 0)

    def allocate(self, ids: NDArray[np.int64],  # [n] distinct
                 target_tokens: NDArray[np.int64]) -> None:  # [n]
        """Grows each request's pages to hold `target_tokens`; the caller checked capacity."""
        need = self.pages_needed(ids, target_tokens)
        total = int(need.sum())
        if total == 0:
            return
        if total > self._num_free:
            raise RuntimeError(f"KV pool overcommitted: {total} pages asked, {self._num_free} free")
        if int((self.num_held[ids] + need).max()) > self.max_pages_per_seq:
            raise RuntimeError("a request would exceed max_pages_per_seq")
        growing = ids[need > 0]
        need = need[need > 0]
        self._assign_rows(growing)
        pages = self._free[self._num_free - total:self._num_free][::-1]
        self._num_free -= total
        rows = np.repeat(self.row_of[growing], need)
        starts = np.repeat(self.num_held[growing], need)
        within = np.arange(total) - np.repeat(np.cumsum(need) - need, need)
        self.page_table[rows, starts + within] = pages
        self.num_held[growing] += need

    def free(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Returns every page of these requests to the pool and releases their rows."""
        held_ids = ids[self.num_held[ids] > 0]
        if held_ids.size:
            rows = self.row_of[held_ids]
            held = self.num_held[held_ids]
            mask = np.arange(self.max_pages_per_seq)[None, :] < held[:, None]
            pages = self.page_table[rows][mask]
            self._free[self._num_free:self._num_free + pages.size] = pages[::-1]
            self._num_free += pages.size
            self.page_table[rows] = 0
            self.num_held[held_ids] = 0
        with_rows = ids[self.row_of[ids] >= 0]
        if with_rows.size:
            self._free_rows.extend(self.row_of[with_rows].tolist())
            self.row_of[with_rows] = -1

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
        """Asserts that every page is either free or owned by exactly one request (tests)."""
        owned = [self.pages_of(int(i)) for i in np.flatnonzero(self.num_held)]
        all_pages = np.concatenate(owned + [self._free[:self._num_free]])
        if all_pages.size != self.num_kv_pages or not np.array_equal(
                np.sort(all_pages), np.arange(1, self.num_kv_pages + 1)):
            raise AssertionError("KV pages leaked or double-owned")
