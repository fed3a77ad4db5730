"""Elastic replicas: a planner adds and removes a colocated cluster's replicas.

The cluster holds `max_replicas` schedulers from the start; each is in one state:

* off: no GPU held; the router never sees it.
* starting: started by the planner at `t`, it is ready at `t + startup_s` (the
  weights' load; a `ReplicaReady` event). It holds a GPU, takes no request.
* ready: the router sees it (the router's `ClusterView` holds the ready replicas
  only, renumbered `0..k-1` in index order; `ClusterView.replica_ids` names each
  by its pool index, which a router that remembers replicas keeps).
* draining: removed by the planner: the router no longer sees it and it runs its
  requests to the end; with none left it is off (at its own clock then).

Every `interval_s` of virtual time (`PlanTick`, the first at `interval_s`) the
planner is shown `PlannerMetrics` and returns a replica count, checked against
the caps (a count outside them stops the run in one line naming the planner and
the rule, before anything changes). More replicas than ready and starting: first
draining ones go back to ready (they still hold their GPU), then off ones start.
Fewer: starting ones are cancelled first (the newest first), then the ready ones
with the fewest outstanding requests drain. A replica holds its GPU (and counts in
replica-seconds) from its start to the moment it is off or the run ends.

What is not modelled: the start-up beyond the weights' load (engine and graph
warm-up, a container's pull), a GPU's allocation time, and a draining replica's
requests moving away (they finish where they are; a rebalancer cannot be combined
with a planner yet).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.event_loop import Event, EventLoop, ReplicaPool
from orca_jax.cluster.planning import Planner, PlannerMetrics, ReplicaProfile
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import RequestState
from orca_jax.core.step.engine_api import PackedStep, StepInputs

OFF, STARTING, READY, DRAINING = 0, 1, 2, 3
STATE_NAMES = ("off", "starting", "ready", "draining")
_FINISHED = int(RequestState.FINISHED)

# At one instant: after arrivals, a replica's readiness, then the planner, then steps.
READY_PRIORITY = 7
PLAN_PRIORITY = 8
RATE_HISTORY = 64  # past intervals' arrival rates a planner sees


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingSpec:
    """How an elastic cluster scales.

    Attributes:
      interval_s: virtual seconds between the planner's calls (> 0).
      startup_s: seconds from a replica's start to its first request (>= 0).
      min_replicas, max_replicas: the caps on ready plus starting replicas
        (1 <= min <= max).
    """

    interval_s: float = 30.0
    startup_s: float = 0.0
    min_replicas: int = 1
    max_replicas: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"planner_interval_s must be a positive number of seconds, got "
                             f"{self.interval_s!r}")
        if not (math.isfinite(self.startup_s) and self.startup_s >= 0):
            raise ValueError(f"replica_startup_s must be a finite number of seconds >= 0, got "
                             f"{self.startup_s!r}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"planner caps: need 1 <= min_replicas <= max_replicas, got "
                             f"min_replicas={self.min_replicas}, "
                             f"max_replicas={self.max_replicas}")


class ReplicaEvent(NamedTuple):
    """One change of a replica's state (or a planner's call, `replica` -1)."""

    time_s: float
    replica: int
    event: str  # start, ready, drain, undrain, cancel, off; plan (a call: `target`)
    target: int  # the planner's count at the call that caused it


class ActiveReplicas:
    """The ready replicas of a pool, as the router's `ClusterView` reads them
    (`routing.ClusterState`): renumbered `0..k-1`; `index[i]` is the pool's replica."""

    def __init__(self, pool: ReplicaPool, index: NDArray[np.int64]) -> None:  # [k]
        from orca_jax.cluster.routing import ClusterView
        self.pool = pool
        self.index = index
        self.view = ClusterView(self)

    @property
    def replica_views(self) -> tuple[SchedulerView, ...]:
        return tuple(self.pool.replicas[i].view for i in self.index)

    @property
    def replica_ids(self) -> list[int]:
        return self.index.tolist()

    @property
    def now_s(self) -> float:
        return self.pool.now_s

    def outstanding(self) -> NDArray[np.int64]:  # [k]
        return self.pool.outstanding()[self.index]

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        return self.pool.outstanding_ids(int(self.index[replica]))

    def migrating_ids(self) -> NDArray[np.int64]:  # [m]
        return self.pool.migrating_ids()

    def pages_to_receive(self, request: int, replica: int) -> int:
        return self.pool.pages_to_receive(request, int(self.index[replica]))


