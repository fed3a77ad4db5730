"""The cluster part of a run's spec: replicas, routers, disaggregated pools, migration and
the planner of an elastic cluster."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from orca_jax.cluster.rebalancing import MIGRATION_MODES
from orca_jax.core.api.plugins import parse_options
from orca_jax.runner.spec_fields import check_at_least, check_choice, check_positive, knob
from orca_jax.specs.hardware import KV_LINK_ALIASES, KV_LINK_PRESETS, get_kv_link

KV_LINK_NAMES = (*KV_LINK_PRESETS, *KV_LINK_ALIASES)

# A planner's settings besides its name and knobs (set only with a planner).
PLANNER_FIELDS = ("planner_interval_s", "min_replicas", "max_replicas", "replica_startup_s",
                  "replica_load_link")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Replicas behind a global router (`orca_jax.cluster`); one replica by default.

    With `num_prefill_replicas` and `num_decode_replicas` (both >= 1) the cluster
    is disaggregated (`orca_jax.cluster.disaggregated`): a prefill pool and a
    decode pool, each behind its own router, with each request's KV moved between
    them over `kv_link`. Each pool runs the run's policy unless
    `prefill_policy`/`decode_policy` name another (knobs: `*_policy_opts`, or
    the run's when the policy is the run's).
    """

    num_replicas: int = knob(1, "Replicas behind a global router, each with its own "
                             "scheduler, KV pool and engine (jax: each its own KV cache, "
                             "in this process).")
    router: str = knob("round_robin", "How num_replicas > 1 replicas share the arrivals: a "
                       "registered router, or a plugin as package.module:Class or "
                       "path/to/file.py:Class.", registry="router")
    router_opts: str = knob("", "Router knobs: key=value,... (with num_replicas > 1).")
    num_prefill_replicas: int = knob(0, "Disaggregated prefill and decode: replicas of the "
                                     "prefill pool (with the decode pool's; 0: colocated).")
    num_decode_replicas: int = knob(0, "Disaggregated: replicas of the decode pool.")
    prefill_policy: Optional[str] = knob(None, "Disaggregated: the prefill pool's policy "
                                         "(None: the run's).")
    decode_policy: Optional[str] = knob(None, "Disaggregated: the decode pool's policy (None: "
                                        "the run's).")
    prefill_policy_opts: Optional[str] = knob(None, "Disaggregated: the prefill policy's knobs "
                                              "(None: the run's, when it is the run's "
                                              "policy).")
    decode_policy_opts: Optional[str] = knob(None, "Disaggregated: the decode policy's knobs.")
    prefill_router: str = knob("least_outstanding", "Disaggregated: which prefill replica "
                               "takes each arrival (a router, as router).", registry="router")
    decode_router: str = knob("least_outstanding", "Disaggregated: which decode replica takes "
                              "each prefilled request (a router, as router).",
                              registry="router")
    prefill_router_opts: str = knob("", "Disaggregated: the prefill router's knobs: "
                                    "key=value,...")
    decode_router_opts: str = knob("", "Disaggregated: the decode router's knobs: "
                                   "key=value,...")
    rebalancer: Optional[str] = knob(None, "Live migration (num_replicas > 1): the "
                                     "rebalancer asked every rebalance_interval_s which "
                                     "requests to move (a registered rebalancer, or a plugin "
                                     "as router; None: requests stay where routed).",
                                     registry="rebalancer")
    rebalancer_opts: str = knob("", "Rebalancer knobs: key=value,... (with rebalancer).")
    rebalance_interval_s: float = knob(0.5, "Virtual seconds between the rebalancer's calls.")
    migration: str = knob("live", "How a migration moves KV over kv_link: live (copy while the "
                          "source decodes, then stop for the last pages) or stop_and_copy.",
                          choices=MIGRATION_MODES)
    kv_link: str = knob("ib200", "Disaggregated, and migrations: the KV link preset.",
                        presets=KV_LINK_NAMES)
    kv_link_max_concurrent: int = knob(1, "Disaggregated: KV transfers in flight on one "
                                       "(prefill, decode) link at once; the rest queue.")
    planner: Optional[str] = knob(None, "Elastic replicas (colocated, sim): the planner asked "
                                  "every planner_interval_s how many replicas to run, "
                                  "num_replicas at the start (a registered planner, or a "
                                  "plugin as router; None: num_replicas throughout). "
                                  "docs/clusters.md.", registry="planner")
    planner_opts: str = knob("", "Planner knobs: key=value,... (with planner).")
    planner_interval_s: Optional[float] = knob(None, "Virtual seconds between the planner's "
                                               "calls (None: 30).")
    min_replicas: Optional[int] = knob(None, "With planner: the fewest replicas it may ask "
                                       "for (None: 1).")
    max_replicas: Optional[int] = knob(None, "With planner: the most replicas it may ask for "
                                       "(None: num_replicas).")
    replica_startup_s: Optional[float] = knob(None, "With planner: seconds from a replica's "
                                              "start to its first request (None: the "
                                              "model's weights over replica_load_link).")
    replica_load_link: Optional[str] = knob(None, "With planner: the link a starting "
                                            "replica loads its weights over, one GPU's shard "
                                            "each (None: nvme).", presets=KV_LINK_NAMES)

    def __post_init__(self) -> None:
        check_at_least("cluster", "num_replicas", self.num_replicas, 1)
        parse_options(self.router_opts)  # fails early, naming the bad option
        check_at_least("cluster", "num_prefill_replicas", self.num_prefill_replicas, 0)
        check_at_least("cluster", "num_decode_replicas", self.num_decode_replicas, 0)
        check_at_least("cluster", "kv_link_max_concurrent", self.kv_link_max_concurrent, 1)
        if (self.num_prefill_replicas == 0) != (self.num_decode_replicas == 0):
            raise ValueError(f"cluster: a disaggregated cluster needs both pools; got "
                             f"num_prefill_replicas={self.num_prefill_replicas}, "
                             f"num_decode_replicas={self.num_decode_replicas}")
        if self.disaggregated and self.num_replicas > 1:
            raise ValueError(f"cluster: num_replicas={self.num_replicas} (colocated) and "
                             f"prefill/decode pools ({self.num_prefill_replicas}+"
                             f"{self.num_decode_replicas}) both set; choose one")
        get_kv_link(self.kv_link)  # fails early, naming the presets
        parse_options(self.rebalancer_opts)
        check_choice("cluster", "migration", self.migration, MIGRATION_MODES)
        if self.rebalancer is not None:
            if self.disaggregated or self.num_replicas < 2:
                raise ValueError(f"cluster: rebalancer {self.rebalancer!r}: migration needs "
                                 "num_replicas >= 2 (colocated), got "
                                 + ("prefill/decode pools" if self.disaggregated
                                    else f"num_replicas={self.num_replicas}"))
            if not (math.isfinite(self.rebalance_interval_s) and self.rebalance_interval_s > 0):
                raise ValueError(f"cluster: rebalance_interval_s must be > 0 seconds, got "
                                 f"{self.rebalance_interval_s!r}")
        self._check_planner()
        for field in ("prefill_policy_opts", "decode_policy_opts", "prefill_router_opts",
                      "decode_router_opts"):
            if getattr(self, field) is not None:
                parse_options(getattr(self, field))

    @property
    def disaggregated(self) -> bool:
        """Whether the cluster has a prefill and a decode pool."""
        return self.num_prefill_replicas > 0

    @property
    def colocated_cluster(self) -> bool:
        """Whether the run is a colocated cluster (more than one replica, or a planner's)."""
        return self.num_replicas > 1 or self.planner is not None

    @property
    def replica_caps(self) -> tuple[int, int]:
        """A planner's `(min_replicas, max_replicas)`, defaults resolved."""
        return (1 if self.min_replicas is None else self.min_replicas,
                self.num_replicas if self.max_replicas is None else self.max_replicas)

    def _check_planner(self) -> None:
        """The planner's settings: each only with a planner, the caps around num_replicas."""
        settings = {"planner_opts": self.planner_opts or None,
                    **{field: getattr(self, field) for field in PLANNER_FIELDS}}
        given = [f"{field}={value}" for field, value in settings.items() if value is not None]
        if self.planner is None:
            if given:
                raise ValueError(f"cluster: {', '.join(given)} set without a planner; give "
                                 "planner=NAME (threshold, sla, or a plugin) or drop them")
            return
        parse_options(self.planner_opts)
        if self.disaggregated or self.rebalancer is not None:
            raise ValueError(f"cluster: planner {self.planner!r} scales colocated replicas "
                             "without a rebalancer; got "
                             + ("prefill/decode pools" if self.disaggregated
                                else f"rebalancer {self.rebalancer!r}"))
        check_positive("cluster", "planner_interval_s", self.planner_interval_s)
        if self.replica_startup_s is not None and not (
                math.isfinite(self.replica_startup_s) and self.replica_startup_s >= 0):
            raise ValueError(f"cluster.replica_startup_s must be a finite number >= 0, got "
                             f"{self.replica_startup_s}")
        if self.replica_load_link is not None:
            get_kv_link(self.replica_load_link)
        low, high = self.replica_caps
        check_at_least("cluster", "min_replicas", low, 1)
        if high < 2:
            raise ValueError(f"cluster: planner {self.planner!r} has nothing to scale with "
                             f"max_replicas={high}; give max_replicas >= 2")
        if not low <= self.num_replicas <= high:
            raise ValueError(f"cluster: planner {self.planner!r}: num_replicas="
                             f"{self.num_replicas} (the replicas at the start) must lie within "
                             f"min_replicas={low} and max_replicas={high}")

