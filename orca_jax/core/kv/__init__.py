"""KV memory: the pool and its layouts, the prefix cache, the capacity question,
the tiers and preemption.

`KVPool` is the device's pages and page table (`PagedPool`, `BuddyPool`,
`CachedPool`, the prefix cache's layer over a paged pool, and `CountedPool`, a paged
pool's counts alone where nothing reads pages); `KVCapacity` answers
the one capacity question (`pages_needed`, `kv_fits`, `room`; watermark,
reservation, layout and prefix hits included) that the plan checks, the
up-front rejections and every policy (through `SchedulerView`) ask;
`TierChain` says where each request's KV is (the device tier alone by default);
`preemption` holds the preemption modes by name (`recompute` built in);
`KVMemory` bundles them for one scheduler. No code outside this folder branches
on the layout.

May import: numpy, the standard library, and `orca_jax.core.requests.request` and
`orca_jax.core.requests.request_table` only (the rest of the core builds on this).
"""

from orca_jax.core.kv.buddy import BuddyAllocator, BuddyPool
from orca_jax.core.kv.cached_pool import CachedPool
from orca_jax.core.kv.capacity import CachedCapacity, KVBudget, KVCapacity, pool_rule_broken
from orca_jax.core.kv.config import KVConfig
from orca_jax.core.kv.counted_pool import CountedPool
from orca_jax.core.kv.memory import KVMemory, make_pool
from orca_jax.core.kv.pool import KV_LAYOUTS, KVPool, PagedPool
from orca_jax.core.kv.preemption import (
    PreemptionCosts,
    PreemptionMode,
    preempt,
    preemption_costs,
    preemption_modes,
    register_preemption_mode,
    unregister_preemption_mode,
)
from orca_jax.core.kv.prefix_cache import PrefixCache
from orca_jax.core.kv.tiers import DeviceTier, KVTier, TierChain

__all__ = ["BuddyAllocator", "BuddyPool", "CachedCapacity", "CachedPool", "CountedPool",
           "DeviceTier",
           "KVBudget", "KVCapacity", "KVConfig", "KVMemory", "KVPool", "KVTier", "KV_LAYOUTS",
           "PagedPool",
           "PreemptionCosts", "PreemptionMode", "PrefixCache", "TierChain", "make_pool",
           "pool_rule_broken", "preempt", "preemption_costs", "preemption_modes",
           "register_preemption_mode", "unregister_preemption_mode"]


def __getattr__(name: str) -> object:
    """0.1's `KVPageManager` (now `make_pool`), reached by its old path
    (`orca_jax.core.kv_pages`), for one more release with a DeprecationWarning."""
    if name == "KVPageManager":
        import warnings
        warnings.warn("KVPageManager is now orca_jax.core.kv.make_pool (a KVPool per layout); "
                      "the old name goes away in the next release", DeprecationWarning,
                      stacklevel=2)
        return make_pool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
