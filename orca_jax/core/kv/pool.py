"""A KV pool: fixed-size pages on the device and a page table per running request.

Pages are numbered 1..num_kv_pages; page 0 is the null page that padding rows
write to, so the engine's cache holds `num_kv_pages + 1` pages. A running request
owns a row of the page table (`[max_pages_per_seq]` page numbers, 0 past the
pages it holds). Allocation is by target token count: a request that must hold
`t` tokens owns `ceil(t / page_size)` pages, so on-demand allocation (vLLM: grow
a page at a time) and reservation at admission (Orca: the whole context up
front) are the same call with a different target. Everything is vectorized over
request indices: in steady decode the per-step cost does not grow with Python
work per request.

`KVPool` is what the scheduler and the capacity question ask of a pool; each
layout is one implementation, and no code outside them branches on the layout:
`PagedPool` (any free page serves any request; here), `BuddyPool` (a request's
pages are one power-of-two block: `orca_jax.core.kv.buddy`) and `CachedPool`
(a paged pool whose pages a prefix cache shares: `orca_jax.core.kv.cached_pool`).
`make_pool` builds the one a run asks for; where nothing reads pages, `KVMemory.build`
builds a `CountedPool` instead (a paged pool's counts alone: `orca_jax.core.kv.counted_pool`).
"""

from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
from numpy.typing import NDArray

KV_LAYOUTS = ("paged", "buddy")
# 0, 1 and -1 as 0-d arrays, for whole-array writes and bounds (see `PageTable.__init__`).
_ZERO, _ONE, _NO_ROW = (np.array(value, dtype=np.int64) for value in (0, 1, -1))


