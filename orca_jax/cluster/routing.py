"""The router API: which replica of a cluster serves each arriving request.

A router is a small class, like a policy: `route(view, request) -> replica`,
with its knobs as dataclass fields and its own bookkeeping in its own fields.
It is loaded by registered name, `package.module:Class` or `file.py:Class`
(`--router`, options in `--router_opts`). The built-ins live in
`policies/routers.py`; routers never import jax.

    @register_router("least_outstanding")
    class LeastOutstanding(Router):
        def route(self, view: ClusterView, request: int) -> int:
            return int(np.argmin(view.outstanding()))

The `chain` router is built of smaller plugins, llm-d's filter → score → pick
stages: `RouteFilter`, `RouteScorer` and `RoutePicker`, registered with
`register_route_filter` (`_scorer`, `_picker`) and loaded as routers are.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Mapping, Optional, Protocol, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.api import plugins
from orca_jax.core.plans.view import SchedulerView

_ROUTERS: dict[str, type["Router"]] = {}


class ClusterState(Protocol):
    """What a `ClusterView` reads of its cluster (`orca_jax.cluster.event_loop.ReplicaPool`)."""

    @property
    def replica_views(self) -> Sequence[SchedulerView]:
        """Each replica's live view."""

    @property
    def replica_ids(self) -> Sequence[int]:
        """Each view's replica, named by its index in the cluster's pool."""

    @property
    def now_s(self) -> float:
        """The arrival time of the request being routed (a rebalancer's: when it is asked)."""

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not yet done there."""

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Request indices routed to `replica` and not yet done."""

    def migrating_ids(self) -> NDArray[np.int64]:  # [m]
        """Requests whose migration between replicas is under way."""

    def pages_to_receive(self, request: int, replica: int) -> int:
        """KV pages `replica` would reserve to receive `request` as it is now."""


class ClusterView:
    """What `Router.route` sees: every replica's live view, at the request's arrival.

    Attributes:
      replicas: each replica's `SchedulerView` (its queues, KV pool and limits,
        and its own progress on every request it was sent). A router answers with a
        position in this tuple.
      replica_ids: `[R]` each position's replica, named by its index in the cluster's
        pool: `0..R-1` while every replica takes requests; under a planner, the ready
        replicas only, renumbered `0..k-1` by position, so a position may name another
        replica after a replica starts or stops, while its id stays. A router that
        remembers replicas across calls (a program's home, a hash ring's owners) keeps
        ids and finds their positions with `position_of`.
      requests: the pool's shared request table (a `RequestTableView`): the
        workload's facts (arrival, prompt and output length, priority, tenant) by
        request index, and each request's progress on the replica holding it
        (`holder`, -1 for a request not routed yet).
      seed: the run's seed (`--seed`): seed a randomized router with it.
      ttft_slo_s, tpot_slo_s: the run's SLOs (None when unset).
    """

    def __init__(self, cluster: ClusterState) -> None:
        self._cluster = cluster
        self.replicas: tuple[SchedulerView, ...] = tuple(cluster.replica_views)
        self.replica_ids: tuple[int, ...] = tuple(int(i) for i in cluster.replica_ids)
        self.requests = self.replicas[0].requests
        self.seed: int = self.replicas[0].seed
        self.ttft_slo_s: Optional[float] = self.replicas[0].ttft_slo_s
        self.tpot_slo_s: Optional[float] = self.replicas[0].tpot_slo_s

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def now_s(self) -> float:
        """The arrival time of the request being routed (a rebalancer's: when it is asked)."""
        return self._cluster.now_s

    def position_of(self, replica_id: int) -> Optional[int]:
        """The position in `replicas` of the replica named `replica_id` (`replica_ids`),
        or None where it takes no requests now (stopped, starting or draining)."""
        try:
            return self.replica_ids.index(replica_id)
        except ValueError:
            return None

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not yet done there."""
        return self._cluster.outstanding()

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Request indices routed to `replica` and not yet done: not yet admitted,
        waiting, running, or finished but unreleased."""
        return self._cluster.outstanding_ids(replica)

    def migrating(self) -> NDArray[np.int64]:  # [m]
        """Requests whose migration between replicas is under way, sorted (a rebalancer's
        `orca_jax.cluster.migration`; empty without one)."""
        return self._cluster.migrating_ids()

    def pages_to_receive(self, request: int, replica: int) -> int:
        """KV pages `replica` would reserve to receive `request` (a migration of its
        computed tokens) now: those tokens' pages, or its admission's reservation if
        larger. A migration starts only if they fit beside the watermark
        (`view.replicas[replica].kv_room()`)."""
        return self._cluster.pages_to_receive(request, replica)


