"""Built-in rebalancers: which requests a cluster migrates between its replicas.

* `load_balance`: Llumnix's load balancing by virtual usage. A replica's
  virtual usage is the KV pages its requests hold plus the pages the head of
  its waiting queue needs to start, over its pool: a replica whose queue head
  does not fit looks full (Llumnix's de-fragmentation: making room for a queued
  request is the same move as balancing). While the most and least loaded
  replicas differ by more than `gap`, the most loaded one's running request
  with the fewest computed tokens (the least to copy) that fits moves to the
  least loaded one, if nothing waits there (a received request holding pages
  behind a queue could hold what its head needs); at most `max_migrations` a
  call, each between its own pair.

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
            room = view.replicas[target].kv_room()
            need = np.array([view.pages_to_receive(int(i), target) for i in running])
            fits = need <= room
            if not fits.any():
                continue
            candidates = running[fits]
            pick = candidates[np.lexsort((candidates, computed[fits]))[0]]
            moves.append(Migration(int(pick), source, target))
        return moves
