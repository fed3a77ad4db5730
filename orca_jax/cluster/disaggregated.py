"""Disaggregated prefill and decode: a prefill pool and a decode pool, with priced KV transfers.

Every replica is a whole `Scheduler` (its own policy instance, engine, KV pool
and clock), as in the colocated `Cluster`. A request arrives at a prefill
replica picked by the prefill router and runs its prompt there, chunked or not
as that replica's policy decides, up to its first token: a prefill replica
sees each request with an output of one token (`SchedulerConfig.kv_handoff`
keeps its pages). The decode router then picks a decode replica and the
request's KV queues on that (prefill, decode) link (`transfers.LinkQueues`). A
transfer starts when its link has a free slot and the decode pool has room:
the pages are reserved then (`core.handoff.reserve`); it lasts `latency +
bytes / bandwidth` (`transfers.KVTransferCost`); at its end the decode
replica receives the request as waiting, prompt computed and first token known
(`core.handoff.deliver`), and the prefill replica frees the pages
(`core.handoff.release`). An engine with a KV cache copies the pages then
(`Engine.read_kv_pages`, `write_kv_pages`). A request whose answer is one token
is done at the prefill replica: nothing moves.

One virtual clock: events run in time order (arrivals first at a tie, then
transfer ends, then handoffs and retries, then replica steps), and each replica
steps only when its clock is the earliest, so a router sees every replica of
its pool at the moment it routes. A replica that can do nothing until a
transfer ends waits (it is woken by the transfer's end, or by an arrival).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.disaggregated_result import join_pools
from orca_jax.cluster.replicas import route_checked
from orca_jax.cluster.routing import ClusterView, Router, make_router
from orca_jax.cluster.transfers import KVTransferCost, LinkQueues, Transfer
from orca_jax.core import handoff
from orca_jax.core.engine_api import Engine
from orca_jax.core.policy import Policy
from orca_jax.core.request import Request, RequestState
from orca_jax.core.run_record import TransferLog
from orca_jax.core.run_result import RunResult
from orca_jax.core.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.view import SchedulerView

_ROUTED_AWAY, _FINISHED = int(RequestState.ROUTED_AWAY), int(RequestState.FINISHED)
# Event priorities at one instant: an arrival is routed before anyone steps past it.
_ARRIVAL, _TRANSFER_END, _HANDOFF, _RETRY, _STEP = range(5)


class _Pool:
    """One role's replicas, as a router's `ClusterView` reads them (`ClusterState`)."""

    def __init__(self, replicas: Sequence[Scheduler]) -> None:
        self.replicas = list(replicas)
        self.now_s = 0.0  # the moment being routed
        self._sent: list[list[int]] = [[] for _ in self.replicas]

    @property
    def replica_views(self) -> tuple[SchedulerView, ...]:
        return tuple(r.view for r in self.replicas)

    def send(self, replica: int, request: int) -> None:
        self._sent[replica].append(request)

    def outstanding_ids(self, replica: int) -> NDArray[np.int64]:  # [n]
        """Requests sent to `replica` and not done there (on a decode replica, queued
        or in transfer too)."""
        scheduler = self.replicas[replica]
        ids = np.asarray(self._sent[replica], dtype=np.int64)
        state = scheduler.table.state[ids]
        live = (state < _FINISHED) | (state == _ROUTED_AWAY) | np.isin(ids, scheduler.unreleased)
        self._sent[replica] = ids[live].tolist()
        return ids[live]

    def outstanding(self) -> NDArray[np.int64]:  # [R]
        return np.array([self.outstanding_ids(r).size for r in range(len(self.replicas))],
                        dtype=np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """One role's replicas: how many, and how each is built.

    Attributes:
      num_replicas: replicas in the pool (>= 1).
      make_policy: a fresh policy per replica.
      make_engine: a fresh engine per replica.
      config: every replica's limits.
      router: a `Router`, or its spec (registered name, `module:Class`, `file.py:Class`).
      router_options: the router's knobs as text, when `router` is a spec.
    """

    num_replicas: int
    make_policy: Callable[[], Policy]
    make_engine: Callable[[], Engine]
    config: SchedulerConfig
    router: Union[Router, str] = "round_robin"
    router_options: Optional[Mapping[str, str]] = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"a pool needs num_replicas >= 1, got {self.num_replicas}")

    def build_router(self) -> Router:
        return (self.router if isinstance(self.router, Router)
                else make_router(self.router, self.router_options))


class DisaggregatedCluster:
    """A prefill pool and a decode pool behind their routers (see the module docstring).

    Args:
      requests: the workload.
      prefill: the prefill pool (its config gets `kv_handoff`).
      decode: the decode pool (no prefix caching there: a received request's pages
        are its own; the `paged` KV layout only).
      transfer_cost: the KV link and the bytes a token's KV is on one shard.
    """

    def __init__(self, requests: Sequence[Request], *, prefill: PoolSpec, decode: PoolSpec,
                 transfer_cost: KVTransferCost) -> None:
        if decode.config.kv_layout != "paged":
            raise ValueError(f"decode pool: kv_layout {decode.config.kv_layout!r}; a received "
                             "request's pages are reserved before its admission, so the decode "
                             "pool needs the 'paged' layout")
        self.transfer_cost = transfer_cost
        prompts = [dataclasses.replace(r, output_len=1, planned_output_tokens=None)
                   for r in requests]
        prefill_config = dataclasses.replace(prefill.config, kv_handoff=True)
        decode_config = dataclasses.replace(decode.config, kv_handoff=False,
                                            enable_prefix_caching=False)
        self.prefill = [Scheduler(prompts, prefill.make_policy(), prefill.make_engine(),
                                  prefill_config) for _ in range(prefill.num_replicas)]
        self.decode = [Scheduler(requests, decode.make_policy(), decode.make_engine(),
                                 decode_config) for _ in range(decode.num_replicas)]
        for scheduler in self.decode:
            handoff.withhold_all(scheduler)
        self.prefill_router, self.decode_router = prefill.build_router(), decode.build_router()
        self._pools = (_Pool(self.prefill), _Pool(self.decode))
        self.prefill_view, self.decode_view = (ClusterView(pool) for pool in self._pools)
        self.queues = LinkQueues(transfer_cost.link.max_concurrent)
        self.transfers: list[TransferLog] = []
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._blocked: set[tuple[int, int]] = set()  # (pool, replica) waiting on a transfer

    @property
    def num_replicas(self) -> int:
        return len(self.prefill) + len(self.decode)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        """Runs every request through both pools; returns the joined result."""
        for scheduler in (*self.prefill, *self.decode):
            scheduler.engine.warmup(scheduler.bucket_config.buckets())
        arrivals = self._arrivals()
        arrival_s = self.prefill[0].table.arrival_s
        next_arrival = 0
        while True:
            choices = [(math.inf, _STEP)]
            if next_arrival < arrivals.size:
                choices.append((float(arrival_s[arrivals[next_arrival]]), _ARRIVAL))
            if self._events:
                choices.append(self._events[0][:2])
            step_s, pool, replica = self._next_step()
            choices.append((step_s, _STEP))
            when, kind = min(choices)
            if math.isinf(when):
                break
            if kind == _ARRIVAL:
                self._route_arrival(int(arrivals[next_arrival]), when)
                next_arrival += 1
            elif kind == _STEP:
                self._step(pool, replica)
            else:
                _, _, _, payload = heapq.heappop(self._events)
                self._handle(kind, payload, when)
        self._check_all_served()
        return join_pools(
            RunResult.concat([s.result() for s in self.prefill], router=self.prefill_router.name,
                             unrouted_ok=True),
            RunResult.concat([s.result() for s in self.decode], router=self.decode_router.name,
                             unrouted_ok=True),
            transfers=self.transfers)

    def _arrivals(self) -> NDArray[np.int64]:
        """Requests to route, in arrival order; those the decode pool rejected up front
        (too long for its context or pool) never start their prompt."""
        decode_rejected = self.decode[0].table.state == RequestState.REJECTED
        pending = self.prefill[0].table.state == RequestState.PENDING
        for scheduler in self.prefill:
            scheduler.withdraw(np.flatnonzero(pending & decode_rejected).tolist())
        return np.flatnonzero(pending & ~decode_rejected)

    def _push(self, when: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (when, kind, next(self._order), payload))

    def _next_step(self) -> tuple[float, int, int]:
        """(when, pool, replica) of the earliest replica step that could do something."""
        best = (math.inf, -1, -1)
        for pool, replicas in enumerate((self.prefill, self.decode)):
            for index, scheduler in enumerate(replicas):
                if (pool, index) in self._blocked:
                    continue
                if scheduler.waiting.size or scheduler.running.size or scheduler.unreleased.size:
                    when = scheduler.now_s
                else:
                    upcoming = scheduler.next_arrival_s()  # a routed arrival (pool 0 only)
                    if upcoming is None:
                        continue
                    when = max(scheduler.now_s, upcoming)
                best = min(best, (when, pool, index))
        return best

    # --------------------------------------------------------------- events
    def _route_arrival(self, request: int, when: float) -> None:
        pool = self._pools[0]
        pool.now_s = when
        target = route_checked(self.prefill_router, self.prefill_view, request)
        pool.send(target, request)
        for index, scheduler in enumerate(self.prefill):
            if index != target:
                scheduler.withdraw([request])
        self._blocked.discard((0, target))

    def _step(self, pool: int, replica: int) -> None:
        scheduler = (self.prefill, self.decode)[pool][replica]
        before = _progress_marks(scheduler)
        scheduler.step()
        if _progress_marks(scheduler) == before:
            self._blocked.add((pool, replica))  # it waits for a transfer to end
            return
        if pool == 0:
            for request in scheduler.last_finished.tolist():
                self._push(scheduler.now_s, _HANDOFF, (request, replica))
        elif self.queues.num_waiting(replica):
            self._push(scheduler.now_s, _RETRY, replica)  # its step may have freed pages

    def _handle(self, kind: int, payload: object, when: float) -> None:
        if kind == _HANDOFF:
            request, source = payload  # type: ignore[misc]
            if self.decode[0].table.output_len[request] == 1:  # its answer is complete
                handoff.release(self.prefill[source], np.array([request], np.int64), when)
                self._blocked.discard((0, source))
                return
            pool = self._pools[1]
            pool.now_s = when
            target = route_checked(self.decode_router, self.decode_view, request)
            pool.send(target, request)
            self.queues.enqueue(Transfer(
                request=request, source=source, target=target,
                num_tokens=int(self.prefill[source].table.prompt_len[request]), ready_s=when))
            self._start_transfers(target, when)
        elif kind == _RETRY:
            self._start_transfers(payload, when)  # type: ignore[arg-type]
        else:
            self._end_transfer(payload, when)  # type: ignore[arg-type]

    def _start_transfers(self, target: int, when: float) -> None:
        """Starts the oldest queued transfers into decode replica `target` while their
        links have a free slot and the pool has room (a full pool holds back all)."""
        decode = self.decode[target]
        while True:
            head = next(self.queues.startable(target), None)
            if head is None or not handoff.reserve(decode, head.request):
                return
            self.queues.start(head, when, self.transfer_cost.seconds(head.num_tokens))
            self._push(head.end_s, _TRANSFER_END, head)

    def _end_transfer(self, transfer: Transfer, when: float) -> None:
        source, target = self.prefill[transfer.source], self.decode[transfer.target]
        request = transfer.request
        self.queues.finish(transfer)
        num_pages = int(source.kv.pages_for_tokens(np.array([transfer.num_tokens]))[0])
        target.engine.write_kv_pages(target.kv.pages_of(request)[:num_pages],
                                     source.engine.read_kv_pages(
                                         source.kv.pages_of(request)[:num_pages]))
        handoff.deliver(target, request, first_token=int(source.table.last_token[request]),
                        first_token_s=float(source.table.first_token_s[request]), at_s=when)
        handoff.release(source, np.array([request], dtype=np.int64), when)
        self.transfers.append(TransferLog(
            request=request, from_replica=transfer.source,
            to_replica=len(self.prefill) + transfer.target,
            num_bytes=self.transfer_cost.num_bytes(transfer.num_tokens),
            ready_s=transfer.ready_s, start_s=transfer.start_s, end_s=transfer.end_s))
        self._blocked.discard((0, transfer.source))
        self._blocked.discard((1, transfer.target))
        self._start_transfers(transfer.target, when)

    def _check_all_served(self) -> None:
        """Every request finished or rejected exactly once, every page back in its pool."""
        stuck = [(0, i) for i, s in enumerate(self.prefill) if not s.done or s.in_transfer.size]
        stuck += [(1, i) for i, s in enumerate(self.decode)
                  if not s.done or s.in_transfer.size or self.queues.num_waiting(i)]
        if stuck:
            pool, index = stuck[0]
            scheduler = (self.prefill, self.decode)[pool][index]
            raise RuntimeError(
                f"disaggregated run stalled: {('prefill', 'decode')[pool]} replica {index} has "
                f"{scheduler.waiting.size} waiting, {scheduler.running.size} running, "
                f"{scheduler.in_transfer.size} in transfer and "
                f"{self.queues.num_waiting(index) if pool else 0} queued transfers; "
                f"{scheduler.kv.num_free} of {scheduler.kv.num_kv_pages} KV pages free")


def _progress_marks(scheduler: Scheduler) -> tuple:
    """What any iteration that did something changes."""
    return (scheduler.num_steps, scheduler.now_s, scheduler.num_done, scheduler.waiting.size,
            scheduler.running.size, scheduler.unreleased.size, scheduler.in_transfer.size,
            scheduler.kv.num_free)
