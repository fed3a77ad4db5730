"""Live migration of running and waiting requests between a cluster's replicas.

A rebalancer (`rebalancing.Rebalancer`) is asked every `interval_s` of virtual
time (`RebalanceTick`, the first at `interval_s`) which requests to move. Each
migration is checked before any starts (a broken rule stops the run in one
line naming the rebalancer and leaves every replica as it was): the request is
waiting or running on its source, not already moving, the target is another
replica with room for its computed tokens' pages (beside its watermark), which
it then reserves (`Scheduler.reserve_pages`).

Its KV moves over the cluster's link (`transfers.KVTransferCost`: `latency +
bytes / bandwidth` for the pages a round copies, whole pages):

* live copy (Llumnix): round 1 copies every page of the request's computed
  tokens while the source keeps running it; each next round copies the pages
  filled meanwhile (the last, partly filled page again), the target's
  reservation growing with them. Once a round ends with at most `stop_pages`
  pages left (or after `max_rounds` rounds) the source stops the request and the
  last pages are copied: only that stop-and-copy is downtime.
* stop-and-copy: the source stops the request at once and every page is copied
  in one round: the whole copy is downtime.

At the stop the source exports the request and releases it (its pages go back
to its pool then, once: the bytes in flight are held by the target's
reservation); at the end the target imports it, waiting with its computed
tokens' KV (`Scheduler.import_request`): it decodes on with no recompute. A
live copy is aborted (the target's reservation given back, nothing logged but
the count) when, at a round's end, the request finished, was preempted or left
its source, or the target has no room for the pages it grew by.

On an engine with KV (the real engine) each round's pages are copied for real
when the round starts: the source engine's pages are read (`Engine.read_kv_pages`)
and written into the same positions of the target's reserved pages
(`Engine.write_kv_pages`); the last, partly filled page is copied again by the
next round, as it is priced. The copy's wall time is measured (waited for:
`Engine.wait_kv`) and logged (`copy_wall_s`); with `measure_copy` (a real
engine on the wall clock) it is added to the round's priced time, so the
downtime holds it. The simulator's engine has no KV: nothing is copied or timed.

What is modelled and what is not: each migration's own rounds, latency and
bandwidth; not contention between migrations or with other traffic (each has
the whole link), nor the source's steps slowing while it sends. A replica may
have run up to one step (or a leap) past the event's instant; a migration
starts, and stops its request, at the later of the event's and its source's clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Optional, Sequence

import numpy as np

from orca_jax.cluster.event_loop import Event, EventLoop, ReplicaPool
from orca_jax.cluster.rebalancing import MIGRATION_MODES, Migration, Rebalancer
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.core.loop.request_export import RequestExport
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.requests.request import RequestState

if TYPE_CHECKING:
    from orca_jax.core.loop.scheduler import Scheduler

_WAITING, _RUNNING = int(RequestState.WAITING), int(RequestState.RUNNING)

# At one instant: after arrivals and transfers, rounds' ends, then the rebalancer, then steps.
STAGE_PRIORITY = 5
TICK_PRIORITY = 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class MigrationSpec:
    """How a cluster migrates requests.

    Attributes:
      cost: the link and a token's KV bytes on one shard (`transfers.kv_transfer_cost`).
      mode: `live` (copy while the source runs, then a short stop-and-copy) or
        `stop_and_copy`.
      interval_s: virtual seconds between the rebalancer's calls (> 0).
      stop_pages: live copy stops the request once at most this many pages are left.
      max_rounds: live copy stops the request after this many rounds at most.
      measure_copy: add each round's measured copy wall time to its priced time (a real
        engine whose clock is measured wall time; off: the link's price alone, repeatable).
    """

    cost: KVTransferCost
    mode: str = "live"
    interval_s: float = 0.5
    stop_pages: int = 1
    max_rounds: int = 8
    measure_copy: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MIGRATION_MODES:
            raise ValueError(f"migration mode {self.mode!r}; choose one of "
                             f"{', '.join(MIGRATION_MODES)}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"rebalance_interval_s must be a positive number of seconds, got "
                             f"{self.interval_s!r}")
        if self.stop_pages < 0 or self.max_rounds < 1:
            raise ValueError(f"migration: stop_pages >= 0 and max_rounds >= 1, got "
                             f"{self.stop_pages}, {self.max_rounds}")


class MigrationLog(NamedTuple):
    """One finished migration, as written to migrations.jsonl."""

    request: int  # request index (arrival order)
    from_replica: int
    to_replica: int
    start_s: float  # the first round began (the target's pages reserved)
    stop_s: float  # the source stopped the request and freed its pages
    end_s: float  # the target holds it, waiting
    num_pages: int  # pages copied over every round (a page filled meanwhile counts again)
    num_bytes: int  # bytes one shard's link carried
    num_rounds: int  # copy rounds, the stop-and-copy included
    downtime_s: float  # end_s - stop_s: the request ran nowhere
    copy_wall_s: float  # measured wall time of the real page copies (0: an engine without KV)

    def row(self) -> dict[str, Any]:
        return self._asdict()


@dataclasses.dataclass
class _Moving:
    """One migration under way."""

    request: int
    source: int
    target: int
    start_s: float
    preemptions: int  # the request's preemptions at the start (a preemption aborts)
    copied_tokens: int  # tokens in whole pages copied so far
    num_pages: int = 0
    num_rounds: int = 0
    stop_s: float = math.nan
    copy_wall_s: float = 0.0
    export: Optional[RequestExport] = None


class Migrator:
    """Runs a rebalancer's migrations on a colocated cluster's one pool (module docstring).

    Args:
      loop: the cluster's event loop.
      pool: its replicas.
      rebalancer: the plugin asked every `spec.interval_s`.
      spec: how migrations are priced.
    """

    def __init__(self, loop: EventLoop, pool: ReplicaPool, rebalancer: Rebalancer,
                 spec: MigrationSpec) -> None:
        if len(pool.replicas) < 2:
            raise ValueError(f"rebalancer {rebalancer.name!r}: migration needs 2 or more "
                             f"replicas, got {len(pool.replicas)}")
        if not rebalancer.name:  # an instance of an unregistered class: name it by its class
            rebalancer.name = type(rebalancer).__name__.lower()
        first = pool.replicas[0]
        if not first.config.kv.receives_transfers:
            raise ValueError(f"rebalancer {rebalancer.name!r}: kv_layout "
                             f"{first.config.kv.kv_layout!r}; a migrated request's pages are "
                             "reserved before it arrives, which needs the 'paged' layout")
        self.loop, self.pool, self.rebalancer, self.spec = loop, pool, rebalancer, spec
        self.log: list[MigrationLog] = []
        self.num_aborted = 0
        self._moving: dict[int, _Moving] = {}

    def start(self) -> None:
        """Warms up the page copy and schedules the rebalancer's first call."""
        self._warm_copies()
        self.loop.push(RebalanceTick(), self.spec.interval_s)

    def _warm_copies(self) -> None:
        """Copies no page once on every engine (a real engine compiles its page gather and
        scatter then), so that no migration's measured copy holds a compile."""
        none = np.zeros(0, dtype=np.int32)
        for replica in self.pool.replicas:
            contents = replica.engine.read_kv_pages(none)
            if contents is not None:
                replica.engine.write_kv_pages(none, contents)
                replica.engine.wait_kv()

    # --------------------------------------------------------------- events
    def tick(self, when: float) -> None:
        """Asks the rebalancer, starts its migrations, and schedules the next call while
        anything else is still to happen."""
        self.pool.now_s = when
        asked = self.rebalancer.rebalance(self.pool.view)
        for moving in self._checked(asked, when):
            self._moving[moving.request] = moving
            self.pool.migrating.add(moving.request)
            if self.spec.mode == "live":
                self._copy_round(moving, moving.start_s)
            else:
                self._stop(moving, moving.start_s)
        if self.loop.has_events():
            self.loop.push(RebalanceTick(), when + self.spec.interval_s)

    def round_ended(self, moving: _Moving, when: float) -> None:
        """A live copy's round ended: abort, copy again, or stop the request."""
        source = self.pool.replicas[moving.source]
        target = self.pool.replicas[moving.target]
        table = source.table
        request = moving.request
        if (table.holder[request] != moving.source
                or int(table.state[request]) not in (_WAITING, _RUNNING)
                or int(table.num_preemptions[request]) != moving.preemptions
                or not target.grow_reserved_pages(request, int(table.num_computed[request]))):
            target.cancel_reservation(request)
            self._forget(moving)
            self.num_aborted += 1
            self.loop.wake(0, moving.target)  # its pages came back
            return
        left = _pages(source, int(table.num_computed[request])) - (
            moving.copied_tokens // source.kv.page_size)
        if left <= self.spec.stop_pages or moving.num_rounds >= self.spec.max_rounds:
            self._stop(moving, max(when, source.now_s))
        else:
            self._copy_round(moving, when)

    def arrived(self, moving: _Moving, when: float) -> None:
        """The last pages arrived: the target holds the request."""
        target = self.pool.replicas[moving.target]
        assert moving.export is not None
        target.import_request(moving.export, when)
        self.pool.received(moving.target)
        self._forget(moving)
        self.loop.migrated(moving.request, moving.target)
        cost = self.spec.cost
        page_size = target.kv.page_size
        self.log.append(MigrationLog(
            request=moving.request, from_replica=moving.source, to_replica=moving.target,
            start_s=moving.start_s, stop_s=moving.stop_s, end_s=when,
            num_pages=moving.num_pages,
            num_bytes=cost.num_bytes(moving.num_pages * page_size),
            num_rounds=moving.num_rounds, downtime_s=when - moving.stop_s,
            copy_wall_s=moving.copy_wall_s))
        self.loop.wake(0, moving.target)

    # ----------------------------------------------------------------- moves
    def _copy_round(self, moving: _Moving, when: float) -> None:
        """Copies, while the source runs, the pages filled since the last round."""
        source = self.pool.replicas[moving.source]
        computed = int(source.table.num_computed[moving.request])
        seconds = self._send(moving, source, computed)
        self.loop.push(RoundEnd(moving), when + seconds)

    def _stop(self, moving: _Moving, when: float) -> None:
        """The source stops the request and frees its pages; its last pages are copied."""
        source = self.pool.replicas[moving.source]
        target = self.pool.replicas[moving.target]
        computed = int(source.table.num_computed[moving.request])
        # The pages are copied here (`_send`), before the source lets them go.
        moving.export = source.export_request(moving.request, with_kv=False)
        assert target.kv.num_held[moving.request] >= _pages(target, computed)
        seconds = self._send(moving, source, computed)
        source.release_request(moving.request, when)
        moving.stop_s = when
        self.pool.send(moving.request, moving.target)
        self.loop.wake(0, moving.source)
        self.loop.push(Arrived(moving), when + seconds)

    def _send(self, moving: _Moving, source: "Scheduler", computed: int) -> float:
        """Sends one round's pages, from the first not wholly copied to the last held,
        and returns the round's seconds: the link's price (plus the copy's measured wall
        time with `measure_copy`)."""
        page_size = source.kv.page_size
        first = moving.copied_tokens // page_size
        last = _pages(source, computed)
        moving.copied_tokens = computed // page_size * page_size
        moving.num_pages += last - first
        moving.num_rounds += 1
        wall_s = self._copy_pages(moving, first, last)
        moving.copy_wall_s += wall_s
        price_s = self.spec.cost.seconds((last - first) * page_size)
        return price_s + wall_s if self.spec.measure_copy else price_s

    def _copy_pages(self, moving: _Moving, first: int, last: int) -> float:
        """Copies the request's pages `first..last-1` from the source engine's cache into
        the same positions of the pages reserved at the target; returns the measured wall
        seconds (0.0: nothing to copy, or an engine without KV)."""
        if last <= first:
            return 0.0
        source = self.pool.replicas[moving.source]
        target = self.pool.replicas[moving.target]
        started = time.perf_counter()
        contents = source.engine.read_kv_pages(source.kv.pages_of(moving.request)[first:last])
        if contents is None:  # the simulator: no KV to move
            return 0.0
        target.engine.write_kv_pages(target.kv.pages_of(moving.request)[first:last], contents)
        target.engine.wait_kv()
        return time.perf_counter() - started

    def _forget(self, moving: _Moving) -> None:
        del self._moving[moving.request]
        self.pool.migrating.discard(moving.request)

    def _checked(self, asked: Sequence[Migration], when: float) -> list[_Moving]:
        """The migrations to start, each checked, and their targets' pages reserved; a
        broken rule gives back this call's reservations and raises.

        Raises:
          PlanError: kind `rebalancer`, naming the rule.
        """
        name = self.rebalancer.name
        replicas = self.pool.replicas
        checked: list[_Moving] = []
        try:
            if isinstance(asked, (str, bytes)) or not isinstance(asked, Sequence):
                raise PlanError(name, "not_migrations", f"rebalance() returned {asked!r}; "
                                "give a list of Migration(request, source, target)",
                                kind="rebalancer")
            for move in asked:
                request, source, target = _fields(name, move)
                if not (0 <= source < len(replicas) and 0 <= target < len(replicas)
                        and source != target):
                    raise PlanError(name, "replica_out_of_range",
                                    f"{tuple(move)!r}: source and target must be two replicas "
                                    f"of 0..{len(replicas) - 1}", kind="rebalancer")
                table = replicas[source].table
                if not (0 <= request < len(table)):
                    raise PlanError(name, "unknown_request", f"{tuple(move)!r}: no request "
                                    f"{request} (the workload has {len(table)})",
                                    kind="rebalancer")
                if request in self.pool.migrating or any(m.request == request for m in checked):
                    raise PlanError(name, "already_migrating", f"request {request} is already "
                                    "moving", kind="rebalancer")
                state = int(table.state[request])
                if table.holder[request] != source or state not in (_WAITING, _RUNNING):
                    holder = int(table.holder[request])
                    raise PlanError(name, "not_on_source",
                                    f"request {request} is not waiting or running on replica "
                                    f"{source} (it is {RequestState(state).name}, held by "
                                    f"{'no replica' if holder < 0 else f'replica {holder}'})",
                                    kind="rebalancer")
                computed = int(table.num_computed[request])
                if not replicas[target].reserve_pages(request, computed):
                    raise PlanError(name, "no_room",
                                    f"replica {target} has no room for request {request}'s "
                                    f"{self.pool.pages_to_receive(request, target)} KV pages "
                                    f"({replicas[target].kv.num_free} free, beside its "
                                    "watermark)", kind="rebalancer")
                checked.append(_Moving(
                    request=request, source=source, target=target,
                    start_s=max(when, replicas[source].now_s),
                    preemptions=int(table.num_preemptions[request]), copied_tokens=0))
        except PlanError:
            for moving in checked:
                replicas[moving.target].cancel_reservation(moving.request)
            raise
        return checked


def _fields(name: str, move: Any) -> tuple[int, int, int]:
    ok = isinstance(move, tuple) and len(move) == 3 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in move)
    if not ok:
        raise PlanError(name, "not_migrations", f"rebalance() gave {move!r}; each migration "
                        "is Migration(request, source, target) of integers", kind="rebalancer")
    return int(move[0]), int(move[1]), int(move[2])


