"""Built-in routers: how a cluster's replicas share the arrivals.

* `round_robin`: request k goes to replica k mod R.
* `least_outstanding`: the replica with the fewest requests routed to it and
  not yet done (a load balancer's least-request rule). Ties go round robin,
  from the replica after the last one chosen, so idle replicas share a light
  load evenly.
* `least_work`: the replica with the fewest tokens still to compute for its
  outstanding requests (prompt not yet prefilled plus output not yet
  generated). It reads each request's output length: an oracle, as `sjf` is,
  and the upper bound for length-aware routing.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from orca_jax.core.request import RequestState
from orca_jax.cluster.routing import ClusterView, Router, register_router


@register_router("round_robin")
@dataclasses.dataclass
class RoundRobin(Router):
    """Deals requests to replicas in turn."""

    _count: int = dataclasses.field(default=0, init=False, repr=False)

    def route(self, view: ClusterView, request: int) -> int:
        del request
        choice = self._count % view.num_replicas
        self._count += 1
        return choice


@dataclasses.dataclass
class LeastLoaded(Router):
    """Routes to the replica with the least `load`; ties go round robin, from the
    replica after the last one chosen. Subclasses define `load`."""

    _last: int = dataclasses.field(default=-1, init=False, repr=False)

    @abc.abstractmethod
    def load(self, view: ClusterView) -> np.ndarray:  # [R]
        """Each replica's load (lower is better)."""

    def route(self, view: ClusterView, request: int) -> int:
        del request
        load = self.load(view)
        order = (self._last + 1 + np.arange(load.size)) % load.size
        self._last = int(order[np.argmin(load[order])])
        return self._last


@register_router("least_outstanding")
@dataclasses.dataclass
class LeastOutstanding(LeastLoaded):
    """Fewest requests not yet done."""

    def load(self, view: ClusterView) -> np.ndarray:
        return view.outstanding()


@register_router("least_work")
@dataclasses.dataclass
class LeastWork(LeastLoaded):
    """Fewest tokens left to compute (an output-length oracle)."""

    def load(self, view: ClusterView) -> np.ndarray:
        work = np.zeros(view.num_replicas, dtype=np.int64)
        for r, replica in enumerate(view.replicas):
            table = replica.requests
            ids = view.outstanding_ids(r)
            ids = ids[table.state[ids] != RequestState.FINISHED]  # unreleased: no work left
            work[r] = int((table.prompt_len[ids] + table.output_len[ids]
                           - table.num_computed[ids]).sum())
        return work
