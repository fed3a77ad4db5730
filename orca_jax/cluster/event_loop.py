"""One discrete-event loop for every topology of replicas, on one virtual clock.

A topology (colocated replicas `replicas.Cluster`, the prefill and decode pools
of `disaggregated.DisaggregatedCluster`) is an `EventLoop` over pools of
replicas: each replica a whole `Scheduler` (its own policy, engine, KV pool
and clock) holding only the requests given to it (`Scheduler.submit`,
`Scheduler.import_request`). Pool 0 receives the workload's arrivals, each
routed by the pool's router when it arrives.

Events run in time order; at one instant, by kind (`Event.priority`): an
arrival first (so a router sees every replica at the moment it routes), then
the topology's own kinds (a transfer's end, a handoff, ...), a replica's next
step last, replicas in (pool, index) order. An event kind is one small class
with its `fire`: later kinds (migration, scale) add a class, not a branch.

A replica steps when its clock is the earliest time it could do something: at
once while it has waiting, running or unreleased requests; else at its next
submitted arrival. A step that changes nothing blocks the replica until an
event gives it something: an arrival routed to it, a transfer's end. A
replica of pool 0 with nothing to do waits for the next arrival at its pool,
and its clock moves to that arrival's time (as one scheduler's clock jumps to
its next arrival when idle).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import heapq
import itertools
from typing import Callable, ClassVar, Optional, Protocol, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.routing import ClusterView, Router
from orca_jax.core.api.policy import Policy
from orca_jax.core.loop.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.step.engine_api import Engine

_FINISHED, _AWAY = int(RequestState.FINISHED), int(RequestState.ROUTED_AWAY)

# The order of event kinds at one instant (lower first). A topology's kinds lie between.
ARRIVAL_PRIORITY = 0
STEP_PRIORITY = 100


class Event(abc.ABC):
    """One kind of event: when it fires (its instant, given when pushed), it acts on the loop."""

    priority: ClassVar[int]  # kinds at one instant fire in this order (lower first)

    def tiebreak(self) -> tuple[int, ...]:
        """Orders events of this kind at one instant (default: the order they were pushed)."""
        return ()

    @abc.abstractmethod
    def fire(self, loop: EventLoop, when: float) -> None:
        """Does what the event does at `when`."""


@dataclasses.dataclass(frozen=True)
class Arrival(Event):
    """The next request of the workload arrives and is routed into pool 0."""

    priority: ClassVar[int] = ARRIVAL_PRIORITY
    position: int  # index into the loop's arrivals

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.arrive(self.position, when)


@dataclasses.dataclass(frozen=True)
class CallRelease(Event):
    """A program call is released (its parents are done and its tool pause is over): it
    arrives, and is routed into pool 0 as an arrival is (docs/programs.md)."""

    priority: ClassVar[int] = ARRIVAL_PRIORITY
    request: int

    def tiebreak(self) -> tuple[int, ...]:
        return (self.request,)

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.release_call(self.request, when)


@dataclasses.dataclass(slots=True)  # one per step: plain slots are the cheapest to build
class ReplicaStep(Event):
    """A replica runs its next iteration (if this is still its newest step event)."""

    priority: ClassVar[int] = STEP_PRIORITY
    pool: int
    index: int
    version: int  # the replica's step events before this one are stale

    def tiebreak(self) -> tuple[int, ...]:
        return (self.pool, self.index)

    def fire(self, loop: EventLoop, when: float) -> None:
        if loop.is_current(self):
            loop.step_replica(self.pool, self.index)


class Routable(Protocol):
    """The replicas of a pool that take requests now, as a router sees them."""

    view: ClusterView
    index: NDArray[np.int64]  # [k] the pool's replica behind each of the view's


class ReplicaPool:
    """One role's replicas behind its router, as the router's `ClusterView` reads them.

    Args:
      replicas: the pool's schedulers.
      router: picks the replica of each request routed into the pool.
    """

    def __init__(self, replicas: Sequence[Scheduler], router: Router) -> None:
        self.replicas = list(replicas)
        self.router = router
        self.now_s = 0.0  # the moment being routed
        self._sent: list[list[int]] = [[] for _ in self.replicas]
        # [R] requests routed to each replica that it does not hold yet (a transfer's).
        self._incoming = np.zeros(len(self.replicas), dtype=np.int64)
        self.migrating: set[int] = set()  # requests moving between replicas (migration)
        self.view = ClusterView(self)
        # What the router sees when not every replica takes requests (an elastic cluster's
        # ready ones, `elastic.ActiveReplicas`: `.view`, and `.index` of its replicas).
        self.routable: Optional[Routable] = None

    @property
    def replica_views(self) -> tuple[SchedulerView, ...]:
        return tuple(r.view for r in self.replicas)

    @property
    def replica_ids(self) -> range:
        return range(len(self.replicas))

    def route(self, request: int, when: float, *, incoming: bool = False) -> int:
        """The replica the router picks for `request` at `when` (`incoming`: it will be
        imported later, and counts as outstanding there until then)."""
        target = self.choose(request, when)
        self.take(request, target, when, incoming=incoming)
        return target

    def choose(self, request: int, when: float) -> int:
        """The replica the router picks for `request` at `when`, not sent there yet."""
        self.now_s = when
        if self.routable is None:
            return route_checked(self.router, self.view, request)
        return int(self.routable.index[route_checked(self.router, self.routable.view,
                                                     request)])

    def take(self, request: int, target: int, when: float, *, incoming: bool = False) -> None:
        """Sends `request` to the replica `target` at `when` (picked by `choose`)."""
        self.now_s = when
        self._sent[target].append(request)
        if incoming:
            self._incoming[target] += 1

    def received(self, replica: int) -> None:
        """An incoming request was imported by `replica`."""
        self._incoming[replica] -= 1

    def send(self, request: int, replica: int) -> None:
        """`request` (a migration's) will be imported by `replica`: outstanding there."""
        self._sent[replica].append(request)
        self._incoming[replica] += 1

    def migrating_ids(self) -> NDArray[np.int64]:  # [m]
        """Requests whose migration is under way, sorted."""
        return np.array(sorted(self.migrating), dtype=np.int64)

    def pages_to_receive(self, request: int, replica: int) -> int:
        """KV pages `replica` would reserve to receive `request` now (`reserve_pages`)."""
        scheduler = self.replicas[replica]
        ids = np.array([request], dtype=np.int64)
        tokens = scheduler.capacity.reserved_tokens(ids, scheduler.table.num_computed[ids])
        return int(scheduler.kv.pages_for_tokens(tokens)[0])

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        """Requests routed to each replica and not done there (incoming ones too)."""
        held = np.array([len(r.table) - r.num_done for r in self.replicas], dtype=np.int64)
        return held + self._incoming

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Requests routed to `replica` and not done there: not yet admitted, waiting,
        running, unreleased, or incoming."""
        scheduler = self.replicas[replica]
        ids = np.asarray(self._sent[replica], dtype=np.int64)
        table = scheduler.table
        state = table.state[ids]
        # Held here and not done, incoming (routed, held by none yet), or unreleased.
        held = table.holder[ids] == table.replica
        live = (((state < _FINISHED) & held) | ((state == _AWAY) & (table.holder[ids] < 0))
                | np.isin(ids, scheduler.unreleased))
        self._sent[replica] = ids[live].tolist()
        return ids[live]


class EventLoop(abc.ABC):
    """The loop that a topology of replica pools runs on (see the module docstring).

    A topology subclasses it: `route_arrival` sends an arriving request into pool 0,
    `stepped` reacts to a replica's iteration (it may push its own events).

    Args:
      pools: the replica pools; pool 0 receives the arrivals.
      arrivals: `[A]` the requests to route, in arrival order.
      arrival_s: `[N]` every request's arrival time.
    """

    def __init__(self, pools: Sequence[ReplicaPool], arrivals: NDArray[np.int64],
                 arrival_s: NDArray[np.float64]) -> None:
        self.pools = tuple(pools)
        self.arrivals = arrivals
        self.arrival_s = arrival_s
        self._events: list[tuple[float, int, tuple[int, ...], int, Event]] = []
        self._others: list[float] = []  # [e] times of the events that are not steps (a heap)
        self._order = itertools.count()
        self._versions = [[0] * len(p.replicas) for p in self.pools]
        self._scheduled: list[list[Optional[float]]] = [[None] * len(p.replicas)
                                                        for p in self.pools]
        self._blocked: set[tuple[int, int]] = set()  # (pool, replica) stepped with no effect
        # The workload's agent programs (None without): pool 0's replicas let the loop
        # route each call's release instead of releasing it themselves.
        self.programs = self.pools[0].replicas[0].table.programs
        if self.programs is not None:
            self.programs.self_release = False
        self._arrivals_left = bool(arrivals.size)  # an Arrival event is still to fire
        # The kinds of events a replica's leap need not stop at: its own steps, and the
        # arrivals too once each replica leaps up to its own (`leap_to_own_arrivals`).
        self._apart: tuple[type, ...] = (ReplicaStep,)
        # [N] each request's replica of pool 0 when its arrival was routed ahead (-1: not
        # an arrival; None: routed on arrival); each replica's arrival times, in order,
        # and the position of its next one.
        self._ahead: Optional[NDArray[np.int64]] = None
        self._own_arrival_s: list[NDArray[np.float64]] = []
        self._own_next: list[int] = []

    # -------------------------------------------------------------- running
    def run_events(self, progress: Optional[Callable[[], None]] = None) -> None:
        """Warms every engine up and fires events until none is left.

        Args:
          progress: called after each event.
        """
        for pool in self.pools:
            for scheduler in pool.replicas:
                scheduler.engine.warmup(scheduler.bucket_config.buckets())
        for scheduler in self.pools[0].replicas:
            scheduler.awaits_submissions = bool(self.arrivals.size)
        if self.arrivals.size:
            self.push(Arrival(0), float(self.arrival_s[self.arrivals[0]]))
        if self.programs is not None:
            for scheduler in self.pools[0].replicas:
                scheduler.awaits_submissions = self._awaits()
            self._push_releases()  # those after calls rejected up front
        events, apart = self._events, self._apart
        while events:
            when, _, _, _, event = heapq.heappop(events)
            if type(event) not in apart:
                heapq.heappop(self._others)  # fired in time order: the earliest is this one
            event.fire(self, when)
            if progress is not None:
                progress()

    def push(self, event: Event, when: float) -> None:
        """Schedules `event` at `when`."""
        heapq.heappush(self._events,
                       (when, event.priority, event.tiebreak(), next(self._order), event))
        if type(event) not in self._apart:
            heapq.heappush(self._others, when)

    def has_events(self) -> bool:
        """Whether any event is still to fire."""
        return bool(self._events)

    def next_other_event_s(self) -> Optional[float]:
        """When the next event that is not a replica's step fires (None: none is left): a
        replica whose steps act on no other replica may leap up to it
        (`Scheduler.set_leap_horizon`)."""
        return self._others[0] if self._others else None

    def leap_between_events(self) -> None:
        """Lets every replica leap over steady steps up to the next event of another kind
        (for a topology whose replicas do not act on each other's steps: each replica's
        steps then run alike whether the loop interleaves them one by one or not)."""
        for pool in self.pools:
            for scheduler in pool.replicas:
                scheduler.set_leap_horizon(self.next_other_event_s)

    def leap_to_own_arrivals(self, targets: NDArray[np.int64]) -> None:  # [A]
        """Lets each replica of pool 0 leap up to the next arrival routed to it, and to the
        loop's next event of another kind: for a topology whose replicas do not act on
        each other's steps and whose arrivals were routed ahead (`targets`, the replica
        of each of the loop's arrivals, in order; `Router.state_blind`). An arrival
        routed elsewhere reads and changes nothing of this replica (not its clock: a
        replica that leaps is busy, not blocked), so its steps run alike either way.
        Call before the run starts, with nothing else pushed yet."""
        pool = self.pools[0]
        assert not self._events and targets.shape == self.arrivals.shape
        self._apart = (ReplicaStep, Arrival)  # arrivals no longer cut every replica's leap
        self._ahead = np.full(self.arrival_s.shape, -1, dtype=np.int64)
        self._ahead[self.arrivals] = targets
        times = self.arrival_s[self.arrivals]  # [A] non-decreasing: arrival order
        self._own_arrival_s = [times[targets == index] for index in range(len(pool.replicas))]
        self._own_next = [0] * len(pool.replicas)
        for index, scheduler in enumerate(pool.replicas):
            scheduler.set_leap_horizon(functools.partial(self._own_horizon, index))

    def routed_ahead(self, request: int) -> Optional[int]:
        """The replica of pool 0 that `request`'s arrival was routed to ahead
        (`leap_to_own_arrivals`), or None: it is routed when it arrives."""
        if self._ahead is None or self._ahead[request] < 0:
            return None
        return int(self._ahead[request])

    def _own_horizon(self, index: int) -> Optional[float]:
        """Replica `index` of pool 0 may leap up to this: its next arrival, or the loop's
        next event of another kind (None: neither is left)."""
        own, position = self._own_arrival_s[index], self._own_next[index]
        upcoming = float(own[position]) if position < own.size else None
        if self._others:
            other = self._others[0]
            upcoming = other if upcoming is None else min(upcoming, other)
        return upcoming

    def num_events(self) -> int:
        """Events still to fire (stale step events too)."""
        return len(self._events)

    # --------------------------------------------------------- topologies
    @abc.abstractmethod
    def route_arrival(self, request: int, when: float) -> None:
        """Sends the arriving `request` into pool 0 (`ReplicaPool.route`, then
        `Scheduler.submit` and `wake`)."""

    def stepped(self, pool: int, index: int) -> None:
        """Called after a replica's iteration that changed something."""

    def migrated(self, request: int, target: int) -> None:
        """Called when a migration's target (of pool 0) imported `request`."""

    # ------------------------------------------------------------ arrivals
    def arrive(self, position: int, when: float) -> None:
        """Fires the `position`-th arrival at `when`: idle replicas of pool 0 move to it,
        the topology routes it, and the next arrival is scheduled."""
        if self._blocked:  # the blocked replicas of pool 0, by index (most are busy)
            replicas = self.pools[0].replicas
            for index in sorted(index for pool, index in self._blocked if pool == 0):
                scheduler = replicas[index]
                if not scheduler.in_transfer.size:
                    scheduler.now_s = max(scheduler.now_s, when)  # waited idle for this moment
                    self.wake(0, index)
        request = int(self.arrivals[position])
        if self._ahead is not None:  # that replica's next arrival is the one after this
            self._own_next[int(self._ahead[request])] += 1
        self.route_arrival(request, when)
        if position + 1 < self.arrivals.size:
            self.push(Arrival(position + 1), float(self.arrival_s[self.arrivals[position + 1]]))
            return
        self._arrivals_left = False
        self._last_arrival()

    def _awaits(self) -> bool:
        """Whether pool 0 may still be given requests: an arrival, or a program call not
        released yet."""
        return self._arrivals_left or (self.programs is not None
                                       and self.programs.num_unreleased > 0)

    def _last_arrival(self) -> None:
        """Once nothing more comes, pool 0's replicas stop waiting for it (idle is stuck)."""
        if self._awaits():
            return
        for index, scheduler in enumerate(self.pools[0].replicas):
            scheduler.awaits_submissions = False
            if not scheduler.in_transfer.size:
                self.wake(0, index)

    def release_call(self, request: int, when: float) -> None:
        """Fires a program call's release at `when`: it arrives in pool 0 (idle replicas
        move to `when` first, so the one it is routed to starts it no earlier)."""
        assert self.programs is not None
        self.programs.released(request, when)
        for index, scheduler in enumerate(self.pools[0].replicas):
            idle = not (scheduler.waiting.size or scheduler.running.size
                        or scheduler.unreleased.size)
            if (idle or (0, index) in self._blocked) and not scheduler.in_transfer.size:
                scheduler.now_s = max(scheduler.now_s, when)
                if (0, index) in self._blocked:
                    self.wake(0, index)
        self.route_arrival(request, when)
        self._last_arrival()

    def _push_releases(self) -> None:
        """Turns the program calls whose release time became known into events."""
        assert self.programs is not None
        for when, request in self.programs.pop_releases():
            self.push(CallRelease(request), when)

    # ---------------------------------------------------------------- steps
    def wake(self, pool: int, index: int) -> None:
        """Unblocks a replica and schedules its next step (call after anything gives it
        work or moves its clock)."""
        self._blocked.discard((pool, index))
        self.reschedule(pool, index)

    def reschedule(self, pool: int, index: int) -> None:
        """Schedules the replica's next step at the earliest time it could do something
        (none while blocked or with nothing to do); an older step event goes stale."""
        when = None if (pool, index) in self._blocked else _next_step_s(
            self.pools[pool].replicas[index])
        if when == self._scheduled[pool][index]:
            return
        self._versions[pool][index] += 1
        self._scheduled[pool][index] = when
        if when is not None:
            self.push(ReplicaStep(pool, index, self._versions[pool][index]), when)

    def is_current(self, event: ReplicaStep) -> bool:
        """Whether `event` is its replica's newest step event."""
        return event.version == self._versions[event.pool][event.index]

    def step_replica(self, pool: int, index: int) -> None:
        """Runs one iteration of a replica; one that changes nothing blocks it."""
        self._scheduled[pool][index] = None
        scheduler = self.pools[pool].replicas[index]
        before = _progress_marks(scheduler)
        scheduler.step()
        if self.programs is not None:  # a call done here may release its children
            self._push_releases()
        # An iteration that ran a step changed something; else compare every mark.
        if scheduler.num_steps == before[0] and _progress_marks(scheduler) == before:
            self._blocked.add((pool, index))  # it waits for an event to give it something
            return
        self.stepped(pool, index)
        self.reschedule(pool, index)


def _next_step_s(scheduler: Scheduler) -> Optional[float]:
    """When `scheduler` could next do something: now with work, else at its next
    submitted arrival; None with neither."""
    if scheduler.waiting.size or scheduler.running.size or scheduler.unreleased.size:
        return scheduler.now_s
    upcoming = scheduler.next_arrival_s()
    return None if upcoming is None else max(scheduler.now_s, upcoming)


def _progress_marks(scheduler: Scheduler) -> tuple:
    """What any iteration that did something changes."""
    return (scheduler.num_steps, scheduler.now_s, scheduler.num_done, scheduler.waiting.size,
            scheduler.running.size, scheduler.unreleased.size, scheduler.in_transfer.size,
            scheduler.kv.num_free)


def share_table(requests: Sequence[Request], num_replicas: int,
                make_policy: Callable[[], Policy], make_engine: Callable[[], Engine],
                config: SchedulerConfig, *, kv_counts_only: bool = False,
                log_tokens: bool = True) -> list[Scheduler]:
    """The `num_replicas` replicas of one pool over `requests`, sharing one request table:
    the first builds it, the others see it as theirs (`RequestTable.for_replica`), so the
    workload's facts and each request's progress are kept once per pool, not once per
    replica. Each replica has its own policy, engine, KV pool and clock.

    `kv_counts_only` (each replica's `Scheduler` argument) is the caller's word that no
    replica's pages are read from outside it: no request moves between replicas with
    its KV (a migration, a prefill-to-decode handoff). Default False: the full pools.
    `log_tokens` (each replica's `Scheduler` argument): False counts each replica's
    tokens into its tally, where no request's tokens span replicas."""
    first = Scheduler(requests, make_policy(), make_engine(), config, submitted_only=True,
                      kv_counts_only=kv_counts_only, log_tokens=log_tokens)
    return [first] + [Scheduler(requests, make_policy(), make_engine(), config,
                                submitted_only=True, table=first.table.for_replica(index),
                                kv_counts_only=kv_counts_only, log_tokens=log_tokens)
                      for index in range(1, num_replicas)]


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
