"""The planner API: how many replicas an elastic cluster should run.

A planner is the cluster's autoscaler (NVIDIA Dynamo's planner, a Kubernetes
autoscaler's rule): every `--planner_interval_s` of virtual time the cluster
shows it what it measured (`PlannerMetrics`: queues, KV usage, the arrival rate
of recent intervals, the SLO attainment of the requests finished in the last
one, and the simulator's own profile of one replica, `ReplicaProfile`) and it
returns the number of replicas to run, within `[min_replicas, max_replicas]`.
`orca_jax.cluster.elastic` starts replicas (ready after the start-up delay) or
drains them to meet it. It is a plugin like a router: a small class with its
knobs as dataclass fields, loaded by registered name, `package.module:Class` or
`file.py:Class` (`--planner`, options in `--planner_opts`). The built-ins live
in `policies/planners.py`; planners never import jax.

    @register_planner("one_per_ten")
    class OnePerTen(Planner):
        def plan(self, metrics: PlannerMetrics) -> int:
            load = int(metrics.outstanding.sum())
            return min(metrics.max_replicas, max(metrics.min_replicas, -(-load // 10)))
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Mapping, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.api import plugins

_PLANNERS: dict[str, type["Planner"]] = {}


@dataclasses.dataclass(frozen=True)
class ReplicaProfile:
    """One replica's step times as the cluster's own engine prices them (profiled once,
    before the run, at the workload's mean prompt and output lengths: Dynamo's
    pre-deployment profiling, with the simulator's cost model as the GPU).

    Attributes:
      batch: `[K]` decode batch sizes profiled, ascending.
      decode_step_s: `[K]` seconds of one decode step of each batch, every sequence
        attending to `prompt_tokens + output_tokens / 2` tokens.
      prefill_s_per_token: seconds per prompt token of a prefill step of one
        prompt (up to the step's token budget).
      prompt_tokens, output_tokens: the mean lengths profiled at.
      max_batch: the most sequences of that context the replica's KV pool and
        batch cap hold at once.
    """

    batch: NDArray[np.int64]  # [K]
    decode_step_s: NDArray[np.float64]  # [K]
    prefill_s_per_token: float
    prompt_tokens: float
    output_tokens: float
    max_batch: int

    def batch_within(self, tpot_s: float) -> float:
        """The largest decode batch whose step takes at most `tpot_s` (interpolated
        between profiled batches; at least 1, at most `max_batch`)."""
        step = np.maximum.accumulate(self.decode_step_s)  # steps grow with the batch
        batch = float(np.interp(tpot_s, step, self.batch.astype(np.float64)))
        if tpot_s < step[0]:
            batch = 1.0  # even one sequence misses the SLO: serve one at a time
        return min(batch, float(self.max_batch))

    def requests_per_s(self, tpot_s: float) -> float:
        """Requests a second one replica serves with decode steps within `tpot_s`: its
        decode batch at that TPOT gives `D = batch / step` tokens a second, and the time
        prefills take comes out of it: `D / (output + prompt * prefill_s_per_token * D)`."""
        batch = self.batch_within(tpot_s)
        step = float(np.interp(batch, self.batch.astype(np.float64), self.decode_step_s))
        tokens_per_s = batch / step
        return tokens_per_s / (self.output_tokens
                               + self.prompt_tokens * self.prefill_s_per_token * tokens_per_s)


@dataclasses.dataclass(frozen=True)
class PlannerMetrics:
    """What a planner sees at one of its calls.

    Attributes:
      now_s: the call's virtual time.
      interval_s: seconds between calls (`--planner_interval_s`).
      num_replicas: replicas the planner asked for and has: ready or starting (not
        draining).
      num_ready, num_starting, num_draining: replicas in each state.
      min_replicas, max_replicas: the caps; `plan` must return a count within them.
      startup_s: seconds from a replica's start to its first request.
      outstanding: `[R]` requests routed to each ready replica and not done.
      waiting: `[R]` requests queued (not running) on each ready replica.
      kv_usage: `[R]` fraction of each ready replica's KV pool in use.
      arrival_rates: `[k]` arrivals per second in each past interval, oldest first
        (the last is the interval just ended; empty at the first call's start).
      slo_attainment: the share of requests finished in the last interval that met
        the SLOs (None without an SLO or with none finished).
      ttft_slo_s, tpot_slo_s: the run's SLOs (None when unset).
      profile: one replica's profiled step times (`ReplicaProfile`).
    """

    now_s: float
    interval_s: float
    num_replicas: int
    num_ready: int
    num_starting: int
    num_draining: int
    min_replicas: int
    max_replicas: int
    startup_s: float
    outstanding: NDArray[np.int64]  # [R]
    waiting: NDArray[np.int64]  # [R]
    kv_usage: NDArray[np.float64]  # [R]
    arrival_rates: NDArray[np.float64]  # [k]
    slo_attainment: Optional[float]
    ttft_slo_s: Optional[float]
    tpot_slo_s: Optional[float]
    profile: ReplicaProfile

    def clamp(self, count: int) -> int:
        """`count` within `[min_replicas, max_replicas]`."""
        return int(min(self.max_replicas, max(self.min_replicas, count)))


class Planner(abc.ABC):
    """Base class of every planner (see the module docstring)."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def plan(self, metrics: PlannerMetrics) -> int:
        """The number of replicas to run from now (ready or starting), in
        `[metrics.min_replicas, metrics.max_replicas]`; anything else stops the run."""


register_planner = plugins.registrar(_PLANNERS, Planner, kind="planner",
                                     decorator="register_planner")


def registered_planners() -> dict[str, type[Planner]]:
    """The registered planners by name (a copy; import `policies` for the built-ins)."""
    return dict(_PLANNERS)


def resolve_planner_class(spec: str) -> type[Planner]:
    """Finds the planner class for a registered name, `module:Class` or `file.py:Class`."""
    return plugins.resolve_class(spec, kind="planner", plural="planners", registry=_PLANNERS,
                                 base=Planner)


def make_planner(spec: str, options: Optional[Mapping[str, str]] = None) -> Planner:
    """Builds a planner from its spec and string options (`--planner_opts`).

    Raises:
      PolicyLoadError: the spec does not resolve, or an option is unknown or mistyped.
    """
    return plugins.build(resolve_planner_class(spec), options, "planner")
