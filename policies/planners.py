"""Built-in planners: how many replicas an elastic cluster runs.

* `threshold`: a fixed-threshold autoscaler (a Kubernetes HPA on queue length):
  while no replica is starting, `step` more replicas when the outstanding requests
  per ready replica exceed `scale_up_load` (or the mean KV usage exceeds
  `scale_up_kv`), `step` fewer when they are under `scale_down_load`.
* `sla`: NVIDIA Dynamo's SLA planner. A load predictor forecasts the arrival
  rate one start-up delay and one interval ahead (`last`, a `moving_average`
  of the last `window` intervals, or their least-squares `linear_trend`); the
  replica count is that rate times `headroom` over what one replica serves at
  the TPOT target, interpolated over the simulator's own profile of one replica
  (`ReplicaProfile.requests_per_s`). When the SLO attainment of the last
  interval fell under `min_attainment`, one replica more (Dynamo's correction
  of its profile by what it observes).

docs/clusters.md ("Planners") describes the mechanism.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import numpy as np

from orca_jax.cluster.planning import Planner, PlannerMetrics, register_planner


@register_planner("threshold")
@dataclasses.dataclass
class Threshold(Planner):
    """Adds or removes replicas when the load per ready replica crosses fixed thresholds.

    Attributes:
      scale_up_load: outstanding requests per ready replica over which replicas are added.
      scale_down_load: outstanding requests per ready replica under which replicas are
        removed.
      scale_up_kv: mean KV usage (a fraction of the pool) over which replicas are added.
      step: replicas added or removed at one call.
    """

    scale_up_load: float = 8.0
    scale_down_load: float = 2.0
    scale_up_kv: float = 0.9
    step: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.scale_down_load < self.scale_up_load:
            raise ValueError(f"need 0 <= scale_down_load < scale_up_load, got "
                             f"{self.scale_down_load}, {self.scale_up_load}")
        if self.step < 1:
            raise ValueError(f"step must be >= 1, got {self.step}")

    def plan(self, metrics: PlannerMetrics) -> int:
        if metrics.num_starting:  # wait for the replicas already coming
            return metrics.clamp(metrics.num_replicas)
        load = float(metrics.outstanding.sum()) / max(metrics.num_ready, 1)
        kv = float(metrics.kv_usage.mean()) if metrics.kv_usage.size else 0.0
        if load > self.scale_up_load or kv > self.scale_up_kv:
            return metrics.clamp(metrics.num_replicas + self.step)
        if load < self.scale_down_load:
            return metrics.clamp(metrics.num_replicas - self.step)
        return metrics.clamp(metrics.num_replicas)


@register_planner("sla")
@dataclasses.dataclass
class SlaPlanner(Planner):
    """Dynamo's SLA planner: a load forecast over the profiled throughput of one replica.

    Attributes:
      predictor: `last` (the last interval's rate), `moving_average` (of the last
        `window`) or `linear_trend` (least squares over the last `window`,
        extrapolated one start-up delay and one interval ahead).
      window: past intervals the predictor reads.
      tpot_s: the decode step time (TPOT) target a replica's batch is sized to (None:
        the run's tpot_slo_s, or 0.05 s without one).
      headroom: the forecast is multiplied by this before dividing (> 0).
      min_attainment: under this SLO attainment in the last interval, one replica
        more than the forecast asks for.
    """

    predictor: Literal["last", "moving_average", "linear_trend"] = "linear_trend"
    window: int = 6
    tpot_s: Optional[float] = None
    headroom: float = 1.2
    min_attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not (math.isfinite(self.headroom) and self.headroom > 0):
            raise ValueError(f"headroom must be a number > 0, got {self.headroom}")
        if self.tpot_s is not None and not (math.isfinite(self.tpot_s) and self.tpot_s > 0):
            raise ValueError(f"tpot_s must be a number of seconds > 0, got {self.tpot_s}")

    def forecast(self, metrics: PlannerMetrics) -> float:
        """Arrivals a second expected once a replica started now is ready."""
        rates = metrics.arrival_rates[-self.window:]
        if not rates.size:
            return 0.0
        if self.predictor == "last" or rates.size == 1:
            return float(rates[-1])
        if self.predictor == "moving_average":
            return float(rates.mean())
        x = np.arange(rates.size, dtype=np.float64)
        slope, intercept = np.polyfit(x, rates, 1)
        ahead = (metrics.startup_s + metrics.interval_s) / metrics.interval_s
        return max(0.0, float(intercept + slope * (x[-1] + ahead)))

    def plan(self, metrics: PlannerMetrics) -> int:
        tpot = self.tpot_s or metrics.tpot_slo_s or 0.05
        per_replica = metrics.profile.requests_per_s(tpot)
        count = math.ceil(self.forecast(metrics) * self.headroom / per_replica)
        attainment = metrics.slo_attainment
        if attainment is not None and attainment < self.min_attainment:
            count = max(count, metrics.num_replicas) + 1
        return metrics.clamp(count)
