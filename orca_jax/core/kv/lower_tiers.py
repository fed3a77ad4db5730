"""Host and disk KV tiers under the device, over links, with a cache policy each.

`PageTier` is one slower tier (host DRAM, a disk or a remote store) of
`capacity_pages` pages: some hold the KV of requests swapped out of the device
(pinned until they come back), the rest cache prefix pages by name (the prefix
cache's page hashes), evicted in the order its `CachePolicy` chooses.

`LinkedTiers` is the `TierChain` of a run with such tiers. Tier k is joined to
tier k - 1 by its link (`Link`: the host by PCIe, the disk by NVMe), and a move
crosses the links between its two tiers one after another, each queueing on its
own direction (`LinkQueue`). Every move the next step needs (a swap out whose
device pages the step takes, a swap in, a prefix hit loaded from a slower tier,
a write-back that must leave a device page before the step reuses it) *stalls*
that step until the move ends: `wait` turns a move's end into the seconds the
step waits beyond those already counted, which the scheduler adds to
`ScheduledStep.kv_move_s`. Moves no step waits for (write-through, a disk
tier's write-back, a prefetch) only occupy their links: they overlap the steps,
and delay the moves queued behind them.

What moves where is recorded as stats per tier (pages hit, bytes each way,
stall seconds); the pages' contents do not move in the simulator. An engine that
holds real KV sets `contents` (`tier_contents.PageContents`, the host tier's
only): each move then copies the pages too, and a step waits for no modelled
move (the engine's own clock has the copies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.cache_policies import CachePolicy, CachePolicyError
from orca_jax.core.kv.pool import KVPool
from orca_jax.core.kv.tier_contents import PageContents, swap_keys
from orca_jax.core.kv.tiers import DEVICE, KVTier, TierChain

if TYPE_CHECKING:  # a hint only: the links are built by `KVMemory.build`, with tiers only
    from orca_jax.core.kv.links import Link


class PageTier:
    """A slower KV tier: swapped requests' pages and cached prefix pages.

    Args:
      name: `host` or `disk` (the chain finds it by name).
      capacity_pages: pages it holds.
      page_bytes: KV bytes of one page.
      link: the link to the tier above it.
      policy: which cached page it evicts, and where evicted pages go.
    """

    def __init__(self, name: str, capacity_pages: int, page_bytes: int, link: Link,
                 policy: CachePolicy) -> None:
        self.name = name
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.link = link
        self.policy = policy
        policy.bind(capacity_pages)
        self.cached: dict[Hashable, None] = {}  # names of the prefix pages it holds
        self.ready_s: dict[Hashable, float] = {}  # prefetched pages still on their way
        self.num_swapped = 0  # pages swapped requests hold here (pinned)
        self.stats = dict(hit_pages=0, evictions=0, swapped_out_pages=0, swapped_in_pages=0,
                          read_bytes=0, write_bytes=0, stall_s=0.0)

    @property
    def num_used(self) -> int:
        return len(self.cached) + self.num_swapped

    def move_s(self, num_pages: NDArray[np.int64]) -> float:  # [n]
        """One move of these pages over this tier's own link, unqueued (a price)."""
        return self.link.up.seconds(int(num_pages.sum()) * self.page_bytes)

    def store(self, request: int, device_pages: NDArray[np.int32]) -> None:  # [h]
        """The simulator's tier holds no contents (an engine's would copy them here)."""
        del request, device_pages

    load = store


