"""KV memory tiers: where each request's pages are, and what moving them costs.

The device's pool (`KVPool`) is tier 0 of a `TierChain`; a run today has that
tier alone, so nothing ever moves. Slower tiers (host memory, disk, a remote
store) join the chain with `TierChain.add`; a preemption mode that keeps a
victim's KV (swap: `orca_jax.core.kv.preemption`) moves its pages down the
chain, and its admission brings them back into newly allocated device pages,
each move priced by the tier.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.pool import KVPool

DEVICE = 0  # the device tier's index in every chain


class KVTier(Protocol):
    """One tier of KV memory.

    Attributes:
      name: how the chain finds it (`TierChain.index`).
      capacity_pages: pages it holds at most.
    """

    name: str
    capacity_pages: int

    def move_s(self, num_pages: NDArray[np.int64]) -> float:  # [n]
        """Seconds to move requests' pages (`num_pages` each) between here and the device."""
        ...

    def store(self, request: int, device_pages: NDArray[np.int32]) -> None:  # [h]
        """Copies `request`'s KV out of these device pages (before they are freed)."""
        ...

    def load(self, request: int, device_pages: NDArray[np.int32]) -> None:  # [h]
        """Copies `request`'s stored KV into these device pages (just allocated), in order."""
        ...


class DeviceTier:
    """The device's KV pool as tier 0: its pages are where the engine reads them.

    Args:
      capacity_pages: the pool's pages.
    """

    name = "device"

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = capacity_pages

    def move_s(self, num_pages: NDArray[np.int64]) -> float:  # [n]
        return 0.0

    def store(self, request: int, device_pages: NDArray[np.int32]) -> None:  # [h]
        raise RuntimeError("the device tier is where KV moves from, not to")

    load = store


class TierChain:
    """The tiers, device first, and the tier holding each request's KV.

    A request's pages are on the device while it holds any there (`KVPool`);
    `tier_of` says which other tier holds them while it is away from the device.

    Args:
      device: tier 0.
      num_requests: request indices tracked.
    """

    def __init__(self, device: KVTier, num_requests: int) -> None:
        self.tiers: list[KVTier] = [device]
        # Small types: every replica of a cluster keeps these for the whole workload.
        self.tier_of = np.zeros(num_requests, dtype=np.int8)  # [N] tier holding its KV
        self.pages_away = np.zeros(num_requests, dtype=np.int32)  # [N] pages off the device
        self._num_away = 0  # requests whose KV is off the device: 0 in every default run

    def add(self, tier: KVTier) -> int:
        """Appends a slower tier; returns its index."""
        if any(t.name == tier.name for t in self.tiers):
            raise ValueError(f"KV tier {tier.name!r} is already in the chain")
        self.tiers.append(tier)
        return len(self.tiers) - 1

    def index(self, name: str) -> int:
        """The index of the tier called `name`."""
        for k, tier in enumerate(self.tiers):
            if tier.name == name:
                return k
        raise KeyError(f"no KV tier {name!r} in the chain "
                       f"({', '.join(t.name for t in self.tiers)})")

    def num_used(self, tier: int) -> int:
        """Pages the requests away from the device hold on tier `tier` (> 0)."""
        return int(self.pages_away[self.tier_of == tier].sum())

    @property
    def device_only(self) -> bool:
        """Whether the chain holds the device tier alone (then nothing ever moves)."""
        return len(self.tiers) == 1

    def away(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [a]
        """Those of `ids` whose KV is on a slower tier."""
        if self._num_away == 0:  # every default run: nothing is ever away
            return ids[:0]
        return ids[self.tier_of[ids] != DEVICE]

    def move_away(self, ids: NDArray[np.int64],  # [n] holding device pages
                  pool: KVPool, tier: int) -> float:
        """Copies these requests' KV from their device pages to tier `tier`; returns the
        price. The caller frees their device pages."""
        if tier == DEVICE:
            raise ValueError("move_away: the device tier is where pages come from")
        num_pages = pool.num_held[ids].copy()  # [n]
        target = self.tiers[tier]
        if self.num_used(tier) + int(num_pages.sum()) > target.capacity_pages:
            raise RuntimeError(f"KV tier {target.name!r} is full")
        for request in ids.tolist():
            target.store(request, pool.pages_of(request))
        self.tier_of[ids] = tier
        self.pages_away[ids] = num_pages
        self._num_away += int(ids.size)
        return target.move_s(num_pages)

    def bring_back(self, ids: NDArray[np.int64],  # [a] from `away`, device pages allocated
                   pool: KVPool) -> float:
        """Copies these requests' KV back into their device pages; returns the price."""
        seconds = 0.0
        for tier in np.unique(self.tier_of[ids]).tolist():
            moving = ids[self.tier_of[ids] == tier]
            source = self.tiers[tier]
            for request, count in zip(moving.tolist(), self.pages_away[moving].tolist()):
                pages = pool.pages_of(request)
                if pages.size < count:
                    raise RuntimeError(f"request {request} is back with {pages.size} device "
                                       f"pages for {count} pages of KV")
                source.load(request, pages[:count])
            seconds += source.move_s(self.pages_away[moving])
        self.drop(ids)
        return seconds

    def drop(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Forgets these requests' KV off the device (they are done, or it is back)."""
        if self._num_away == 0:
            return
        away = ids[self.tier_of[ids] != DEVICE]
        self.tier_of[away] = DEVICE
        self.pages_away[away] = 0
        self._num_away -= int(away.size)