def profile_replica(scheduler: Scheduler) -> ReplicaProfile:
    """Prices decode steps of growing batches and one prefill on `scheduler`'s engine
    (before its warm-up, so any step shape is priced) at the workload's mean lengths."""
    table, view, buckets = scheduler.table, scheduler.view, scheduler.bucket_config
    prompt = float(table.prompt_len.mean()) if len(table) else 1.0
    output = float(table.output_len.mean()) if len(table) else 1.0
    context = max(1, int(round(prompt + output / 2)))
    cap = min(buckets.max_num_seqs, buckets.max_num_tokens)
    batch = np.unique(np.minimum(2 ** np.arange(int(math.log2(cap)) + 2), cap))  # [K]

    def seconds(q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64]) -> float:
        packed = PackedStep(buckets.select(int(q_lens.sum())), q_lens, kv_lens,
                            _no_descriptor)
        return float(scheduler.engine.step_packed(packed).step_s)

    decode = np.array([seconds(np.ones(b, np.int64), np.full(b, context, np.int64))
                       for b in batch])
    chunk = max(1, min(int(round(prompt)), buckets.max_num_tokens))
    prefill = seconds(np.array([chunk]), np.array([chunk])) / chunk
    held = view.num_kv_pages * view.page_size // max(1, int(round(prompt + output)))
    return ReplicaProfile(batch=batch.astype(np.int64), decode_step_s=decode,
                          prefill_s_per_token=prefill, prompt_tokens=prompt,
                          output_tokens=output, max_batch=max(1, min(cap, held)))


class ProfileDescriptorError(RuntimeError):
    """An engine asked `profile_replica` for a built step descriptor: a bug in that engine,
    since the profile prices steps by their lengths alone (the simulator's engine)."""


def _no_descriptor() -> StepInputs:
    raise ProfileDescriptorError("bug: the engine asked the planner's profile for a built step "
                                 "descriptor; the profile prices steps by their lengths alone "
                                 "(the simulator's engine)")


