"""Several replicas behind a global router, on one virtual clock (simulator first).

Each replica is a whole `Scheduler` (its own policy, engine, KV pool and
clock) over the full workload. Requests are routed one at a time, in arrival
order: before routing a request that arrives at time `a`, every replica runs
its iterations up to `a` (`Scheduler.has_work`), so the router sees each
replica's state at the moment the request arrives. The chosen replica keeps
the request; every other one withdraws it (`Scheduler.withdraw`). Once all
requests are routed, each replica runs to the end on its own.

The router is a plugin (`orca_jax.cluster.routing.Router`; built-ins `round_robin`,
`least_outstanding`, `least_work` in `policies/routers.py`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.routing import ClusterView, Router, make_router
from orca_jax.core.engine_api import Engine
from orca_jax.core.plan import PlanError
from orca_jax.core.policy import Policy
from orca_jax.core.request import Request, RequestState
from orca_jax.core.run_result import RunResult
from orca_jax.core.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.view import SchedulerView


class Cluster:
    """`num_replicas` schedulers behind one router.

    Args:
      requests: the workload.
      num_replicas: replicas (>= 1).
      router: a `Router`, or its spec (registered name, `module:Class`, `file.py:Class`).
      make_policy: a fresh policy per replica (policies keep bookkeeping).
      make_engine: a fresh engine per replica.
      config: every replica's limits.
      router_options: the router's knobs as text, when `router` is a spec.
    """

    def __init__(self, requests: Sequence[Request], *, num_replicas: int,
                 router: Union[Router, str], make_policy: Callable[[], Policy],
                 make_engine: Callable[[], Engine], config: SchedulerConfig,
                 router_options: Optional[Mapping[str, str]] = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.router = router if isinstance(router, Router) else make_router(router,
                                                                             router_options)
        self.replicas = [Scheduler(requests, make_policy(), make_engine(), config)
                         for _ in range(num_replicas)]
        table = self.replicas[0].table
        # replica[i]: the replica serving request i (arrival order); -1: rejected up front.
        self.replica = np.full(len(table), -1, dtype=np.int64)
        self.now_s = 0.0  # the arrival being routed
        self._num_rejected = int(np.count_nonzero(table.state == RequestState.REJECTED))
        self._routed = np.zeros(num_replicas, dtype=np.int64)
        self._withdrawn = np.zeros(num_replicas, dtype=np.int64)
        self._not_admitted: list[list[int]] = [[] for _ in range(num_replicas)]
        self.view = ClusterView(self)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def replica_views(self) -> tuple[SchedulerView, ...]:
        """Each replica's live `SchedulerView`."""
        return tuple(r.view for r in self.replicas)

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not yet done there."""
        done = np.array([r.num_done for r in self.replicas]) - self._withdrawn - self._num_rejected
        return self._routed - done

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Requests routed to `replica` and not yet done (see `ClusterView`)."""
        scheduler = self.replicas[replica]
        state = scheduler.table.state
        pending = [i for i in self._not_admitted[replica] if state[i] == RequestState.PENDING]
        self._not_admitted[replica] = pending
        return np.concatenate([np.asarray(pending, dtype=np.int64), scheduler.waiting,
                               scheduler.running, scheduler.unreleased])

    @property
    def num_done(self) -> int:
        """Requests done: finished on their replica, or rejected up front."""
        return int(self._routed.sum() - self.outstanding().sum()) + self._num_rejected

    def run(self, progress: Optional[Callable[[int], None]] = None) -> RunResult:
        """Routes every request at its arrival, runs each replica to the end, and
        returns the replicas' results joined (`RunResult.concat`).

        Args:
          progress: called with `num_done` after each routed request and each
            step of the final drain.
        """
        for replica in self.replicas:
            replica.engine.warmup(replica.bucket_config.buckets())
        table = self.replicas[0].table
        for request in np.flatnonzero(table.state == RequestState.PENDING).tolist():
            self.now_s = float(table.arrival_s[request])
            for replica in self.replicas:
                while replica.now_s < self.now_s and replica.has_work(self.now_s):
                    replica.step()
            target = route_checked(self.router, self.view, request)
            self.replica[request] = target
            self._routed[target] += 1
            self._not_admitted[target].append(request)
            for index, replica in enumerate(self.replicas):
                if index != target:
                    replica.withdraw([request])
                    self._withdrawn[index] += 1
            if progress:
                progress(self.num_done)
        for replica in self.replicas:
            while not replica.done:
                replica.step()
                if progress:
                    progress(self.num_done)
        return RunResult.concat([r.result() for r in self.replicas], router=self.router.name)


def route_checked(router: Router, view: ClusterView, request: int) -> int:
    """`router.route(view, request)`, checked to name one of the view's replicas.

    Raises:
      PlanError: the router returned something else (kind `router`).
    """
    target = router.route(view, request)
    if not (isinstance(target, (int, np.integer)) and 0 <= target < view.num_replicas):
        raise PlanError(router.name, "replica_out_of_range",
                        f"route() returned {target!r} for request {request}; replicas "
                        f"are 0..{view.num_replicas - 1}", kind="router")
    return int(target)