class Router(abc.ABC):
    """Base class of every router (see the module docstring).

    Attributes:
      state_blind: the router's promise that `route` reads nothing that the run changes:
        its choice depends only on the request's workload facts (`view.requests.spec`,
        its arrival, lengths, tenant, priority), the view's fixed fields (`num_replicas`,
        `seed`, the SLOs) and the router's own record of its earlier choices, never on
        the replicas' state, `outstanding`, `now_s` or a request's progress. A colocated
        cluster with nothing else acting on its replicas (no rebalancer, planner or agent
        programs) then routes every arrival before the run starts, and each replica leaps
        up to the next arrival routed to it instead of the next arrival of the whole
        cluster (`replicas.Cluster`; the results are the same). False by default: a
        router that declares nothing is asked at each arrival. A promise covers the
        `route` of the class that makes it: a subclass that overrides `route` and not
        `state_blind` promises nothing (`routes_blind`).
    """

    name: ClassVar[str] = ""
    state_blind: ClassVar[bool] = False

    @abc.abstractmethod
    def route(self, view: ClusterView, request: int) -> int:
        """Picks the replica for `request` (an index into `view.requests`).

        Returns:
          A replica index in `[0, view.num_replicas)`.
        """


def routes_blind(router: Router) -> bool:
    """Whether `router` promised to route without reading the run's state
    (`Router.state_blind`), in the class that defines its `route` or a subclass of it."""
    return router.state_blind and plugins.declared_with(type(router), "state_blind", "route")


register_router = plugins.registrar(_ROUTERS, Router, kind="router",
                                    decorator="register_router")


def registered_routers() -> dict[str, type[Router]]:
    """The registered routers by name (a copy; import `policies` for the built-ins)."""
    return dict(_ROUTERS)


def resolve_router_class(spec: str) -> type[Router]:
    """Finds the router class for a registered name, `module:Class` or `file.py:Class`."""
    return plugins.resolve_class(spec, kind="router", plural="routers", registry=_ROUTERS,
                                 base=Router)


def make_router(spec: str, options: Optional[Mapping[str, str]] = None) -> Router:
    """Builds a router from its spec and string options (`--router_opts`).

    Raises:
      PolicyLoadError: the spec does not resolve, or an option is unknown or mistyped.
    """
    return plugins.build(resolve_router_class(spec), options, "router")


# ------------------------------------------------------------ a chain's stages
class RouteStage(abc.ABC):
    """Base class of a filter → score → pick chain's stages (the `chain` router of
    `policies/router_chain.py`): a small plugin, like a router, with its knobs as
    dataclass fields, loaded by registered name, `module:Class` or `file.py:Class`.
    Each stage sees the candidate replicas left by the stages before it."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # `filter`, `scorer` or `picker`, for messages


class RouteFilter(RouteStage):
    """Drops replicas that must not take the request (over a load bound, short of KV)."""

    kind = "filter"

    @abc.abstractmethod
    def keep(self, view: ClusterView, request: int,
             replicas: NDArray[np.int64]) -> NDArray[np.bool_]:  # [C] -> [C]
        """Which of the candidate `replicas` may take `request`."""


class RouteScorer(RouteStage):
    """Scores each candidate replica for the request: higher is better."""

    kind = "scorer"

    @abc.abstractmethod
    def score(self, view: ClusterView, request: int,
              replicas: NDArray[np.int64]) -> NDArray[np.float64]:  # [C] -> [C]
        """A finite score per candidate replica (the chain refuses NaN and inf)."""


class RoutePicker(RouteStage):
    """Chooses one candidate replica from the candidates' summed scores."""

    kind = "picker"

    @abc.abstractmethod
    def pick(self, view: ClusterView, request: int, replicas: NDArray[np.int64],  # [C]
             scores: NDArray[np.float64]) -> int:  # [C]
        """One of `replicas` (a replica index, not a position in `replicas`)."""


_STAGES: dict[str, dict[str, type[RouteStage]]] = {
    "filter": {}, "scorer": {}, "picker": {}}
_STAGE_BASES: dict[str, type[RouteStage]] = {
    "filter": RouteFilter, "scorer": RouteScorer, "picker": RoutePicker}
register_route_filter = plugins.registrar(_STAGES["filter"], RouteFilter, kind="filter",
                                          decorator="register_route_filter")
register_route_scorer = plugins.registrar(_STAGES["scorer"], RouteScorer, kind="scorer",
                                          decorator="register_route_scorer")
register_route_picker = plugins.registrar(_STAGES["picker"], RoutePicker, kind="picker",
                                          decorator="register_route_picker")


def registered_route_stages(kind: str) -> dict[str, type[RouteStage]]:
    """The registered stages of `kind` (`filter`, `scorer`, `picker`) by name (a copy)."""
    return dict(_STAGES[kind])


def resolve_route_stage_class(kind: str, spec: str) -> type[RouteStage]:
    """Finds the `kind` stage class for a registered name, `module:Class` or `file.py:Class`.

    Raises:
      PolicyLoadError: the spec does not resolve to a stage of that kind.
    """
    return plugins.resolve_class(spec, kind=kind, plural=f"{kind}s", registry=_STAGES[kind],
                                 base=_STAGE_BASES[kind])


def make_route_stage(kind: str, spec: str,
                     options: Optional[Mapping[str, str]] = None) -> RouteStage:
    """Builds a `kind` stage from its spec and string options.

    Raises:
      PolicyLoadError: the spec does not resolve, or an option is unknown or mistyped.
    """
    return plugins.build(resolve_route_stage_class(kind, spec), options, kind)
