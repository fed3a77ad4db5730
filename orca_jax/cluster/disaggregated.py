"""Disaggregated prefill and decode: a prefill pool and a decode pool, with priced KV transfers.

Every replica is a whole `Scheduler` (its own policy instance, engine, KV pool
and clock), as in the colocated `Cluster`. A request arrives at a prefill
replica picked by the prefill router and runs its prompt there, chunked or not
as that replica's policy decides, up to its first token: a prefill replica
sees each request with an output of one token (`SchedulerConfig.features.kv_handoff`
keeps its pages). The decode router then picks a decode replica and the
request's KV queues on that (prefill, decode) link (`transfers.LinkQueues`). A
transfer starts when its link has a free slot and the decode pool has room:
the pages are reserved then (`handoff.reserve`); it lasts `latency +
bytes / bandwidth` (`transfers.KVTransferCost`); at its end the decode
replica imports the request, waiting, prompt computed and first token known
(`handoff.deliver`), and the prefill replica frees the pages
(`handoff.release`). An engine with a KV cache copies the pages then
(`Engine.read_kv_pages`, `write_kv_pages`). A request whose answer is one token
is done at the prefill replica: nothing moves.

It runs on the cluster's one event loop (`event_loop.EventLoop`), pool 0 the
prefill pool and pool 1 the decode pool, with three kinds of its own: at one
instant transfer ends fire after arrivals, then handoffs, then retries of a
decode replica's queued transfers, then replica steps. A replica that can do
nothing until a transfer ends waits (it is woken by the transfer's end, or by
an arrival).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Mapping, Optional, Sequence, Union

import numpy as np

from orca_jax.cluster import handoff
from orca_jax.cluster.disaggregated_result import join_pools
from orca_jax.cluster.event_loop import Event, EventLoop, ReplicaPool, share_table
from orca_jax.cluster.routing import Router, make_router
from orca_jax.cluster.transfers import KVTransferCost, LinkQueues, Transfer
from orca_jax.core.api.policy import Policy
from orca_jax.core.loop.scheduler import SchedulerConfig
from orca_jax.core.requests.programs import has_programs
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.requests.run_record import TransferLog
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.engine_api import Engine

_AWAY = int(RequestState.ROUTED_AWAY)


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


class DisaggregatedCluster(EventLoop):
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
        if has_programs(requests):
            raise ValueError("disaggregated cluster: a workload of agent programs (calls "
                             "released by their parents) is not supported yet; run it on "
                             "one replica or --num_replicas (docs/programs.md)")
        if not decode.config.kv.receives_transfers:
            raise ValueError(f"decode pool: kv_layout {decode.config.kv.kv_layout!r}; a received "
                             "request's pages are reserved before its admission, so the decode "
                             "pool needs the 'paged' layout")
        self.transfer_cost = transfer_cost
        prompts = [dataclasses.replace(r, output_len=1, planned_output_tokens=None)
                   for r in requests]
        prefill_config = prefill.config.with_knobs(kv_handoff=True)
        decode_config = decode.config.with_knobs(kv_handoff=False, prefix_caching="off")
        # Each pool's replicas share its request table (the prefill pool's answers are
        # one token long, the decode pool's whole).
        self.prefill = share_table(prompts, prefill.num_replicas, prefill.make_policy,
                                   prefill.make_engine, prefill_config)
        self.decode = share_table(requests, decode.num_replicas, decode.make_policy,
                                  decode.make_engine, decode_config)
        self.prefill_router, self.decode_router = prefill.build_router(), decode.build_router()
        self._prefill_pool = ReplicaPool(self.prefill, self.prefill_router)
        self._decode_pool = ReplicaPool(self.decode, self.decode_router)
        self.prefill_view, self.decode_view = self._prefill_pool.view, self._decode_pool.view
        self.queues = LinkQueues(transfer_cost.link.max_concurrent)
        self.transfers: list[TransferLog] = []
        # Requests to route, in arrival order; those either pool rejected up front (too
        # long for its context or pool) never start their prompt.
        arrivals = np.flatnonzero((self.prefill[0].table.state == _AWAY)
                                  & (self.decode[0].table.state == _AWAY))
        super().__init__([self._prefill_pool, self._decode_pool], arrivals,
                         self.prefill[0].table.arrival_s)

    @property
    def num_replicas(self) -> int:
        return len(self.prefill) + len(self.decode)

    def run(self) -> RunResult:
        """Runs every request through both pools; returns the joined result."""
        self.run_events()
        self._check_all_served()
        return join_pools(
            RunResult.concat([s.result() for s in self.prefill], router=self.prefill_router.name,
                             unrouted_ok=True),
            RunResult.concat([s.result() for s in self.decode], router=self.decode_router.name,
                             unrouted_ok=True),
            transfers=self.transfers)

    # --------------------------------------------------------------- events
    def route_arrival(self, request: int, when: float) -> None:
        target = self._prefill_pool.route(request, when)
        self.prefill[target].submit([request])
        self.wake(0, target)

    def stepped(self, pool: int, index: int) -> None:
        scheduler = (self.prefill, self.decode)[pool][index]
        if pool == 0:
            for request in scheduler.last_finished.tolist():
                self.push(Handoff(request, index), scheduler.now_s)
        elif self.queues.num_waiting(index):
            self.push(RetryTransfers(index), scheduler.now_s)  # its step may have freed pages

    def hand_off(self, request: int, source: int, when: float) -> None:
        """A prefill replica sampled `request`'s first token: route it to a decode replica
        and queue its transfer (or, its answer complete, free its pages)."""
        if self.decode[0].table.output_len[request] == 1:  # its answer is complete
            handoff.release(self.prefill[source], request, when)
            self.wake(0, source)
            return
        target = self._decode_pool.route(request, when, incoming=True)
        self.queues.enqueue(Transfer(
            request=request, source=source, target=target,
            num_tokens=int(self.prefill[source].table.prompt_len[request]), ready_s=when))
        self.start_transfers(target, when)

    def start_transfers(self, target: int, when: float) -> None:
        """Starts the oldest queued transfers into decode replica `target` while their
        links have a free slot and the pool has room (a full pool holds back all)."""
        decode = self.decode[target]
        while True:
            head = next(self.queues.startable(target), None)
            if head is None or not handoff.reserve(decode, head.request):
                self.reschedule(1, target)
                return
            self.queues.start(head, when, self.transfer_cost.seconds(head.num_tokens))
            self.push(TransferEnd(head), head.end_s)

    def end_transfer(self, transfer: Transfer, when: float) -> None:
        """A transfer ended: the decode replica holds its request, the prefill replica
        frees its pages."""
        source, target = self.prefill[transfer.source], self.decode[transfer.target]
        self.queues.finish(transfer)
        handoff.deliver(source, target, transfer.request, when)
        self._decode_pool.received(transfer.target)
        handoff.release(source, transfer.request, when)
        self.transfers.append(TransferLog(
            request=transfer.request, from_replica=transfer.source,
            to_replica=len(self.prefill) + transfer.target,
            num_bytes=self.transfer_cost.num_bytes(transfer.num_tokens),
            ready_s=transfer.ready_s, start_s=transfer.start_s, end_s=transfer.end_s))
        self.wake(0, transfer.source)
        self.wake(1, transfer.target)
        self.start_transfers(transfer.target, when)

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


@dataclasses.dataclass(frozen=True)
class TransferEnd(Event):
    """A KV transfer ends: its request moves to its decode replica."""

    priority: ClassVar[int] = 1
    transfer: Transfer

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.end_transfer(self.transfer, when)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class Handoff(Event):
    """A prefill replica sampled a request's first token: its KV is to move."""

    priority: ClassVar[int] = 2
    request: int
    source: int  # the prefill replica

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.hand_off(self.request, self.source, when)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class RetryTransfers(Event):
    """A decode replica stepped with transfers queued: its step may have freed pages."""

    priority: ClassVar[int] = 3
    target: int  # the decode replica

    def fire(self, loop: EventLoop, when: float) -> None:
        loop.start_transfers(self.target, when)  # type: ignore[attr-defined]