class Elastic:
    """Runs a planner on a colocated cluster's one pool (see the module docstring).

    Args:
      loop: the cluster's event loop.
      pool: its replicas (`spec.max_replicas` of them).
      planner: the plugin asked every `spec.interval_s`.
      spec: the caps, interval and start-up delay.
      initial: replicas ready at time 0 (the first `initial` of the pool).
    """

    def __init__(self, loop: EventLoop, pool: ReplicaPool, planner: Planner, spec: ScalingSpec,
                 initial: int) -> None:
        if len(pool.replicas) != spec.max_replicas:
            raise ValueError(f"planner: the pool has {len(pool.replicas)} replicas, the cap "
                             f"max_replicas is {spec.max_replicas}")
        if not spec.min_replicas <= initial <= spec.max_replicas:
            raise ValueError(f"planner {planner.name!r}: num_replicas={initial} (the replicas "
                             f"at the start) must lie within min_replicas={spec.min_replicas} "
                             f"and max_replicas={spec.max_replicas}")
        if not planner.name:  # an instance of an unregistered class: name it by its class
            planner.name = type(planner).__name__.lower()
        self.loop, self.pool, self.planner, self.spec = loop, pool, planner, spec
        first = pool.replicas[0]
        self.profile = profile_replica(first)
        self.state = np.full(len(pool.replicas), OFF, dtype=np.int8)  # [M]
        self.state[:initial] = READY
        self._generation = [0] * len(pool.replicas)  # a cancelled start's event goes stale
        self._num_ready_events = 0  # ReplicaReady events pushed and not fired
        self.events: list[ReplicaEvent] = [ReplicaEvent(0.0, r, "ready", initial)
                                           for r in range(initial)]
        self._arrival_times = np.sort(loop.arrival_s[loop.arrivals])  # [A]
        self._rates: list[float] = []
        self._ttft_slo_s = first.view.ttft_slo_s
        self._tpot_slo_s = first.view.tpot_slo_s
        self._route_ready()

    def start(self) -> None:
        """Schedules the planner's first call."""
        self.loop.push(PlanTick(), self.spec.interval_s)

    # --------------------------------------------------------------- events
    def tick(self, when: float) -> None:
        """Asks the planner, applies its count, and schedules the next call while anything
        else is still to happen."""
        metrics = self.metrics(when)
        target = self._checked(self.planner.plan(metrics), metrics)
        self.events.append(ReplicaEvent(when, -1, "plan", target))
        self._apply(target, when)
        if self.loop.has_events():
            self.loop.push(PlanTick(), when + self.spec.interval_s)

    def ready(self, replica: int, generation: int, when: float) -> None:
        """A started replica finished loading: the router sees it from now."""
        self._num_ready_events -= 1
        if generation != self._generation[replica] or self.state[replica] != STARTING:
            return  # cancelled meanwhile
        self.state[replica] = READY
        scheduler = self.pool.replicas[replica]
        scheduler.now_s = max(scheduler.now_s, when)
        self.events.append(ReplicaEvent(when, replica, "ready", self._last_target()))
        self._route_ready()
        self.loop.wake(0, replica)

    def stepped(self, replica: int) -> None:
        """After a replica's iteration: a draining one with nothing left is off."""
        if self.state[replica] == DRAINING and self._left(replica) == 0:
            self._off(replica, self.pool.replicas[replica].now_s, "off")

    # --------------------------------------------------------------- metrics
    def metrics(self, when: float) -> PlannerMetrics:
        """What the planner sees at `when`."""
        ready = np.flatnonzero(self.state == READY)
        views = [self.pool.replicas[i].view for i in ready]
        interval = self.spec.interval_s
        lo, hi = np.searchsorted(self._arrival_times, [when - interval, when], side="right")
        self._rates.append(float(hi - lo) / interval)
        del self._rates[:-RATE_HISTORY]
        return PlannerMetrics(
            now_s=when, interval_s=interval, num_replicas=self._num_planned(),
            num_ready=int(ready.size), num_starting=int(np.sum(self.state == STARTING)),
            num_draining=int(np.sum(self.state == DRAINING)),
            min_replicas=self.spec.min_replicas, max_replicas=self.spec.max_replicas,
            startup_s=self.spec.startup_s,
            outstanding=self.pool.outstanding()[ready],
            waiting=np.array([v.waiting.size for v in views], dtype=np.int64),
            kv_usage=np.array([v.num_used_pages / v.num_kv_pages for v in views]),
            arrival_rates=np.array(self._rates), slo_attainment=self._attainment(when),
            ttft_slo_s=self._ttft_slo_s, tpot_slo_s=self._tpot_slo_s, profile=self.profile)

    def _attainment(self, when: float) -> Optional[float]:
        """The share of requests finished in the last interval that met the SLOs."""
        if self._ttft_slo_s is None and self._tpot_slo_s is None:
            return None
        table = self.pool.replicas[0].table
        finish = table.finish_s
        done = (finish > when - self.spec.interval_s) & (finish <= when)  # NaN: not done
        if not done.any():
            return None
        meets = np.ones(int(done.sum()), dtype=bool)
        first = table.first_token_s[done]
        if self._ttft_slo_s is not None:
            meets &= first - table.arrival_s[done] <= self._ttft_slo_s
        if self._tpot_slo_s is not None:
            tokens = table.num_generated[done]
            tpot = (table.last_token_s[done] - first) / np.maximum(tokens - 1, 1)
            meets &= (tokens <= 1) | (tpot <= self._tpot_slo_s)
        return float(meets.mean())

    # ---------------------------------------------------------------- scaling
    def _checked(self, target: Any, metrics: PlannerMetrics) -> int:
        """The planner's count, checked.

        Raises:
          PlanError: kind `planner`: `not_a_count`, `zero_replicas`, `over_max`,
            `under_min`.
        """
        name = self.planner.name
        if not isinstance(target, (int, np.integer)) or isinstance(target, bool):
            raise PlanError(name, "not_a_count", f"plan() returned {target!r} at "
                            f"{metrics.now_s:g} s; give a number of replicas (an int)",
                            kind="planner")
        target = int(target)
        if target < 1:
            raise PlanError(name, "zero_replicas", f"plan() asked for {target} replicas at "
                            f"{metrics.now_s:g} s; a cluster keeps at least one",
                            kind="planner")
        if target > self.spec.max_replicas:
            raise PlanError(name, "over_max", f"plan() asked for {target} replicas at "
                            f"{metrics.now_s:g} s, over max_replicas={self.spec.max_replicas}",
                            kind="planner")
        if target < self.spec.min_replicas:
            raise PlanError(name, "under_min", f"plan() asked for {target} replicas at "
                            f"{metrics.now_s:g} s, under min_replicas={self.spec.min_replicas}",
                            kind="planner")
        return target

    def _apply(self, target: int, when: float) -> None:
        """Starts, un-drains, cancels or drains replicas until `target` are ready or
        starting."""
        change = target - self._num_planned()
        for replica in np.flatnonzero(self.state == DRAINING)[:max(change, 0)]:
            self.state[replica] = READY  # it still holds its GPU: the cheapest to add
            self.events.append(ReplicaEvent(when, int(replica), "undrain", target))
            change -= 1
        for replica in np.flatnonzero(self.state == OFF)[:max(change, 0)]:
            self.state[replica] = STARTING
            self._generation[replica] += 1
            self.events.append(ReplicaEvent(when, int(replica), "start", target))
            self.loop.push(ReplicaReady(int(replica), self._generation[replica]),
                           when + self.spec.startup_s)
            self._num_ready_events += 1
            change -= 1
        for replica in np.flatnonzero(self.state == STARTING)[::-1][:max(-change, 0)]:
            self._off(int(replica), when, "cancel")
            change += 1
        if change < 0:
            ready = np.flatnonzero(self.state == READY)
            left = np.array([self._left(int(r)) for r in ready])
            # The fewest outstanding first (ties: the highest index), so drains are short.
            for replica in ready[np.lexsort((-ready, left))][:-change]:
                self.state[replica] = DRAINING
                self.events.append(ReplicaEvent(when, int(replica), "drain", target))
                if self._left(int(replica)) == 0:
                    self._off(int(replica), max(when, self.pool.replicas[replica].now_s),
                              "off")
        self._route_ready()

    def _off(self, replica: int, when: float, event: str) -> None:
        self.state[replica] = OFF
        self.events.append(ReplicaEvent(when, replica, event, self._last_target()))

    def _left(self, replica: int) -> int:
        """Requests routed to `replica` and not done there."""
        return int(self.pool.outstanding()[replica])

    def _num_planned(self) -> int:
        return int(np.sum((self.state == READY) | (self.state == STARTING)))

    def _last_target(self) -> int:
        return next((e.target for e in reversed(self.events) if e.event == "plan"),
                    self.events[0].target if self.events else 0)

    def _route_ready(self) -> None:
        self.pool.routable = ActiveReplicas(self.pool, np.flatnonzero(self.state == READY))

    # ---------------------------------------------------------------- results
    def timeline(self) -> list[dict[str, Any]]:
        """replicas.jsonl: each change in time order, with the counts in each state after
        it (`replicas`: those holding a GPU: starting, ready or draining)."""
        counts = [len(self.pool.replicas), 0, 0, 0]  # by state
        state = [OFF] * len(self.pool.replicas)
        rows = []
        order = sorted(range(len(self.events)), key=lambda k: (self.events[k].time_s, k))
        for k in order:
            event = self.events[k]
            if event.replica >= 0:
                new = {"start": STARTING, "ready": READY, "drain": DRAINING, "undrain": READY,
                       "cancel": OFF, "off": OFF}[event.event]
                counts[state[event.replica]] -= 1
                counts[new] += 1
                state[event.replica] = new
            rows.append({"time_s": event.time_s, "replica": event.replica,
                         "event": event.event, "target": event.target,
                         "replicas": counts[STARTING] + counts[READY] + counts[DRAINING],
                         "ready": counts[READY], "starting": counts[STARTING],
                         "draining": counts[DRAINING]})
        return rows

    def replica_seconds(self, end_s: float) -> float:
        """GPU-holding replicas integrated over time, from 0 to `end_s` (the timeline's
        step function)."""
        return replica_seconds(self.timeline(), end_s)


