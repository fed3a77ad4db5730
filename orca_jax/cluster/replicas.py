"""Several replicas behind a global router, on one virtual clock (simulator first).

Each replica is a whole `Scheduler` (its own policy, engine, KV pool and
clock) that holds only the requests routed to it: the replicas share one
request table (`RequestTable.for_replica`), in which each request's row is
written by the replica holding it. Requests are routed one at
a time, in arrival order, when they arrive: the cluster runs on the
`event_loop.EventLoop`, in which every replica steps up to an arrival before
it is routed, so the router sees each replica's state at that moment. The
chosen replica is given the request (`Scheduler.submit`).

The router is a plugin (`orca_jax.cluster.routing.Router`; built-ins `round_robin`,
`least_outstanding`, `least_work` in `policies/routers.py`).
"""

from __future__ import annotations

import operator
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.elastic import Elastic, ScalingSpec
from orca_jax.cluster.event_loop import EventLoop, ReplicaPool, route_checked, share_table
from orca_jax.cluster.migration import MigrationSpec, Migrator
from orca_jax.cluster.planning import Planner, make_planner
from orca_jax.cluster.rebalancing import Rebalancer, make_rebalancer
from orca_jax.cluster.routing import ClusterView, Router, make_router, routes_blind
from orca_jax.core.api.policy import Policy
from orca_jax.core.loop.scheduler import SchedulerConfig
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.engine_api import Engine

_NUM_DONE = operator.attrgetter("num_done")  # a replica's requests done

# What `from orca_jax.cluster import *` gave when the cluster was one module.
__all__ = ["Cluster", "ClusterView", "Router", "make_router", "route_checked"]