class KVPool(Protocol):
    """The device's KV pages and the page table: what the core and the checks ask.

    Attributes:
      layout: the layout's name (`KV_LAYOUTS`), for messages and results only.
      totals_decide: whether the free total alone decides whether new pages fit (any
        free page serves any request); False where placement needs more (the buddy
        layout's blocks), so `blocks_fit` must be asked too.
      num_kv_pages, page_size, max_pages_per_seq: the pool's shape.
      num_held: `[N]` pages each request owns.
      row_of: `[N]` each request's page-table row, -1 for none.
      page_table: `[rows, max_pages_per_seq]` page numbers.
      ref_count: `[num_kv_pages + 1]` rows holding each page.
    """

    layout: str
    totals_decide: bool
    num_kv_pages: int
    page_size: int
    max_pages_per_seq: int
    num_held: NDArray[np.int64]
    row_of: NDArray[np.int64]
    page_table: NDArray[np.int32]
    ref_count: NDArray[np.int64]

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now."""
        ...

    @property
    def num_used(self) -> int:
        """Pages in use (a shared page once)."""
        ...

    @property
    def largest_block(self) -> int:
        """The most pages one request can ever take at once."""
        ...

    @property
    def num_cached(self) -> int:
        """Pages holding a cached prefix block, in use or free."""
        ...

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far."""
        ...

    def pages_for_tokens(self, num_tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """Pages that hold `num_tokens` tokens, elementwise. `[n] -> [n]`."""
        ...

    def pages_taken(self, num_pages: NDArray[np.int64]) -> NDArray[np.int64]:
        """Pages the pool gives a request holding none that needs `num_pages`. `[n] -> [n]`."""
        ...

    def pages_needed(self, ids: NDArray[np.int64],
                     target_tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """New pages each request needs to hold `target_tokens` tokens. `[n], [n] -> [n]`."""
        ...

    def blocks_fit(self, ids: NDArray[np.int64], pages: NDArray[np.int64],
                   freeing: Optional[NDArray[np.int64]] = None) -> bool:
        """Whether the layout can place `pages` new pages for each of `ids` (`[n]`, `[n]`)
        after `freeing` (`[f]`) go; the caller checks the total."""
        ...

    def allocate(self, ids: NDArray[np.int64], target_tokens: NDArray[np.int64],
                 need: Optional[NDArray[np.int64]] = None,
                 growing_at: Optional[NDArray[np.int64]] = None) -> None:
        """Grows each request's pages to hold `target_tokens` (`[n]`, `[n]`). `need`:
        `pages_needed(ids, target_tokens)`, and `growing_at`: `need.nonzero()[0]`
        (`[g]`, with `need`), if the caller has them."""
        ...

    def allocate_steps(self, ids: NDArray[np.int64], need: NDArray[np.int64]) -> None:
        """`allocate` of several steps one after another, at once (`[n]`, `[k, n]` pages
        each step takes); only layouts whose totals decide (`totals_decide`) have it."""
        ...

    def allocate_next_pages(self, ids: NDArray[np.int64]) -> None:
        """`allocate_steps` where no request takes two pages: one page for each of `ids`
        (`[g]`, distinct), in the order the steps take them; only layouts whose totals
        decide (`totals_decide`) have it."""
        ...

    def free(self, ids: NDArray[np.int64]) -> None:
        """Returns every page of these requests (`[n]`) and releases their rows."""
        ...

    def num_freed_by(self, ids: NDArray[np.int64],
                     kept: Optional[NDArray[np.int32]] = None) -> int:
        """Pages that become free if `ids` (`[n]`) let theirs go, but `kept` (`[k]`)."""
        ...

    def trim(self, ids: NDArray[np.int64], num_tokens: NDArray[np.int64]) -> int:
        """Frees each request's pages past those holding its first `num_tokens` tokens
        (`[n]`, `[n]`): a speculative step's rejected draft positions. Returns the pages
        freed (a layout that cannot give back part of a request's pages keeps them: 0)."""
        ...

    def pages_of(self, request: int) -> NDArray[np.int32]:
        """The pages `request` holds, in order (a copy). `-> [held]`."""
        ...

    def check_consistency(self) -> None:
        """Asserts that every page is free or in use, never both (tests)."""
        ...


class PageTable:
    """The page-table rows of up to `num_requests` requests (shared by every layout).

    Args:
      num_kv_pages: usable pages in the pool (the null page is extra).
      page_size: tokens per page.
      max_pages_per_seq: page-table width (max context / page size, rounded up).
      num_requests: number of request indices tracked.
    """

    layout = ""
    totals_decide = True
    cache = None  # the prefix cache sharing this pool's pages (`CachedPool` only)
    shares_pages = False  # whether several rows may list one page (`CachedPool`)

    def __init__(self, *, num_kv_pages: int, page_size: int, max_pages_per_seq: int,
                 num_requests: int) -> None:
        self._set_shape(num_kv_pages, page_size, max_pages_per_seq, num_requests)
        self.ref_count = np.zeros(num_kv_pages + 1, dtype=np.int64)  # [pages + 1] rows holding it
        self.row_of = np.full(num_requests, -1, dtype=np.int64)  # [N] page-table row, -1 none
        self.page_table = np.zeros((0, max_pages_per_seq), dtype=np.int32)  # [rows, P]
        self._free_rows: list[int] = []

    def _set_shape(self, num_kv_pages: int, page_size: int, max_pages_per_seq: int,
                   num_requests: int) -> None:
        """The pool's shape, each request's page count and the page size's 0-d forms (what
        a pool that only counts pages keeps too: `CountedPool`)."""
        if num_kv_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(f"KV pool needs num_kv_pages, page_size and max_pages_per_seq >= 1, "
                             f"got {num_kv_pages}, {page_size}, {max_pages_per_seq}")
        self.num_kv_pages = num_kv_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.num_held = np.zeros(num_requests, dtype=np.int64)  # [N] pages each request owns
        # The page size and its round-up as 0-d arrays: numpy converts a Python int operand
        # anew on every call (0.7 us a step's array op), and pages are counted several
        # times a step. The same int64 values either way.
        self._page_size_0d = np.array(page_size, dtype=np.int64)
        self._round_up_0d = np.array(page_size - 1, dtype=np.int64)
        # A power-of-two page size (every preset's) divides by a shift: an arithmetic shift
        # right is floor division by 2^k for every int64, negative ones included, and
        # costs numpy half what its integer division does.
        shift = int(page_size).bit_length() - 1
        self._page_shift_0d = (np.array(shift, dtype=np.int64) if page_size == 1 << shift
                               else None)

    @property
    def num_used(self) -> int:
        return self.num_kv_pages - self.num_free  # type: ignore[attr-defined]

    @property
    def num_cached(self) -> int:
        return 0

    @property
    def num_evictions(self) -> int:
        return 0

    def pages_for_tokens(self, num_tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """Pages needed to hold `num_tokens` tokens, elementwise. `[n] -> [n]`."""
        return (num_tokens + (self.page_size - 1)) // self.page_size  # ceil, for any int

    def pages_of(self, request: int) -> NDArray[np.int32]:
        """The pages request `request` holds, in order (a copy). `-> [held]`."""
        row = self.row_of[request]
        if row < 0:
            return np.zeros(0, dtype=np.int32)
        return self.page_table[row, :self.num_held[request]].copy()

    def _assign_rows(self, ids: NDArray[np.int64],  # [n]
                     rows: Optional[NDArray[np.int64]] = None  # [n] their rows, if read
                     ) -> NDArray[np.int64]:  # [n]
        """Gives a page-table row to each of `ids` that has none; returns their rows
        (`rows`, a copy the caller read from `row_of`, is written in place)."""
        if rows is None:
            rows = self.row_of[ids]
        rowless_at = rows < 0  # [n]
        rowless = ids[rowless_at]
        if rowless.size == 0:
            return rows
        shortfall = rowless.size - len(self._free_rows)
        if shortfall > 0:
            old = self.page_table.shape[0]
            grow = max(shortfall, old, 16)
            self.page_table = np.concatenate(
                [self.page_table, np.zeros((grow, self.max_pages_per_seq), np.int32)])
            self._free_rows.extend(range(old + grow - 1, old - 1, -1))
        # In `ids` order, each the free list's last as one by one `pop()`s take them (its
        # tail reversed, cut off in one go); one array, so neither write converts a list.
        free_rows, count = self._free_rows, int(rowless.size)
        given = np.array(free_rows[:-count - 1:-1], dtype=np.int64)
        del free_rows[-count:]
        self.row_of[rowless] = given
        rows[rowless_at] = given
        return rows

    def trim(self, ids: NDArray[np.int64],  # [n]
             num_tokens: NDArray[np.int64]) -> int:  # [n]
        """Keeps every page (a layout that hands out whole blocks, as the buddy one does,
        keeps a request's block until it is done); the paged layouts free the tail."""
        del ids, num_tokens
        return 0

    def _release_rows(self, ids: NDArray[np.int64],  # [n]
                      rows: Optional[NDArray[np.int64]] = None) -> None:  # [n]
        """Releases the rows of those of `ids` that hold one (`rows`: their rows, read by
        the caller, when every one does)."""
        if rows is None:
            ids = ids[self.row_of[ids] >= 0]
            rows = self.row_of[ids]
        if ids.size:
            self._free_rows.extend(rows.tolist())
            self.row_of[ids] = _NO_ROW


class PagedPool(PageTable):
    """Any free page serves any request; every page has one owner. Free pages are a
    stack: the next pages handed out are at its end, so page 1 goes first."""

    layout = "paged"

    def __init__(self, **shape: int) -> None:
        super().__init__(**shape)
        # [num_kv_pages] The stack in int64, though the page table is int32: pages index
        # `ref_count` as they come off it and go back, and numpy's fancy indexing by an
        # int32 array costs several times what it does by an intp one (6 against 1.5 us
        # at a step's few dozen pages), more than the cast to the table on the way in.
        self._free = np.arange(self.num_kv_pages, 0, -1, dtype=np.int64)
        self._num_free = self.num_kv_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def largest_block(self) -> int:
        return self.num_kv_pages

    def pages_taken(self, num_pages: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        return num_pages

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     target_tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        # `pages_for_tokens(target_tokens) - num_held[ids]`, at least 0: asked several times
        # a step, so written out, on one new array.
        need = target_tokens + self._round_up_0d
        if self._page_shift_0d is not None:
            need >>= self._page_shift_0d
        else:
            need //= self._page_size_0d
        need -= self.num_held[ids]
        return np.maximum(need, _ZERO, out=need)

    def pages_needed_of(self, request: int, target_tokens: int) -> int:
        """`pages_needed` of one request, in Python ints: the same integer, for a caller
        that counts a few requests, where each numpy call costs more than the count."""
        need = (target_tokens + self.page_size - 1) // self.page_size - self.num_held.item(
            request)
        return need if need > 0 else 0

    def blocks_fit(self, ids: NDArray[np.int64],  # [n]
                   pages: NDArray[np.int64],  # [n]
                   freeing: Optional[NDArray[np.int64]] = None) -> bool:  # [f]
        return True  # only the total counts, and the caller checks it

    def allocate(self, ids: NDArray[np.int64],  # [n] distinct
                 target_tokens: NDArray[np.int64],  # [n]
                 need: Optional[NDArray[np.int64]] = None,  # [n]
                 growing_at: Optional[NDArray[np.int64]] = None) -> None:  # [g]
        """Grows each request's pages to hold `target_tokens`; the caller checked capacity.

        `need`: `pages_needed(ids, target_tokens)`, and `growing_at`: `need.nonzero()[0]`
        (given only with `need`), if the caller has them already (the plan check does).
        """
        if need is None:
            need = self.pages_needed(ids, target_tokens)
            growing_at = None
        # One pass for who grows: most steps, a few of a whole batch (decodes entering a
        # page, admissions), so their positions are taken once and everything after is [g].
        if growing_at is None:
            growing_at = need.nonzero()[0]  # [g] (the method: np.flatnonzero adds two calls)
        if growing_at.size == 0:
            return
        if growing_at.size < need.size:  # else every one grows: no copies
            ids, need = ids[growing_at], need[growing_at]
        # The [g] arrays' sum and bounds in Python ints (exact, as int64 reductions are): a
        # ufunc reduction's fixed cost (2 us) is several times a short list's.
        total = sum(need.tolist())
        held = self.num_held[ids]  # [g]
        grown = held + need  # [g]
        self._check_grant(total, max(grown.tolist()))
        self._place(ids, need, held, total)
        self.num_held[ids] = grown

    def _place(self, ids: NDArray[np.int64],  # [g] each growing
               need: NDArray[np.int64],  # [g] its new pages
               held: NDArray[np.int64],  # [g] the pages it held before
               total: int) -> None:
        """`allocate`'s pages: `total` off the free stack, written into the growing
        requests' rows after the pages they held (the counts are the caller's)."""
        rows = self.row_of[ids]  # [g]
        if min(rows.tolist()) < 0:  # an admission's first pages: it gets a row
            rows = self._assign_rows(ids, rows)
        pages = self._take(total)
        self.ref_count[pages] = _ONE
        if total == ids.size:  # one page each: most steps (decodes entering a page)
            self.page_table[rows, held] = pages
        else:
            # The column of each of `pages`: its request's first new column (`held`), moved
            # back by the pages handed to the requests before it, plus its place in `pages`.
            first = held - (need.cumsum() - need)  # [g]
            self.page_table[rows.repeat(need), first.repeat(need) + np.arange(total)] = pages

    def allocate_steps(self, ids: NDArray[np.int64],  # [n] distinct, each holding a row
                       need: NDArray[np.int64]) -> None:  # [k, n]
        """`allocate` of `k` steps one after another, at once: step j takes `need[j, i]`
        new pages for request `ids[i]`, off the free stack in the very order `k` calls
        would take them (step by step, each step in `ids` order), so the page table ends
        as theirs does (a leap over steady decodes: `orca_jax.core.loop.leap`)."""
        grants = need.sum(axis=0)  # [n] pages each request takes over the k steps
        total = int(grants.sum())
        if total == 0:
            return
        held = self.num_held[ids]  # [n]
        grown = held + grants  # [n]
        self._check_grant(total, int(grown.max()))
        self._place_steps(ids, need, grants, held, total)
        self.num_held[ids] = grown

    def _place_steps(self, ids: NDArray[np.int64],  # [n]
                     need: NDArray[np.int64],  # [k, n] pages each step takes
                     grants: NDArray[np.int64],  # [n] their sums
                     held: NDArray[np.int64],  # [n] the pages each held before
                     total: int) -> None:
        """`allocate_steps`' pages, in the order the `k` steps take them (the counts are
        the caller's)."""
        rows = self.row_of[ids]  # [n]
        if (rows[grants > 0] < 0).any():
            raise RuntimeError("allocate_steps: a growing request holds no page-table row")
        step, pos = np.nonzero(need)  # [g] row-major: by step, then in ids order
        pages = self._take(total)
        self.ref_count[pages] = 1
        if int(grants.max()) == 1:
            # A short leap's decodes: each request takes at most one page, at its next
            # column (one grant of one page each, so no earlier grant moves it).
            self.page_table[rows[pos], held[pos]] = pages
        else:
            counts = need[step, pos]  # [g]
            earlier = np.cumsum(need, axis=0)[step, pos] - counts  # [g] its earlier pages
            first = np.repeat(held[pos] + earlier, counts)  # [total] its column of each grant
            within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            self.page_table[np.repeat(rows[pos], counts), first + within] = pages

    def allocate_next_pages(self, ids: NDArray[np.int64]) -> None:  # [g] distinct
        """`allocate_steps` of a short leap, in which no request takes two pages: one new
        page for each of `ids` (each holding a row) at its next column, off the free stack
        in the order of `ids` (the leap lists them step by step, each step in its own
        order), so the page table ends as the steps one by one leave it."""
        total = ids.size
        if total == 0:
            return
        held = self.num_held[ids]  # [g]
        # The bounds of a few in Python (a ufunc reduction's fixed cost is several times theirs).
        self._check_grant(total, max(held.tolist()) + 1)
        self._place_next(ids, held, total)
        held += _ONE
        self.num_held[ids] = held

    def _place_next(self, ids: NDArray[np.int64],  # [g]
                    held: NDArray[np.int64],  # [g] the pages each held before
                    total: int) -> None:
        """`allocate_next_pages`' pages: one each, at its next column."""
        rows = self.row_of[ids]  # [g]
        if min(rows.tolist()) < 0:
            raise RuntimeError("allocate_next_pages: a growing request holds no page-table row")
        pages = self._take(total)
        self.ref_count[pages] = _ONE
        self.page_table[rows, held] = pages

    def _check_grant(self, total: int, most_held: int) -> None:
        """Refuses a grant its caller should have checked: `total` pages more than are
        free, or a request left holding `most_held` pages, past `max_pages_per_seq`. Free
        as `num_free` says: a prefix cache's pool counts its evictable pages too."""
        free = self.num_free
        if total > free:
            raise RuntimeError(f"KV pool overcommitted: {total} pages asked, {free} free")
        if most_held > self.max_pages_per_seq:
            raise RuntimeError("a request would exceed max_pages_per_seq")

    def _take(self, count: int) -> NDArray[np.int64]:
        """`[count]` pages off the free stack (the caller checked that it has them)."""
        pages = self._free[self._num_free - count:self._num_free][::-1]
        self._num_free -= count
        return pages

    def free(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Returns every page of these requests to the pool and releases their rows."""
        held = self.num_held[ids]  # [n]
        held_list = held.tolist()  # a few finishing: Python's min and max cost less than numpy's
        lowest = min(held_list) if held_list else 1
        if lowest < 1:  # some hold nothing (rejected, say)
            holding = held > 0
            held_ids, held = ids[holding], held[holding]
        else:  # most frees: requests finishing, each holding pages (and so a row)
            held_ids = ids
        rows = None
        if held_ids.size:
            rows = self.row_of[held_ids]
            # The pages as int64 (the stack's type): they index `ref_count` next.
            if held_ids.size == 1:  # most frees: one request finishing
                row, width = int(rows[0]), int(held[0])
                pages = self.page_table[row, :width].astype(np.int64)  # a copy
                self.page_table[row, :width] = 0
            else:
                # Only the columns up to the widest holding: a row is 0 past its pages, and
                # a max_pages_per_seq-wide copy would cost more than the pages it holds.
                width = max(held_list) if held_ids is ids else int(np.maximum.reduce(held))
                block = self.page_table[rows, :width].astype(np.int64)  # [h, width]
                # Row by row, each row's first `held` (all of them where all hold as many).
                pages = (block.ravel() if lowest == width
                         else block[np.arange(width) < held[:, None]])
                self.page_table[rows, :width] = 0
            pages = self._unhold(pages)
            self._free[self._num_free:self._num_free + pages.size] = pages[::-1]
            self._num_free += pages.size
            self.num_held[held_ids] = _ZERO
        # Where each held pages, each has a row, already read: released without a filter.
        self._release_rows(ids, rows if held_ids is ids else None)

    def trim(self, ids: NDArray[np.int64],  # [n] distinct
             num_tokens: NDArray[np.int64]) -> int:  # [n]
        """Frees each request's pages past those its first `num_tokens` tokens fill (the
        rejected draft positions of a speculative step), onto the free stack as `free`
        does. Returns how many pages were given back."""
        keep = self.pages_for_tokens(num_tokens)  # [n]
        held = self.num_held[ids]  # [n]
        over = held > keep
        if not over.any():
            return 0
        ids, keep, held = ids[over], keep[over], held[over]
        rows = self.row_of[ids]
        columns = np.arange(self.max_pages_per_seq)[None, :]
        mask = (columns >= keep[:, None]) & (columns < held[:, None])  # [t, P]
        pages = self._unhold(self.page_table[rows][mask])
        self._free[self._num_free:self._num_free + pages.size] = pages[::-1]
        self._num_free += pages.size
        table_rows = self.page_table[rows]
        table_rows[mask] = 0
        self.page_table[rows] = table_rows
        self.num_held[ids] = keep
        return int(held.sum() - keep.sum())

    def _unhold(self, pages: NDArray[np.int32]) -> NDArray[np.int32]:  # [k] -> [u]
        """Drops the holder of each page; returns those for the free stack."""
        self.ref_count[pages] = _ZERO
        return pages

    def num_freed_by(self, ids: NDArray[np.int64],  # [n] distinct
                     kept: Optional[NDArray[np.int32]] = None) -> int:  # [k]
        """Pages that become free if these requests let theirs go (`kept`: pages taken
        again at once, which only a shared page can be)."""
        return int(self.num_held[ids].sum())

    def _holders(self) -> NDArray[np.int64]:
        """`[pages + 1]` page-table rows listing each page."""
        owned = [self.pages_of(int(i)) for i in np.flatnonzero(self.num_held)]
        return np.bincount(np.concatenate(owned + [np.zeros(0, np.int32)]),
                           minlength=self.num_kv_pages + 1)

    def _free_pages(self) -> NDArray[np.int64]:
        """`[f]` every free page (a copy)."""
        return self._free[:self._num_free].copy()

    def check_consistency(self) -> None:
        """Asserts that every page is either free or in use, never both, and that each
        page's `ref_count` is the number of page-table rows holding it (tests)."""
        holders = self._holders()
        if (not self.shares_pages and (holders > 1).any()) or holders[0]:
            raise AssertionError("KV pages leaked or double-owned")
        if (self.ref_count < 0).any():
            raise AssertionError("a KV page's reference count is negative")
        if not np.array_equal(holders, self.ref_count):
            raise AssertionError("KV reference counts differ from the rows holding the pages")
        free_pages = self._free_pages()
        if (holders[free_pages] > 0).any():
            raise AssertionError("a KV page is both free and in use")
        all_pages = np.concatenate([np.flatnonzero(holders), free_pages])
        if all_pages.size != self.num_kv_pages or not np.array_equal(
                np.sort(all_pages), np.arange(1, self.num_kv_pages + 1)):
            raise AssertionError("KV pages leaked or double-owned")
