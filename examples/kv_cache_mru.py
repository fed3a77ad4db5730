"""A KV cache policy written outside the project: most recently used goes first.

Load it by path: `--kv_cache_policy=examples/kv_cache_mru.py:MRU` (with a host tier,
`--kv_host_gb=...`). MRU suits a scan larger than the tier: the pages used longest ago
stay, where LRU would evict each one just before its reuse.
"""

import collections
import dataclasses

from orca_jax.core.kv.cache_policies import CachePolicy


@dataclasses.dataclass(kw_only=True)
class MRU(CachePolicy):
    """The most recently inserted or hit page goes first."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._order = collections.OrderedDict()

    def inserted(self, key) -> None:
        self._order[key] = None

    def hit(self, key) -> None:
        self._order.move_to_end(key)

    def victim(self):
        return self._order.popitem(last=True)[0]
