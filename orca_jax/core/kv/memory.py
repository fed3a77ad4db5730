"""One scheduler's KV memory: the pool, its prefix cache, the capacity question, the tiers.

`KVMemory.build` makes what a run asks for (the layout, whether prefix caching
is active, the reservation and the watermark); the scheduler then asks it, and
never a layout, whether a plan fits (`capacity`), to admit requests (`admit`:
their KV back from a slower tier, their prefix hits shared, their reservation
taken) and to free requests' KV (`free`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.buddy import BuddyPool
from orca_jax.core.kv.cache_policies import make_cache_policy
from orca_jax.core.kv.cached_pool import CachedPool
from orca_jax.core.kv.capacity import CachedCapacity, KVCapacity, reservation_tokens
from orca_jax.core.kv.config import KVConfig
from orca_jax.core.kv.counted_pool import CountedPool
from orca_jax.core.kv.lower_tiers import LinkedTiers, PageTier
from orca_jax.core.kv.pool import KV_LAYOUTS, KVPool, PagedPool
from orca_jax.core.kv.prefix_cache import PrefixCache
from orca_jax.core.kv.prefix_hits import PrefixHits
from orca_jax.core.kv.tiers import DeviceTier, TierChain
from orca_jax.core.requests.request_table import RequestTable


def make_pool(*, num_kv_pages: int, page_size: int, max_pages_per_seq: int, num_requests: int,
              layout: str = "paged", prefix_cache: Optional[PrefixCache] = None) -> KVPool:
    """The KV pool of `layout` (`KV_LAYOUTS`), sharing pages with `prefix_cache` if given
    (paged only)."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"KV layout {layout!r} is not one of {KV_LAYOUTS}")
    shape = dict(num_kv_pages=num_kv_pages, page_size=page_size,
                 max_pages_per_seq=max_pages_per_seq, num_requests=num_requests)
    if layout == "buddy":
        if prefix_cache is not None:
            raise ValueError("prefix caching shares single pages; the buddy KV layout hands "
                             "out whole blocks: use the paged layout with prefix caching")
        return BuddyPool(**shape)
    return PagedPool(**shape) if prefix_cache is None else CachedPool(prefix_cache, **shape)


