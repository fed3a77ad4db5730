"""Built-in rebalancers: which requests a cluster migrates between its replicas.

* `load_balance`: Llumnix's load balancing by virtual usage. A replica's
  virtual usage is the KV pages its requests hold plus the pages the head of
  its waiting queue needs to start, over its pool: a replica whose queue head
  does not fit looks full (Llumnix's de-fragmentation: making room for a queued
  request is the same move as balancing). While the most and least loaded
  replicas differ by more than `gap`, the most loaded one's running request
  with the fewest computed tokens (the least to copy) that fits moves to the
  least loaded one, if nothing waits there (a received request holding pages
  behind a queue could hold what its head needs) and the move does not turn the
  pair around (after it the target's virtual usage is at most the source's: else
  the next call would move a request straight back, and on a small pool the same
  request went back and forth at every call); at most `max_migrations` a call,
  each between its own pair.
* `priority_isolation`: Llumnix's priority isolation. A replica holding an
  urgent request (priority value at most `high_priority`) with less than
  `headroom` of its pool free sends its least urgent running request (the
  fewest computed tokens among those) to the replica with the most free pages
  that holds no urgent request, so the urgent one keeps room to grow and the
  batch it runs in stays small.

docs/clusters.md ("Migration") describes the mechanism.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.rebalancing import Migration, Rebalancer, register_rebalancer
from orca_jax.cluster.routing import ClusterView


def virtual_usage(view: ClusterView) -> NDArray[np.float64]:  # [R]
    """Each replica's used pages plus its queue head's demand, over its pool."""
    usage = np.zeros(view.num_replicas)
    table = view.requests
    for r, replica in enumerate(view.replicas):
        demand = 0
        if replica.waiting.size:
            head = replica.waiting[:1]
            tokens = table.prompt_len[head] + table.num_generated[head] - table.num_computed[head]
            demand = int(replica.pages_needed(head, np.maximum(tokens, 1))[0])
        usage[r] = (replica.num_used_pages + demand) / replica.num_kv_pages
    return usage


@register_rebalancer("load_balance")
@dataclasses.dataclass
class LoadBalance(Rebalancer):
    """Moves running requests from the most to the least loaded replica by virtual usage.

    Attributes:
      gap: the virtual-usage difference (a fraction of a pool) over which a request moves.
      max_migrations: migrations started per call at most.
    """

    gap: float = 0.2
    max_migrations: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.gap <= 1) or self.max_migrations < 1:
            raise ValueError(f"load_balance: gap in [0, 1] and max_migrations >= 1, got "
                             f"{self.gap}, {self.max_migrations}")

    def rebalance(self, view: ClusterView) -> list[Migration]:
        usage = virtual_usage(view)
        order = np.argsort(usage, kind="stable")  # least loaded first
        moving = set(view.migrating().tolist())
        table = view.requests
        moves: list[Migration] = []
        for k in range(min(self.max_migrations, view.num_replicas // 2)):
            target, source = int(order[k]), int(order[-1 - k])
            if usage[source] - usage[target] <= self.gap:
                break
            if view.replicas[target].waiting.size:
                # A request received holding pages would queue behind requests that
                # may need them (a policy that never preempts would wait forever).
                continue
            running = np.array([i for i in view.replicas[source].running.tolist()
                                if i not in moving], dtype=np.int64)
            if not running.size:
                continue
            computed = table.num_computed[running]
            to, origin = view.replicas[target], view.replicas[source]
            need = np.array([view.pages_to_receive(int(i), target) for i in running])
            # Each candidate's usage after the move: the source less the pages its leaving
            # frees (a page it shares stays), the target plus the pages it receives.
            freed = np.array([origin.pages_freed(np.array([i])) for i in running.tolist()])
            source_after = usage[source] - freed / origin.num_kv_pages
            target_after = usage[target] + need / to.num_kv_pages
            fits = (need <= to.kv_room()) & (target_after <= source_after)
            if not fits.any():
                continue
            candidates = running[fits]
            pick = candidates[np.lexsort((candidates, computed[fits]))[0]]
            moves.append(Migration(int(pick), source, target))
        return moves


@register_rebalancer("priority_isolation")
@dataclasses.dataclass
class PriorityIsolation(Rebalancer):
    """Moves normal requests away from replicas whose urgent requests lack headroom.

    Attributes:
      high_priority: requests with a priority value at most this are urgent (smaller is
        more urgent, as `Request.priority`).
      headroom: the fraction of a pool kept free on a replica holding an urgent request.
      max_migrations: migrations started per call at most.
    """

    high_priority: int = 0
    headroom: float = 0.2
    max_migrations: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.headroom <= 1) or self.max_migrations < 1:
            raise ValueError(f"priority_isolation: headroom in [0, 1] and max_migrations >= 1, "
                             f"got {self.headroom}, {self.max_migrations}")

    def rebalance(self, view: ClusterView) -> list[Migration]:
        table = view.requests
        moving = set(view.migrating().tolist())
        held = [np.concatenate([r.waiting, r.running]) for r in view.replicas]
        urgent = np.array([bool((table.priority[ids] <= self.high_priority).any())
                           for ids in held])  # [R]
        free = np.array([r.num_free_pages / r.num_kv_pages for r in view.replicas])  # [R]
        moves: list[Migration] = []
        taken = np.zeros(view.num_replicas, dtype=np.int64)  # [R] pages promised this call
        # The most crowded urgent replicas first; each sends one normal request away.
        for source in np.argsort(free, kind="stable").tolist():
            if len(moves) >= self.max_migrations:
                break
            if not urgent[source] or free[source] >= self.headroom:
                continue
            running = np.array([i for i in view.replicas[source].running.tolist()
                                if i not in moving and table.priority[i] > self.high_priority],
                               dtype=np.int64)
            if not running.size:
                continue
            # The least urgent first, then the fewest computed tokens (the least to copy).
            victim = int(running[np.lexsort((running, table.num_computed[running],
                                             -table.priority[running]))[0]])
            # Targets: replicas with no urgent request, the most free pages first.
            for target in np.argsort(-free, kind="stable").tolist():
                if target == source or urgent[target]:
                    continue
                room = view.replicas[target].kv_room() - taken[target]
                need = view.pages_to_receive(victim, target)
                if need <= room:
                    moves.append(Migration(victim, source, target))
                    taken[target] += need
                    break
        return moves
