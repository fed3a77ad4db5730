"""The contents of a slower KV tier, where an engine holds real KV (the engine seam).

The simulator's tiers move no data: `LinkedTiers` only counts pages and prices
links. An engine whose cache holds real KV (the jax engine) hands the scheduler a
`PageContents` (`Engine.host_kv_store`), and the host tier's moves then copy pages
between the device cache and host memory where `LinkedTiers` makes them:

- a swap out copies a victim's device pages before they are freed (`save`, one
  key per page: `swap_keys`), its swap in copies them into its new device pages
  (`take` then `put`) and forgets them (`discard`);
- a page the device's prefix cache evicts (write-back) or fills (write-through) is
  copied out under its name when the host tier takes it, and dropped when the host
  tier evicts it;
- a prefix hit found on the host tier takes the pages' KV at admission (so a later
  eviction in the same step cannot lose it) and puts it into the device pages the
  step allocates for them, before the step is dispatched (`LinkedTiers.land`).

Every call reaches the engine in the scheduler's order, which is the device's
program order: a copy out is issued before the step that reuses its pages, a copy
in before the step that reads them, so a step still in flight is never overtaken.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

import numpy as np
from numpy.typing import NDArray


class PageContents(Protocol):
    """KV pages kept off the device under keys (a prefix page's name, `swap_keys`)."""

    def save(self, keys: Sequence[Hashable], device_pages: NDArray[np.int32]) -> None:  # [n]
        """Copies these device pages' KV out, page i under `keys[i]` (replacing any)."""
        ...

    def take(self, keys: Sequence[Hashable]) -> object:
        """A handle on these keys' KV, in order, valid whatever is discarded later."""
        ...

    def put(self, taken: object, device_pages: NDArray[np.int32]) -> None:  # [n]
        """Copies `take`'s KV into these device pages, in order."""
        ...

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forgets these keys' KV (those it holds)."""
        ...


def swap_keys(request: int, num_pages: int) -> list[tuple[str, int, int]]:
    """The keys of a swapped request's pages, in order."""
    return [("swap", request, k) for k in range(num_pages)]