class Cluster(EventLoop):
    """`num_replicas` schedulers behind one router.

    Args:
      requests: the workload.
      num_replicas: replicas (>= 1).
      router: a `Router`, or its spec (registered name, `module:Class`, `file.py:Class`).
      make_policy: a fresh policy per replica (policies keep bookkeeping).
      make_engine: a fresh engine per replica.
      config: every replica's limits.
      router_options: the router's knobs as text, when `router` is a spec.
      rebalancer: None (requests stay where they are routed), or a `Rebalancer` or its
        spec, asked every `migration.interval_s` which requests to migrate.
      rebalancer_options: the rebalancer's knobs as text, when it is a spec.
      migration: how migrations are priced (needed with a rebalancer).
      planner: None (a fixed `num_replicas`), or a `Planner` or its spec, asked every
        `scaling.interval_s` how many replicas to run (`orca_jax.cluster.elastic`):
        `num_replicas` are ready at the start, `scaling.max_replicas` are built.
      planner_options: the planner's knobs as text, when it is a spec.
      scaling: the planner's caps, interval and start-up delay (needed with a planner).
      kv_counts_only: the caller's word that nothing outside the KV memory reads pages
        (`Scheduler`'s): granted to the replicas only where no request moves between
        them with its KV, i.e. without a rebalancer (a migration copies the pages it
        moves: `Migrator`). A planner starts and drains whole replicas and moves no
        KV; agent programs' pins count pages (and are one replica's only). Default
        False: the full pools.
      log_tokens: keep every generated token's request and time (`Scheduler`'s; the
        joined `RunResult.token_req`, 16 bytes a token). False counts each replica's
        tokens into its own tally, what one replica keeps (`RunResult.token_stats`,
        joined), where each request's tokens are all on one replica: without a
        rebalancer or a planner (a migrated or re-routed request's gap between two
        replicas is in neither's tally), which keep the logs. Default True.
    """

    def __init__(self, requests: Sequence[Request], *, num_replicas: int,
                 router: Union[Router, str], make_policy: Callable[[], Policy],
                 make_engine: Callable[[], Engine], config: SchedulerConfig,
                 router_options: Optional[Mapping[str, str]] = None,
                 rebalancer: Union[Rebalancer, str, None] = None,
                 rebalancer_options: Optional[Mapping[str, str]] = None,
                 migration: Optional[MigrationSpec] = None,
                 planner: Union[Planner, str, None] = None,
                 planner_options: Optional[Mapping[str, str]] = None,
                 scaling: Optional[ScalingSpec] = None,
                 kv_counts_only: bool = False, log_tokens: bool = True) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if isinstance(planner, str):
            planner = make_planner(planner, planner_options)
        if planner is not None and scaling is None:
            raise ValueError(f"planner {planner.name!r}: give its caps (ScalingSpec)")
        if planner is not None and rebalancer is not None:
            raise ValueError(f"planner {planner.name!r} and rebalancer {rebalancer!r}: one "
                             "run takes one of them for now")
        if isinstance(rebalancer, str):
            rebalancer = make_rebalancer(rebalancer, rebalancer_options)
        if rebalancer is not None and num_replicas < 2:
            raise ValueError(f"rebalancer {rebalancer.name!r}: migration needs 2 or more "
                             f"replicas, got num_replicas={num_replicas}")
        if rebalancer is not None and migration is None:
            raise ValueError(f"rebalancer {rebalancer.name!r}: give the migration's price "
                             "(MigrationSpec)")
        self.router = router if isinstance(router, Router) else make_router(router,
                                                                             router_options)
        built = num_replicas if planner is None or scaling is None else scaling.max_replicas
        # Nothing moves a request with its KV between these replicas but a migration.
        self.replicas = share_table(requests, built, make_policy, make_engine, config,
                                    kv_counts_only=kv_counts_only and rebalancer is None,
                                    log_tokens=(log_tokens or rebalancer is not None
                                                or planner is not None))
        table = self.replicas[0].table
        rejected = table.state == RequestState.REJECTED  # up front, on every replica
        self._num_rejected = int(np.count_nonzero(rejected))
        self._num_routable = len(table) - self._num_rejected  # arrivals and program calls
        self._num_routed = 0
        # replica[i]: the replica serving request i (arrival order); -1: rejected up front.
        self.replica = np.full(len(table), -1, dtype=np.int64)
        self._pool = ReplicaPool(self.replicas, self.router)
        self.view = self._pool.view
        # A program call with parents is routed when the run releases it (`CallRelease`).
        later = (table.programs.has_parents if table.programs is not None
                 else np.zeros(len(table), dtype=bool))
        super().__init__([self._pool], np.flatnonzero(~rejected & ~later), table.arrival_s)
        self.migrator = (None if rebalancer is None
                         else Migrator(self, self._pool, rebalancer, migration))
        self.elastic = (None if planner is None or scaling is None
                        else Elastic(self, self._pool, planner, scaling, num_replicas))
        # A router that reads no state routes every arrival when the run starts, and each
        # replica leaps up to its own next arrival (nothing else acts on the replicas).
        self._routes_ahead = (self.programs is None and self.migrator is None
                              and self.elastic is None and routes_blind(self.router))
        if self.programs is None and not self._routes_ahead:
            self.leap_between_events()  # a program call's release would act across replicas

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def now_s(self) -> float:
        """The arrival time of the latest routed request."""
        return self._pool.now_s

    @property
    def replica_views(self) -> tuple[SchedulerView, ...]:
        """Each replica's live `SchedulerView`."""
        return self._pool.replica_views

    @property
    def replica_ids(self) -> range:
        """Each replica's index: all of them take requests (see `ClusterView.replica_ids`)."""
        return self._pool.replica_ids

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not yet done there."""
        return self._pool.outstanding()

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Requests routed to `replica` and not yet done (see `ClusterView`)."""
        return self._pool.outstanding_ids(replica)

    @property
    def num_done(self) -> int:
        """Requests done: finished on their replica, or rejected up front."""
        # Every replica counts the requests rejected up front and those it does not hold
        # (all arrivals but the ones routed to it) as done: count each request once.
        counted_by_all = self.num_replicas * (self._num_rejected + self._num_routable)
        # map, not a generator: it is asked after every event of a run with progress.
        return (sum(map(_NUM_DONE, self.replicas)) - counted_by_all
                + self._num_rejected + self._num_routed)

    def run(self, progress: Optional[Callable[[int], None]] = None) -> RunResult:
        """Routes every request at its arrival, runs each replica to the end, and
        returns the replicas' results joined (`RunResult.concat`).

        Args:
          progress: called with `num_done` after each event (an arrival, a step).
        """
        if self._routes_ahead and self.has_events():
            # Events pushed from outside before the run (a test's `Migrate`, say) act on
            # replicas as no blind topology's own do: route each arrival when it comes.
            self._routes_ahead = False
            self.leap_between_events()
        if self._routes_ahead:
            self._route_ahead()
        if self.migrator is not None:
            self.migrator.start()
        if self.elastic is not None:
            self.elastic.start()
        self.run_events(None if progress is None else lambda: progress(self.num_done))
        return RunResult.concat([r.result() for r in self.replicas], router=self.router.name)

    def stepped(self, pool: int, index: int) -> None:
        if self.elastic is not None:
            self.elastic.stepped(index)

    def migrated(self, request: int, target: int) -> None:
        self.replica[request] = target

    def _route_ahead(self) -> None:
        """Asks the router (`Router.state_blind`) for the replica of every arrival, in
        arrival order, each at its arrival time, and lets each replica leap up to its own
        next arrival (`EventLoop.leap_to_own_arrivals`)."""
        arrival_s = self.arrival_s.tolist()
        targets = np.array([self._pool.choose(request, arrival_s[request])
                            for request in self.arrivals.tolist()], dtype=np.int64)  # [A]
        self._pool.now_s = 0.0  # the moment being routed: none yet
        self.leap_to_own_arrivals(targets)

    def route_arrival(self, request: int, when: float) -> None:
        target = self.routed_ahead(request)
        if target is None:
            target = self._pool.route(request, when)
        else:
            self._pool.take(request, target, when)
        self.replica[request] = target
        self._num_routed += 1
        self.replicas[target].submit([request])
        self.wake(0, target)
