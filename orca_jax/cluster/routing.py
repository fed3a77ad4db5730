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
    def now_s(self) -> float:
        """The arrival time of the request being routed."""

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not yet done there."""

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Request indices routed to `replica` and not yet done."""


class ClusterView:
    """What `Router.route` sees: every replica's live view, at the request's arrival.

    Attributes:
      replicas: each replica's `SchedulerView` (its queues, KV pool and limits,
        and its own progress on every request it was sent).
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
        self.requests = self.replicas[0].requests
        self.seed: int = self.replicas[0].seed
        self.ttft_slo_s: Optional[float] = self.replicas[0].ttft_slo_s
        self.tpot_slo_s: Optional[float] = self.replicas[0].tpot_slo_s

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def now_s(self) -> float:
        """The arrival time of the request being routed."""
        return self._cluster.now_s

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not yet done there."""
        return self._cluster.outstanding()

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Request indices routed to `replica` and not yet done: not yet admitted,
        waiting, running, or finished but unreleased."""
        return self._cluster.outstanding_ids(replica)


class Router(abc.ABC):
    """Base class of every router (see the module docstring)."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def route(self, view: ClusterView, request: int) -> int:
        """Picks the replica for `request` (an index into `view.requests`).

        Returns:
          A replica index in `[0, view.num_replicas)`.
        """


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
