"""Cache-policy plugins that break `CachePolicy.victim`'s contract (tests only)."""

import dataclasses

from orca_jax.core.kv.cache_policies import LRU


@dataclasses.dataclass(kw_only=True)
class NamesAStranger(LRU):
    """Forgets its least recent page but names one its tier never held."""

    def victim(self):
        super().victim()
        return "no-such-page"


@dataclasses.dataclass(kw_only=True)
class NamesNothing(LRU):
    """Forgets its least recent page and names none."""

    def victim(self):
        super().victim()
        return None
