"""A host KV tier and a `swap` preemption mode, written as plugins (test only).

Nothing outside `tests/` changes for them: the tier joins a scheduler's
`TierChain`, the mode registers by name (`register_preemption_mode`), and a
policy names it for its victims (`Policy.preemption_modes`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv import KVMemory


class HostTier:
    """Host memory holding `capacity_pages` pages; moving a request's KV either way
    costs a fixed `delay_s`. With an `engine`, the KV's contents move too (the
    engine's `read_kv_pages` / `write_kv_pages`); else only its page count does.
    `lossy`: forget the contents (a broken tier, for the test that must see it)."""

    name = "host"

    def __init__(self, capacity_pages: int, delay_s: float, engine: Optional[object] = None,
                 lossy: bool = False) -> None:
        self.capacity_pages = capacity_pages
        self.delay_s = delay_s
        self.num_moves = 0
        self._engine = engine
        self._lossy = lossy
        self._kv: dict[int, object] = {}  # request -> its KV, as the engine read it

    def move_s(self, num_pages: NDArray[np.int64]) -> float:  # [n]
        self.num_moves += int(num_pages.size)
        return self.delay_s * num_pages.size

    def store(self, request: int, device_pages: NDArray[np.int32]) -> None:  # [h]
        self._kv[request] = (device_pages.size if self._engine is None
                             else self._engine.read_kv_pages(device_pages))

    def load(self, request: int, device_pages: NDArray[np.int32]) -> None:  # [h]
        kv = self._kv.pop(request)
        if self._engine is not None and not self._lossy:
            self._engine.write_kv_pages(device_pages, kv)


class Swap:
    """A victim's KV moves to the host tier; readmitted, it resumes where it was."""

    def evict(self, memory: KVMemory, ids: NDArray[np.int64]) -> float:  # [n]
        seconds = memory.tiers.move_away(ids, memory.pool, memory.tiers.index(HostTier.name))
        memory.pool.free(ids)  # num_computed stays: nothing is computed again
        return seconds
