"""Cache policies of the slower KV tiers: which page a full tier evicts, where an evicted
page goes, and what to prefetch. A plugin kind: one small class per policy.

A policy sees a tier's cached pages by name (the prefix cache's page hashes,
`orca_jax.core.kv.prefix_cache`) and is told each one inserted (`inserted`) and
each one hit (`hit`); when the tier is full it names the page to evict
(`victim`). Its `placement` says where pages go:

- `write_back` (the default): a page goes down a tier when the tier above evicts it
  (its copy then costs the link, and the step that takes the freed device page waits
  for it).
- `write_through`: every page is written down as soon as it is filled, overlapping
  the steps that follow; an eviction then moves nothing.
- `drop`: an evicted page is gone (the device alone, as without tiers).

`prefetch_on_queue`: the requests at the waiting queue's head start their pages found
on the disk tier towards host memory before admission, which then loads them from host
memory.

Built in: `lru` (the least recently used page goes: what the device's prefix cache
does), `lfu` (the least frequently used; ties: the least recent), `arc` (Megiddo and
Modha's adaptive replacement cache, balancing recency and frequency with ghost lists),
and `prefetch-on-queue` (LRU with prefetching). A plugin subclasses `CachePolicy`,
registers with `@register_cache_policy("name")` or is loaded by path
(`file.py:Class`, `runner.build`), and its knobs are dataclass fields
(`--kv_cache_policy_opts`).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import heapq
from typing import Callable, ClassVar, Hashable, TypeVar

PLACEMENTS = ("write_back", "write_through", "drop")
C = TypeVar("C", bound=type)


class CachePolicyError(ValueError):
    """A cache policy broke its contract during a run (as `PlanError` for a plan): names
    the policy's class and what it did; the run stops.

    Attributes:
      policy: the policy's class name (and registered name, if any).
      rule: a short stable name of the broken rule: `victim_not_held` (`victim()`
        named a page its tier does not hold, or None).
      detail: what exactly was wrong.
    """

    def __init__(self, policy: "CachePolicy", rule: str, detail: str) -> None:
        cls = type(policy).__qualname__
        name = policy.name or cls  # a plugin loaded by path is registered as `file.py:Class`
        self.policy = name if name.endswith(cls) else f"{name} ({cls})"
        self.rule = rule
        self.detail = detail
        super().__init__(f"cache policy '{self.policy}' broke rule '{rule}': {detail}")


@dataclasses.dataclass(kw_only=True)
class CachePolicy(abc.ABC):
    """Which cached page a tier evicts; where evicted pages go; what to prefetch.

    Attributes:
      placement: where pages go down the tiers: write_back (when evicted from the tier
        above), write_through (as soon as they are filled) or drop (never).
    """

    name: ClassVar[str] = ""
    prefetch_on_queue: ClassVar[bool] = False
    placement: str = "write_back"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"cache policy {self.name!r}: placement {self.placement!r} is not "
                             f"one of {PLACEMENTS}")

    def bind(self, capacity_pages: int) -> None:
        """The tier's size, before the first page (a policy that needs it keeps it)."""
        del capacity_pages

    @abc.abstractmethod
    def inserted(self, key: Hashable) -> None:
        """A page `key` joined the tier."""

    @abc.abstractmethod
    def hit(self, key: Hashable) -> None:
        """Page `key`, in the tier, was found by a lookup that used it."""

    @abc.abstractmethod
    def victim(self) -> Hashable:
        """Chooses a page to evict and forgets it (the tier holds at least one): the name
        of a page the tier holds (one `inserted` and not yet a victim); anything else
        stops the run with a `CachePolicyError`."""


_REGISTRY: dict[str, type] = {}


def register_cache_policy(name: str) -> Callable[[C], C]:
    """Class decorator registering a `CachePolicy` subclass under `name`."""

    def wrap(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
            raise TypeError(f"@register_cache_policy({name!r}) expects a CachePolicy subclass")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"cache policy name {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def cache_policy_registry() -> dict[str, type]:
    """Registered name -> class (the registry itself: plugin loading reads it)."""
    return _REGISTRY


def make_cache_policy(name: str, options: dict[str, object] | None = None) -> CachePolicy:
    """A fresh policy of the registered `name` with these knobs."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown cache policy {name!r}; registered: "
                         f"{', '.join(sorted(_REGISTRY))}; or give path/to/file.py:Class")
    return cls(**(options or {}))


@register_cache_policy("lru")
@dataclasses.dataclass(kw_only=True)
class LRU(CachePolicy):
    """The least recently used page goes (inserted or hit)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._order: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self._order[key] = None

    def hit(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def victim(self) -> Hashable:
        return self._order.popitem(last=False)[0]


@register_cache_policy("lfu")
@dataclasses.dataclass(kw_only=True)
class LFU(CachePolicy):
    """The least frequently used page goes; among equals, the least recently used.
    A page's count starts at 1 when inserted and grows by 1 a hit."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._count: dict[Hashable, tuple[int, int]] = {}  # key -> (uses, last tick)
        self._heap: list[tuple[int, int, Hashable]] = []  # stale entries skipped when popped
        self._tick = 0

    def _push(self, key: Hashable, uses: int) -> None:
        self._tick += 1
        self._count[key] = (uses, self._tick)
        heapq.heappush(self._heap, (uses, self._tick, key))

    def inserted(self, key: Hashable) -> None:
        self._push(key, 1)

    def hit(self, key: Hashable) -> None:
        self._push(key, self._count[key][0] + 1)

    def victim(self) -> Hashable:
        while True:
            uses, tick, key = heapq.heappop(self._heap)
            if self._count.get(key) == (uses, tick):
                del self._count[key]
                return key


@register_cache_policy("arc")
@dataclasses.dataclass(kw_only=True)
class ARC(CachePolicy):
    """Adaptive replacement (Megiddo and Modha, FAST'03): pages used once (T1) and more
    than once (T2), each with a ghost list of its recent evictions (B1, B2); a new page
    found in B1 grows T1's target `p`, one found in B2 shrinks it, and the victim comes
    from T1 while T1 is over its target."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._t1: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._t2: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._b1: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._b2: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._p = 0.0
        self._c = 1

    def bind(self, capacity_pages: int) -> None:
        self._c = max(1, int(capacity_pages))

    def inserted(self, key: Hashable) -> None:
        if key in self._b1:  # recency was evicted too soon: favour T1
            self._p = min(float(self._c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:  # frequency was: favour T2
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def hit(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]
        self._t2[key] = None

    def victim(self) -> Hashable:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            key = self._t1.popitem(last=False)[0]
            ghosts = self._b1
        else:
            key = self._t2.popitem(last=False)[0]
            ghosts = self._b2
        ghosts[key] = None
        if len(ghosts) > self._c:
            ghosts.popitem(last=False)
        return key


@register_cache_policy("prefetch-on-queue")
@dataclasses.dataclass(kw_only=True)
class PrefetchOnQueue(LRU):
    """LRU, and the requests at the head of the waiting queue start their prefix's pages
    found on the disk tier towards host memory before they are admitted (SGLang
    HiCache's prefetch from storage), so their admissions load them from host memory.

    Attributes:
      depth: waiting requests, from the queue's head, whose pages are prefetched each step.
    """

    prefetch_on_queue: ClassVar[bool] = True
    depth: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.depth < 1:
            raise ValueError(f"cache policy {self.name!r}: depth must be >= 1, got {self.depth}")