@dataclasses.dataclass
class KVMemory:
    """A scheduler's KV memory (build it with `KVMemory.build`).

    Attributes:
      table: the scheduler's request table.
      pool: the device's pages (`KVPool`).
      hits: prefix-cache lookups, or None when no cache is kept.
      capacity: the capacity question.
      tiers: where each request's KV is (the device alone unless the config or a plugin
        adds tiers).
      linked: the chain when the config gave slower tiers (`LinkedTiers`), else None.
    """

    table: RequestTable
    pool: KVPool
    hits: Optional[PrefixHits]
    capacity: KVCapacity
    tiers: TierChain
    reserve_tokens: NDArray[np.int64]  # [N] tokens each admission reserves (0: on demand)
    reserves: bool  # whether admissions reserve
    linked: Optional[LinkedTiers] = None

    @classmethod
    def build(cls, table: RequestTable, *, policy_name: str, config: KVConfig,
              max_pages_per_seq: int, max_model_len: int, reservation: str,
              prefix_caching: bool, uses_planned_output: bool,
              counts_only: bool = False) -> "KVMemory":
        """The KV memory of one run.

        Args:
          table: the run's requests.
          policy_name: for messages.
          config: the pool's size and page, its layout and watermark.
          max_pages_per_seq: a page-table row's width.
          max_model_len: the context limit (the `max` reservation).
          reservation: the policy's `kv_reservation`.
          prefix_caching: whether prefix caching is active (`prefix_caching_active`).
          uses_planned_output: see `PrefixHits`.
          counts_only: nothing outside the KV memory reads which pages a request holds
            (the caller's word: an engine that prices steps from their lengths, no
            transfers between replicas); then a paged run without a prefix cache or
            slower tiers keeps page counts only (`CountedPool`), else the full pool.

        Raises:
          ValueError: the layout does not go with the reservation or with caching.
        """
        num_kv_pages, page_size, layout = config.num_kv_pages, config.page_size, config.kv_layout
        if layout == "buddy" and reservation == "none":
            raise ValueError(f"policy {policy_name!r}: kv_layout 'buddy' gives each request one "
                             "block at admission, so it needs a reserving kv_reservation "
                             "('max', 'pow2' or 'exact'), not 'none'")
        if layout == "buddy" and prefix_caching:
            raise ValueError(f"policy {policy_name!r}: prefix caching shares single KV pages and "
                             "the buddy layout hands out whole blocks; turn one off "
                             "(SchedulerConfig.kv.prefix_caching, or under 'policy' the "
                             "policy's opt-in)")
        n = len(table)
        # A workload of lengths only has no ids to match: no admission could ever hit, so
        # no cache is kept and every step takes the uncached path (same results, faster).
        cache = (PrefixCache(num_kv_pages=num_kv_pages, page_size=page_size, num_requests=n)
                 if prefix_caching and any(s.prompt_tokens is not None for s in table.specs)
                 else None)
        if counts_only and layout == "paged" and cache is None and not config.tiers:
            # Only the counts decide anything here, and nothing reads a page: the free
            # stack, reference counts and page table would be a tenth of the loop's time.
            pool: KVPool = CountedPool(num_kv_pages=num_kv_pages, page_size=page_size,
                                       max_pages_per_seq=max_pages_per_seq, num_requests=n)
        else:
            pool = make_pool(num_kv_pages=num_kv_pages, page_size=page_size,
                             max_pages_per_seq=max_pages_per_seq, num_requests=n,
                             layout=layout, prefix_cache=cache)
        reserve = reservation_tokens(reservation, table, max_model_len)
        rules = dict(reservation=reservation, reserve_tokens=reserve,
                     watermark_pages=config.watermark_pages)
        hits = capacity = None
        if cache is None:
            capacity = KVCapacity(table, pool, **rules)
        else:
            hits = PrefixHits(table, pool, uses_planned_output=uses_planned_output)
            capacity = CachedCapacity(table, pool, hits, **rules)
        device = DeviceTier(num_kv_pages)
        linked = None
        if config.tiers:
            # Lazy: only slower tiers have links; a run on the device alone never imports them.
            from orca_jax.core.kv.links import Link
            options = dict(config.cache_policy_opts)
            linked = LinkedTiers(device, n, [
                PageTier(tier.name, tier.num_pages, tier.page_bytes,
                         Link.of(tier.link, tier.link_latency_s, tier.link_bytes_per_s),
                         make_cache_policy(config.cache_policy, options))
                for tier in config.tiers])
            if cache is not None and hits is not None:
                cache.spill, cache.fill = linked.spill, linked.filled
                linked.on_change = cache.bump_version
                hits.tiers = linked
        return cls(table=table, pool=pool, hits=hits, capacity=capacity,
                   tiers=linked if linked is not None else TierChain(device, n),
                   reserve_tokens=reserve, reserves=reservation != "none", linked=linked)

    def admit(self, ids: NDArray[np.int64],  # [a] waiting requests being admitted
              is_first: NDArray[np.bool_]) -> tuple[int, float]:  # [a] first admissions
        """Admits these requests' KV: their prefix hits shared (they start past them),
        their reservation taken, and the KV of those on a slower tier brought back into
        device pages. Returns (tokens taken from the prefix cache, seconds the tier moves
        cost)."""
        if self.needed_is_allocation:  # nothing reserved, hit or on a slower tier: no move
            return 0, 0.0
        table = self.table
        num_cached = 0
        back = self.tiers.away(ids)  # [b] resuming where they were preempted
        if self.hits is not None:  # share the hits before any allocation can evict them
            fresh, first = ids, is_first
            # A swapped request comes back with its own pages, and a received one (a
            # migration's) holds them already: neither takes a hit, and its computed
            # tokens stand.
            keep = self.pool.num_held[ids] == 0
            if back.size:
                keep &= ~np.isin(ids, back)
            if not keep.all():
                fresh, first = ids[keep], is_first[keep]
            cached = self.hits.admit(fresh)
            table.num_computed[fresh] = cached
            # A request readmitted after preemption finds its own freed pages: that saves
            # recompute but is no prefix hit, so a request's hit is its first admission's.
            table.num_cached_tokens[fresh[first]] = cached[first]
            num_cached = int(cached.sum())
        if self.reserves:
            self.pool.allocate(ids, np.maximum(table.num_computed[ids], self.reserve_tokens[ids]))
        elif back.size:
            self.pool.allocate(back, table.num_computed[back])
        seconds = self.tiers.bring_back(back, self.pool) if back.size else 0.0
        if self.linked is not None and self.hits is not None:  # loads of slower-tier hits
            seconds += self.hits.load_s
            self.hits.load_s = 0.0
        return num_cached, seconds

    def land_loads(self) -> None:
        """Copies the host-tier prefix hits admitted this step into the device pages the
        step allocated for them, where an engine holds the tier's KV (else nothing)."""
        if self.linked is not None and self.linked.contents is not None:
            self.linked.land(self.pool)

    def take_stall(self) -> float:
        """Seconds the step being scheduled waits for the write-backs its allocation
        caused (slower tiers only; see `LinkedTiers.spill`)."""
        return self.linked.take_carried() if self.linked is not None else 0.0

    def prefetch(self, waiting: NDArray[np.int64]) -> None:  # [w] in queue order
        """A prefetching cache policy starts the pages below the host tier of the hits of
        the requests at the waiting queue's head (`PrefetchOnQueue.depth` of them)
        towards the host tier."""
        if self.hits is not None and self.prefetches and waiting.size:
            self.hits.prefetch(waiting[:getattr(self.linked.lower[0].policy, "depth", 1)])

    @property
    def prefetches(self) -> bool:
        """Whether the slower tiers' policy prefetches queued requests' pages."""
        return self.linked is not None and self.linked.lower[0].policy.prefetch_on_queue

    def tier_summary(self) -> Optional[dict]:
        """Per slower tier: hits, bytes each way, stall seconds, evictions (None without)."""
        return None if self.linked is None else self.linked.summary(self.pool.page_size)

    @property
    def needed_is_allocation(self) -> bool:
        """Whether the plan check's `pages_needed` is exactly what the step then
        allocates: nothing is allocated at admission (no reservation, no prefix hit
        shared, no KV brought back from a slower tier)."""
        return self.capacity.needed_is_allocation and len(self.tiers.tiers) == 1  # read per step

    def free(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Frees these requests' KV wherever it is."""
        self.pool.free(ids)
        self.tiers.drop(ids)
