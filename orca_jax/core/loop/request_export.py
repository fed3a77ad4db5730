"""A request moved between schedulers: its export, its import, and its release.

A request's whole story on one scheduler is its row of the `RequestTable`,
the token ids it generated (an engine with token ids), and its KV pages.
`export_request` copies all of it into a `RequestExport`, a plain value;
`import_request` makes another scheduler hold it from a given moment, as a
waiting request whose computed tokens' KV it already has (its policy admits
it like any waiting request, and it decodes on from where it stopped);
`release_request` lets the first scheduler's copy go (its pages back to the
pool). A disaggregated cluster moves each prompt's KV to a decode replica this
way (`orca_jax.cluster.handoff`), and a running request can migrate between two
colocated replicas the same way.

Pages: the receiver takes the pages of the request's computed tokens at the
import (or earlier, by `reserve_pages`, so that a pool is not overcommitted
while a transfer is in flight), and its engine gets the pages' contents when
the sender's engine has any (`Engine.read_kv_pages`; the simulator has none).
What moving them costs is the caller's to price (`orca_jax.cluster.transfers`).

Every scheduler of a cluster indexes its table by the request's index in the
workload's arrival order, so a request keeps its identity, its sampling seed
and its results row wherever it runs. Replicas of one pool share their table
(`RequestTable.for_replica`): there an import moves the request's holder to
the receiver (the row is the same), and the sender's release leaves the row
as the receiver wrote it; between pools (a prefill and a decode pool, whose
tables differ in output length) the import writes the receiver's row.

The functions here are the scheduler's own (its methods `export_request`,
`import_request`, `release_request` and `reserve_pages` call them, and keep its
done count and token ids): they keep its table, queues and pages consistent.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv import KVCapacity, KVPool
from orca_jax.core.kv.prefix_hits import PrefixHits
from orca_jax.core.loop.scheduler_loop import frozen
from orca_jax.core.requests.request import Request, RequestState
from orca_jax.core.requests.request_table import RequestTable
from orca_jax.core.step.engine_api import Engine

_WAITING, _RUNNING, _FINISHED, _AWAY = (int(RequestState.WAITING), int(RequestState.RUNNING),
                                        int(RequestState.FINISHED),
                                        int(RequestState.ROUTED_AWAY))


class Scheduler(Protocol):
    """What moving a request reads and writes of a `Scheduler` (the scheduler's own
    state: only its methods call these functions)."""

    table: RequestTable
    kv: KVPool
    capacity: KVCapacity
    engine: Engine
    hits: Optional[PrefixHits]
    now_s: float
    waiting: NDArray[np.int64]
    running: NDArray[np.int64]
    in_transfer: NDArray[np.int64]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestExport:
    """One request as a scheduler held it, to be imported by another.

    Attributes:
      request: its index in the workload (arrival order), the same on every scheduler.
      spec: its `Request` as the sender knew it.
      state: its `RequestState` on the sender (WAITING, RUNNING or FINISHED).
      num_computed: tokens whose KV the sender computed.
      num_generated: output tokens sampled so far.
      num_preemptions: times it was preempted so far.
      num_cached_tokens: tokens its first admission took from a prefix cache.
      first_scheduled_s, admitted_s, first_token_s, last_token_s: its times (NaN: not yet).
      last_token: its newest known token id.
      output_tokens: the token ids it generated, or None when neither the engine nor a
        prefix cache keeps them (the simulator's ids, placeholders, are kept for the
        cache's page names).
      kv_contents: its computed tokens' KV as the sender's engine read it (None: the
        engine keeps no KV, as the simulator).
    """

    request: int
    spec: Request
    state: int
    num_computed: int
    num_generated: int
    num_preemptions: int
    num_cached_tokens: int
    first_scheduled_s: float
    admitted_s: float
    first_token_s: float
    last_token_s: float
    last_token: int
    output_tokens: Optional[tuple[int, ...]]
    kv_contents: object = None


def export_request(scheduler: Scheduler, request: int, output_tokens: Optional[list[int]],
                   *, with_kv: bool = True) -> RequestExport:
    """A copy of `request`'s state on `scheduler` (which changes nothing), with the
    token ids it generated (`output_tokens`; None when the engine has none) and, with
    `with_kv`, its pages' KV (a live migration copies the pages itself, round by round).

    Raises:
      ValueError: the request is not held here (pending, rejected or routed away).
    """
    table = scheduler.table
    state = int(table.state[request])
    if state not in (_WAITING, _RUNNING, _FINISHED) or table.holder[request] != table.replica:
        raise ValueError(f"export_request: request {request} is "
                         f"{_state_here(scheduler, request)}; only a waiting, running or "
                         "finished request held here is exported")
    num_computed = int(table.num_computed[request])
    pages = scheduler.kv.pages_of(request)[:_pages_for(scheduler, num_computed)]
    return RequestExport(
        request=request, spec=table.specs[request], state=state, num_computed=num_computed,
        num_generated=int(table.num_generated[request]),
        num_preemptions=int(table.num_preemptions[request]),
        num_cached_tokens=int(table.num_cached_tokens[request]),
        first_scheduled_s=float(table.first_scheduled_s[request]),
        admitted_s=float(table.admitted_s[request]),
        first_token_s=float(table.first_token_s[request]),
        last_token_s=float(table.last_token_s[request]),
        last_token=int(table.last_token[request]),
        output_tokens=None if output_tokens is None else tuple(output_tokens),
        kv_contents=scheduler.engine.read_kv_pages(pages) if with_kv and pages.size else None)


def reserve_pages(scheduler: Scheduler, request: int, num_tokens: int) -> bool:
    """Takes the pages of `num_tokens` tokens for `request` before it is imported (or of
    its reservation, if larger: `KVCapacity.reserved_tokens`), if the pool has them
    beside its watermark; False leaves everything unchanged.

    The request is listed in `Scheduler.in_transfer` until its import.

    Raises:
      ValueError: the request is held here already.
    """
    _check_absent(scheduler, request, "reserve_pages")
    if scheduler.kv.num_held[request]:
        return False
    ids = np.array([request], dtype=np.int64)
    tokens = scheduler.capacity.reserved_tokens(ids, np.array([num_tokens], dtype=np.int64))
    if _pages_for(scheduler, int(tokens[0])) > scheduler.capacity.room():
        return False
    scheduler.kv.allocate(ids, tokens)
    scheduler.in_transfer = frozen(np.concatenate([scheduler.in_transfer, ids]))
    return True


def grow_reserved_pages(scheduler: Scheduler, request: int, num_tokens: int) -> bool:
    """Grows the pages reserved for `request` (by `reserve_pages`) to hold `num_tokens`
    tokens, if the pool has them beside its watermark; False leaves everything unchanged
    (a live migration's request grew on its sender while its pages were copied).

    Raises:
      ValueError: no pages are reserved here for the request.
    """
    ids = np.array([request], dtype=np.int64)
    if not np.isin(ids, scheduler.in_transfer)[0]:
        raise ValueError(f"grow_reserved_pages: request {request} has no pages reserved here")
    need = _pages_for(scheduler, num_tokens) - int(scheduler.kv.num_held[request])
    if need <= 0:
        return True
    if need > scheduler.capacity.room():
        return False
    scheduler.kv.allocate(ids, np.array([num_tokens], dtype=np.int64))
    return True


def cancel_reservation(scheduler: Scheduler, request: int) -> None:
    """Gives back the pages reserved for `request`, which will not be imported (an
    aborted migration).

    Raises:
      ValueError: no pages are reserved here for the request.
    """
    ids = np.array([request], dtype=np.int64)
    if not np.isin(ids, scheduler.in_transfer)[0] or scheduler.table.holder[request] == (
            scheduler.table.replica):
        raise ValueError(f"cancel_reservation: request {request} has no pages reserved here")
    scheduler.kv.free(ids)
    scheduler.in_transfer = frozen(scheduler.in_transfer[scheduler.in_transfer != request])


def import_request(scheduler: Scheduler, export: RequestExport, at_s: float) -> None:
    """`scheduler` holds `export`'s request from `at_s` on: waiting, its computed tokens'
    KV in its pages (reserved by `reserve_pages`, or taken now), its counters, times and
    tokens as exported. The request's facts (lengths, priority) are the receiver's own.

    Raises:
      ValueError: the request is held here already, was exported finished, the pool
        has no room for its pages, or prefix caching is active here and the export has
        no token ids to name its generated tokens' pages by; nothing changes.

    With prefix caching here the request keeps its own pages (it takes no hit while it
    holds them: `PrefixHits`), and its full pages are named, by the token ids it
    generated elsewhere (`export.output_tokens`), at its next step, as any request's.
    """
    request = export.request
    _check_absent(scheduler, request, "import_request")
    if scheduler.hits is not None and export.output_tokens is None and export.num_generated:
        raise ValueError(f"import_request: request {request}: prefix caching is active "
                         "here, and its export has no generated token ids to name its "
                         "pages by")
    if export.state == _FINISHED and export.num_generated >= scheduler.table.output_len[request]:
        raise ValueError(f"import_request: request {request} has its whole answer; "
                         "nothing is left to run")
    ids = np.array([request], dtype=np.int64)
    reserved = bool(np.isin(ids, scheduler.in_transfer)[0])
    needed = _pages_for(scheduler, export.num_computed)
    if not reserved and needed:
        if needed > scheduler.kv.num_free:
            raise ValueError(f"import_request: request {request} needs {needed} KV pages; "
                             f"{scheduler.kv.num_free} are free")
        scheduler.kv.allocate(ids, np.array([export.num_computed], dtype=np.int64))
    if export.kv_contents is not None:
        scheduler.engine.write_kv_pages(scheduler.kv.pages_of(request)[:needed],
                                        export.kv_contents)
    table = scheduler.table
    table.state[request] = _WAITING
    table.num_computed[request] = export.num_computed
    table.num_generated[request] = export.num_generated
    table.num_preemptions[request] = export.num_preemptions
    table.num_cached_tokens[request] = export.num_cached_tokens
    table.first_scheduled_s[request] = export.first_scheduled_s
    table.admitted_s[request] = export.admitted_s
    table.first_token_s[request] = export.first_token_s
    table.last_token_s[request] = export.last_token_s
    table.last_token[request] = export.last_token
    table.holder[request] = table.replica
    if scheduler.hits is not None:
        scheduler.hits.receive(request, np.asarray(export.output_tokens or (), dtype=np.int32))
    scheduler.in_transfer = frozen(scheduler.in_transfer[scheduler.in_transfer != request])
    # Arrival order: a FCFS policy reads the queue as it is.
    scheduler.waiting = frozen(np.sort(np.append(scheduler.waiting, request)))
    scheduler.now_s = max(scheduler.now_s, at_s)


def release_request(scheduler: Scheduler, request: int, at_s: float) -> bool:
    """`scheduler` lets `request` go at `at_s` (it was exported): its pages go back to the
    pool. A waiting or running request leaves its queue and is routed away here (its
    results row is the receiver's); a finished one whose pages waited for a transfer
    (`in_transfer`) stays finished.

    Returns:
      Whether the request left this scheduler (it counts as done here from now on).

    Raises:
      ValueError: the request is neither held here nor finished with its pages kept.
    """
    table = scheduler.table
    ids = np.array([request], dtype=np.int64)
    queued = bool(np.isin(ids, scheduler.waiting)[0] or np.isin(ids, scheduler.running)[0])
    left = False
    if not queued and table.state[request] == _FINISHED and np.isin(
            ids, scheduler.in_transfer)[0]:
        scheduler.kv.free(ids)  # finished here; its pages waited for the transfer
        scheduler.in_transfer = frozen(scheduler.in_transfer[scheduler.in_transfer != request])
    elif queued:
        scheduler.kv.free(ids)
        if scheduler.hits is not None:
            scheduler.hits.forget(ids)
        # Imported by another replica of this table already: the row is the receiver's.
        # Else it leaves this pool (or waits for its import): held by none meanwhile.
        if table.holder[request] == table.replica:
            table.state[request] = _AWAY
            table.holder[request] = -1
        scheduler.waiting = frozen(scheduler.waiting[scheduler.waiting != request])
        scheduler.running = frozen(scheduler.running[scheduler.running != request])
        left = True
    else:
        raise ValueError(f"release_request: request {request} is "
                         f"{_state_here(scheduler, request)} and holds no pages for a "
                         "transfer")
    scheduler.now_s = max(scheduler.now_s, at_s)
    return left


def _check_absent(scheduler: Scheduler, request: int, what: str) -> None:
    table = scheduler.table
    state = int(table.state[request])
    # Received: held by none of its pool, or by another replica of a shared table.
    if table.holder[request] == table.replica:
        raise ValueError(f"{what}: request {request} is {RequestState(state).name} here; only "
                         "a request this scheduler does not hold is received")


def _state_here(scheduler: Scheduler, request: int) -> str:
    """The request's state as this scheduler sees it ("held by replica 2" when another
    replica of its shared table holds it)."""
    table = scheduler.table
    holder = int(table.holder[request])
    if table.shared and holder != table.replica:
        return "held by " + (f"replica {holder}" if holder >= 0 else "no replica")
    return f"{RequestState(int(table.state[request])).name} here"


def _pages_for(scheduler: Scheduler, num_tokens: int) -> int:
    return int(scheduler.kv.pages_for_tokens(np.array([num_tokens], dtype=np.int64))[0])