class LinkedTiers(TierChain):
    """The device and its slower tiers, with links, a clock and per-step stalls.

    Args:
      device: tier 0.
      num_requests: request indices tracked.
      tiers: the slower tiers, fastest first.
      clock: the scheduler's virtual clock (set by the scheduler that owns it).
    """

    def __init__(self, device: KVTier, num_requests: int, tiers: Sequence[PageTier]) -> None:
        super().__init__(device, num_requests)
        for tier in tiers:
            self.add(tier)
        self.lower: list[PageTier] = list(tiers)
        self.clock: Callable[[], float] = lambda: 0.0
        self._horizon = 0.0  # the latest move end a step has been made to wait for
        self.carried_s = 0.0  # stall the step being scheduled owes its evictions' moves
        self.on_change: Callable[[], None] = lambda: None  # a lookup's memo is stale
        # Changes that can shorten a lookup's run or move one of its pages to another
        # tier: a page evicted from a slower tier, or one cached on a tier above another
        # that holds it. Any other change (a new page cached) can only lengthen a run, so
        # a lookup whose count is unchanged goes on from where its run ended.
        self.num_reorders = 0
        # The host tier's pages, where an engine copies real KV (None: the simulator).
        self.contents: Optional[PageContents] = None
        # Host-tier hits taken at admission, to put into their device pages once the
        # step has allocated them: (request, its first loaded page's index, pages, the KV).
        self._landing: list[tuple[int, int, int, object]] = []

    # ------------------------------------------------------------------ moves
    def _tier(self, index: int) -> PageTier:
        tier = self.tiers[index]
        assert isinstance(tier, PageTier)
        return tier

    def _move(self, source: int, target: int, num_pages: int, ready_s: float) -> float:
        """Queues `num_pages` from tier `source` to tier `target` over each link between
        them in turn; returns when they arrive."""
        if num_pages == 0 or source == target:
            return ready_s
        num_bytes = num_pages * self._tier(max(source, target)).page_bytes
        if source < target:  # down: the upper link first
            for k in range(source + 1, target + 1):
                ready_s = self._tier(k).link.down.enqueue(ready_s, num_bytes)
                self._tier(k).stats["write_bytes"] += num_bytes
        else:
            for k in range(source, target, -1):
                ready_s = self._tier(k).link.up.enqueue(ready_s, num_bytes)
                self._tier(k).stats["read_bytes"] += num_bytes
        return ready_s

    def wait(self, end_s: float, tier: int) -> float:
        """The step being scheduled waits until `end_s`: the seconds it waits beyond the
        moves it already waits for (charged to tier `tier`). 0 when an engine copies
        the pages: its measured clock has the copies."""
        if self.contents is not None:
            return 0.0
        base = max(self.clock(), self._horizon)
        extra = max(0.0, end_s - base)
        self._horizon = max(base, end_s)
        self._tier(tier).stats["stall_s"] += extra
        return extra

    def take_carried(self) -> float:
        """The stall the step owes the write-backs its allocation caused (then 0)."""
        carried, self.carried_s = self.carried_s, 0.0
        return carried

    # ------------------------------------------------------------------- swap
    def has_room(self, tier: int, num_pages: int) -> bool:
        """Whether tier `tier` can take `num_pages` swapped pages (evicting cached ones)."""
        return self._tier(tier).num_swapped + num_pages <= self._tier(tier).capacity_pages

    def move_away(self, ids: NDArray[np.int64],  # [n] holding device pages
                  pool: KVPool, tier: int) -> float:
        """Swaps these requests' pages out to tier `tier` (making room by evicting cached
        pages); returns the stall: their device pages are taken by this step."""
        num_pages = pool.num_held[ids].copy()  # [n]
        total = int(num_pages.sum())
        if not self.has_room(tier, total):
            raise RuntimeError(f"KV tier {self.tiers[tier].name!r} is full")
        target = self._tier(tier)
        self._make_room(tier, total)
        target.num_swapped += total
        target.stats["swapped_out_pages"] += total
        if self.contents is not None:  # before the caller frees the pages for the step
            for request in ids.tolist():
                pages = pool.pages_of(request)
                self.contents.save(swap_keys(request, pages.size), pages)
        self.tier_of[ids] = tier
        self.pages_away[ids] = num_pages
        self._num_away += int(ids.size)
        return self.wait(self._move(DEVICE, tier, total, self.clock()), tier)

    def bring_back(self, ids: NDArray[np.int64],  # [a] from `away`, device pages allocated
                   pool: KVPool) -> float:
        """Swaps these requests' pages back in; returns the stall."""
        seconds = 0.0
        now = self.clock()
        for tier in np.unique(self.tier_of[ids]).tolist():
            moving = ids[self.tier_of[ids] == tier]
            total = int(self.pages_away[moving].sum())
            self._tier(tier).stats["swapped_in_pages"] += total
            if self.contents is not None:  # into the pages just allocated (`drop` forgets)
                for request, count in zip(moving.tolist(), self.pages_away[moving].tolist()):
                    self.contents.put(self.contents.take(swap_keys(request, count)),
                                      pool.pages_of(request)[:count])
            seconds += self.wait(self._move(tier, DEVICE, total, now), tier)
        self.drop(ids)
        return seconds

    def drop(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Forgets these requests' swapped pages (back on the device, or done)."""
        if self._num_away == 0:
            return
        away = ids[self.tier_of[ids] != DEVICE]
        for request, tier, count in zip(away.tolist(), self.tier_of[away].tolist(),
                                        self.pages_away[away].tolist()):
            self._tier(tier).num_swapped -= count
            if self.contents is not None:
                self.contents.discard(swap_keys(request, count))
        super().drop(ids)

    # ----------------------------------------------------------- prefix pages
    def _make_room(self, tier: int, num_pages: int) -> None:
        """Evicts cached pages of tier `tier` until `num_pages` more fit (or none is
        left); write-back sends each down a tier (the move overlaps the steps)."""
        target = self._tier(tier)
        spilled: list[Hashable] = []
        while target.cached and target.num_used + num_pages > target.capacity_pages:
            name = target.policy.victim()
            if name is None or name not in target.cached:
                raise CachePolicyError(
                    target.policy, "victim_not_held",
                    f"victim() returned {name!r}, which the {target.name} tier does not hold "
                    f"(it holds {len(target.cached)} cached pages; give one of them)")
            del target.cached[name]
            self.num_reorders += 1
            target.ready_s.pop(name, None)
            target.stats["evictions"] += 1
            spilled.append(name)
        if spilled and self.contents is not None:
            self.contents.discard(spilled)
        if spilled and tier + 1 < len(self.tiers) and target.policy.placement == "write_back":
            self._insert(tier + 1, spilled, source=tier, ready_s=self.clock())
        if spilled:
            self.on_change()

    def _insert(self, tier: int, names: Sequence[Hashable], *, source: int,
                ready_s: float, moves: bool = True) -> float:
        """Caches `names` (not there yet) on tier `tier`, sent from tier `source` from
        `ready_s` on (`moves`: over the links; else they are already passing through).
        Write-through sends them on down. Returns when they arrive."""
        target = self._tier(tier)
        new = [name for name in names if name not in target.cached]
        if not new:
            return ready_s
        self._make_room(tier, len(new))
        room = target.capacity_pages - target.num_used
        new = new[:max(room, 0)]  # swapped pages fill it: the rest are dropped
        end = self._move(source, tier, len(new), ready_s) if moves else ready_s
        below = self.lower[tier:]  # lower[tier - 1] is this tier
        if below and any(name in deeper.cached for deeper in below for name in new):
            self.num_reorders += 1  # a lookup now finds these on this faster tier
        for name in new:
            target.cached[name] = None
            target.policy.inserted(name)
        if tier + 1 < len(self.tiers) and target.policy.placement == "write_through":
            self._insert(tier + 1, new, source=tier, ready_s=end)
        self.on_change()
        return end

    def spill(self, names: Sequence[Hashable],
              pages: Optional[NDArray[np.int32]] = None) -> None:  # [n] their device pages
        """Pages the device's prefix cache just evicted: written back to the host tier
        (the step that takes their device pages waits for the copy), unless it holds
        them already or its policy drops them."""
        host = self._tier(1)
        if host.policy.placement != "write_back":
            return
        new = [name for name in names if name not in host.cached]
        if new:
            end = self._insert(1, new, source=DEVICE, ready_s=self.clock())
            self.carried_s += self.wait(end, 1)
            self._copy_out(new, names, pages)

    def filled(self, names: Sequence[Hashable],
               pages: Optional[NDArray[np.int32]] = None) -> None:  # [n] their device pages
        """Pages just filled on the device: written through to the host tier (the copy
        overlaps the steps that follow) when its policy writes through."""
        host = self._tier(1)
        if host.policy.placement == "write_through":
            # Only an engine's tier copies: the simulator's hot path lists nothing.
            new = ([name for name in names if name not in host.cached]
                   if self.contents is not None else [])
            self._insert(1, names, source=DEVICE, ready_s=self.clock())
            self._copy_out(new, names, pages)

    def _copy_out(self, new: Sequence[Hashable], names: Sequence[Hashable],
                  pages: Optional[NDArray[np.int32]]) -> None:  # [len(names)]
        """Copies those of `new` (of `names`, on device `pages`) the host tier took."""
        if self.contents is None or not new:
            return
        if pages is None:
            raise RuntimeError("the host tier copies KV: it needs the device pages")
        cached = self._tier(1).cached
        page_of = dict(zip(names, pages.tolist()))
        kept = [name for name in new if name in cached]
        if kept:
            self.contents.save(kept, np.array([page_of[name] for name in kept], np.int32))

    def lower_hits(self, names: Sequence[Hashable], found: Optional[list[int]] = None
                   ) -> list[int]:
        """The tier holding each of `names` (those after a request's device hit), as
        long as some slower tier holds them all (the run ends at the first miss);
        `found`: a run already found for the first of them, to go on from."""
        found = [] if found is None else found
        names = names[len(found):]
        for name in names:
            for k, tier in enumerate(self.lower, start=1):
                if name in tier.cached:
                    found.append(k)
                    break
            else:
                break
        return found

    def load(self, names: Sequence[Hashable], tiers: Sequence[int],
             into: Optional[tuple[int, int]] = None) -> float:
        """Loads a request's prefix pages (`names`, on `tiers`: from `lower_hits`) into
        device pages: each counts a hit there, a disk page passes through (and stays in)
        the host tier. Returns the stall. With `contents`, their KV is taken now and put
        into the pages `into` (request, index of its first such page) names, at `land`."""
        if self.contents is not None and into is not None:
            self._landing.append((*into, len(names), self.contents.take(names)))
        now = self.clock()
        stall = 0.0
        for k in sorted(set(tiers)):
            those = [name for name, tier in zip(names, tiers) if tier == k]
            tier = self._tier(k)
            tier.stats["hit_pages"] += len(those)
            ready = max([now, *(tier.ready_s.pop(name, now) for name in those)])
            for name in those:
                # An earlier load of the same admission may have pushed it out since the
                # lookup (its promotion to host memory spilled to disk): it is still read
                # from where the lookup found it, an approximation of a few pages.
                if name in tier.cached:
                    tier.policy.hit(name)
            if k > 1:  # disk -> host (kept there) -> device
                ready = self._insert(1, those, source=k, ready_s=ready)
                k_from = 1
            else:
                k_from = k
            stall += self.wait(self._move(k_from, DEVICE, len(those), ready), k)
        return stall

    def land(self, pool: KVPool) -> None:
        """Puts the host-tier hits taken at admission into the device pages the step
        allocated for them (before it is dispatched)."""
        if not self._landing:
            return
        contents = self.contents
        assert contents is not None
        for request, first, count, taken in self._landing:
            contents.put(taken, pool.pages_of(request)[first:first + count])
        self._landing = []

    def prefetch(self, names: Sequence[Hashable], tiers: Sequence[int]) -> None:
        """Starts a queued request's pages found below the host tier towards it (no step
        waits: its admission waits for what has not arrived yet)."""
        host = self._tier(1)
        for k in sorted({tier for tier in tiers if tier > 1}):
            # At most a quarter of the host tier on its way at once: more would evict the
            # prefetches of the requests ahead before they are admitted.
            budget = host.capacity_pages // 4 - len(host.ready_s)
            below = [name for name, tier in zip(names, tiers)
                     if tier == k and name not in host.cached][:max(budget, 0)]
            if not below:
                return
            end = self._insert(1, below, source=k, ready_s=self.clock())
            for name in below:
                if name in host.cached:
                    host.ready_s[name] = end

    def summary(self, page_size: int) -> dict[str, dict[str, float]]:
        """Per slower tier: pages and tokens hit, bytes read and written, stall seconds,
        evictions, swapped pages each way, and its link."""
        out = {}
        for tier in self.lower:
            stats = dict(tier.stats)
            stats["hit_tokens"] = stats["hit_pages"] * page_size
            stats["capacity_pages"] = tier.capacity_pages
            stats["link"] = tier.link.name  # type: ignore[assignment]
            stats["cache_policy"] = tier.policy.name  # type: ignore[assignment]
            out[tier.name] = stats
        return out


def swap_tier(chain: TierChain) -> Optional[int]:
    """The index of the tier a swap moves to (`host`), or None."""
    for k, tier in enumerate(chain.tiers):
        if tier.name == "host":
            return k
    return None