def replica_seconds(timeline: list[dict[str, Any]], end_s: float) -> float:
    """The integral of a timeline's `replicas` (a step function) from 0 to `end_s`."""
    total, count, at = 0.0, 0, 0.0
    for row in timeline:
        t = min(row["time_s"], end_s)
        total += count * (t - at)
        count, at = row["replicas"], t
    return total + count * max(0.0, end_s - at)


def planner_figures(elastic: Elastic, end_s: float, num_slo_met: Optional[int]
                    ) -> dict[str, Any]:
    """summary.json's planner figures: replica-seconds, the counts' range, the calls, and
    goodput per replica-second (with an SLO)."""
    timeline = elastic.timeline()
    seconds = replica_seconds(timeline, end_s)
    # The count at each instant once its changes are made (not midway through them).
    counts = [row["replicas"] for row, after in zip(timeline, timeline[1:] + [None])
              if after is None or after["time_s"] != row["time_s"]]
    return {"planner": elastic.planner.name, "replica_seconds": seconds,
            "replica_hours": seconds / 3600.0,
            "replicas_mean": seconds / end_s if end_s > 0 else None,
            "replicas_min": min(counts), "replicas_max": max(counts),
            "num_planner_calls": sum(row["event"] == "plan" for row in timeline),
            "num_replica_starts": sum(row["event"] == "start" for row in timeline),
            "replica_startup_s": elastic.spec.startup_s,
            "goodput_per_replica_s": (None if num_slo_met is None or seconds <= 0
                                      else num_slo_met / seconds)}


@dataclasses.dataclass(frozen=True)
class PlanTick(Event):
    """The planner is asked how many replicas to run."""

    priority: ClassVar[int] = PLAN_PRIORITY

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.elastic.tick(when)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class ReplicaReady(Event):
    """A started replica finished loading its weights."""

    priority: ClassVar[int] = READY_PRIORITY
    replica: int
    generation: int

    def tiebreak(self) -> tuple[int, ...]:
        return (self.replica,)

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.elastic.ready(self.replica, self.generation, when)  # type: ignore[attr-defined]