def _pages(scheduler: "Scheduler", num_tokens: int) -> int:
    return int(scheduler.kv.pages_for_tokens(np.array([num_tokens], dtype=np.int64))[0])


def migration_figures(migrator: Migrator) -> dict[str, Any]:
    """summary.json's migration figures."""
    log = migrator.log
    downtime = np.array([m.downtime_s for m in log])
    return {"rebalancer": migrator.rebalancer.name, "migration": migrator.spec.mode,
            "num_migrations": len(log), "num_migrations_aborted": migrator.num_aborted,
            "migration_pages_total": int(sum(m.num_pages for m in log)),
            "migration_downtime_s_mean": float(downtime.mean()) if log else None,
            "migration_downtime_s_max": float(downtime.max()) if log else None}


@dataclasses.dataclass(frozen=True)
class RebalanceTick(Event):
    """The rebalancer is asked which requests to move."""

    priority: ClassVar[int] = TICK_PRIORITY

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.migrator.tick(when)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, eq=False)
class RoundEnd(Event):
    """A live copy's round of pages arrived at the target."""

    priority: ClassVar[int] = STAGE_PRIORITY
    moving: _Moving

    def tiebreak(self) -> tuple[int, ...]:
        return (self.moving.request,)

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.migrator.round_ended(self.moving, when)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, eq=False)
class Arrived(Event):
    """A migration's last pages arrived: the target holds the request."""

    priority: ClassVar[int] = STAGE_PRIORITY
    moving: _Moving

    def tiebreak(self) -> tuple[int, ...]:
        return (self.moving.request,)

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.migrator.arrived(self.moving, when)  # type: ignore[attr-defined]
