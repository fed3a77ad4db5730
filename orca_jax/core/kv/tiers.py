"""KV memory tiers: where each request's pages are, and what moving them costs.

The device's pool (`KVPool`) is tier 0 of a `TierChain`; a run today has that
tier alone, so nothing ever moves. Slower tiers (host memory, disk, a remote
store) join the chain with `TierChain.add`; a preemption mode that keeps a
victim's KV (swap: `orca_jax.core.kv.preemption`) moves its pages down the
chain, and its admission brings them back, each move priced by the tier.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

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
        self.tier_of = np.zeros(num_requests, dtype=np.int64)  # [N] tier holding its KV
        self.pages_away = np.zeros(num_requests, dtype=np.int64)  # [N] pages off the device
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

    def move_away(self, ids: NDArray[np.int64],  # [n] on the device
                  num_pages: NDArray[np.int64],  # [n] the pages each holds there
                  tier: int) -> float:
        """Records that these requests' pages moved to tier `tier`; returns its price.
        The caller frees their device pages."""
        if tier == DEVICE:
            raise ValueError("move_away: the device tier is where pages come from")
        if self.num_used(tier) + int(num_pages.sum()) > self.tiers[tier].capacity_pages:
            raise RuntimeError(f"KV tier {self.tiers[tier].name!r} is full")
        self.tier_of[ids] = tier
        self.pages_away[ids] = num_pages
        self._num_away += int(ids.size)
        return self.tiers[tier].move_s(num_pages)

    def bring_back(self, ids: NDArray[np.int64]) -> float:  # [n]
        """These requests' KV returns to the device (the pool allocates its pages as
        usual); returns the price of the moves."""
        if self._num_away == 0:  # every default run: nothing is ever away
            return 0.0
        away = ids[self.tier_of[ids] != DEVICE]
        seconds = 0.0
        for tier in np.unique(self.tier_of[away]).tolist():
            moving = away[self.tier_of[away] == tier]
            seconds += self.tiers[tier].move_s(self.pages_away[moving])
        self.drop(away)
        return seconds

    def drop(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Forgets these requests' KV off the device (they are done, or it is back)."""
        if self._num_away == 0:
            return
        away = ids[self.tier_of[ids] != DEVICE]
        self.tier_of[away] = DEVICE
        self.pages_away[away] = 0
        self._num_away -= int(away.size)
