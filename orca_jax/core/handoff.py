"""A request's KV handed from one scheduler to another (disaggregated prefill and decode).

A prefill replica (`SchedulerConfig.kv_handoff`) runs each request up to its
first token; the request then finishes there but keeps its KV pages, listed in
`Scheduler.in_transfer`, until the transfer that carries them ends (`release`).
The decode replica takes the request in two moves: when the transfer starts,
`reserve` gives it the pages its prompt's KV (and its first decode) will fill,
so the pool cannot be overcommitted while the bytes travel; when the transfer
ends, `deliver` makes it a waiting request whose prompt is computed and whose
first token is known. Its policy admits it like any waiting request: it has one
uncomputed token (a decode) and already holds the pages for it.

A decode replica holds every request back from arriving on its own
(`withhold_all`): requests reach it only by `deliver`. Nothing here is
specific to a cluster; `orca_jax.cluster.disaggregated` drives these calls.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.request import RequestState
from orca_jax.core.scheduler import Scheduler


def withhold_all(scheduler: Scheduler) -> None:
    """Routes away every request not rejected up front: each comes back by `deliver`."""
    pending = np.flatnonzero(scheduler.table.state == RequestState.PENDING)
    scheduler.withdraw(pending.tolist())


def pages_to_receive(scheduler: Scheduler, request: int) -> int:
    """Pages a transfer of `request` reserves: its prompt's KV and its first decode's."""
    tokens = np.array([scheduler.table.prompt_len[request] + 1], dtype=np.int64)
    return int(scheduler.kv.pages_for_tokens(tokens)[0])


def can_reserve(scheduler: Scheduler, request: int) -> bool:
    """Whether the pool has the pages for `request`'s transfer, beside the watermark."""
    return pages_to_receive(scheduler, request) <= scheduler.capacity.room()


def reserve(scheduler: Scheduler, request: int) -> bool:
    """Takes the pages for `request`'s transfer, if the pool has them; False leaves all
    unchanged (the transfer waits)."""
    if scheduler.table.state[request] != RequestState.ROUTED_AWAY:
        raise ValueError(f"reserve: request {request} is "
                         f"{RequestState(scheduler.table.state[request]).name} here; only a "
                         "withheld request (withhold_all) is received")
    if scheduler.kv.num_held[request] or not can_reserve(scheduler, request):
        return False
    ids = np.array([request], dtype=np.int64)
    scheduler.kv.allocate(ids, scheduler.table.prompt_len[ids] + 1)
    scheduler.in_transfer = _frozen(np.concatenate([scheduler.in_transfer, ids]))
    return True


def deliver(scheduler: Scheduler, request: int, *, first_token: int, first_token_s: float,
            at_s: float) -> None:
    """The transfer of `request` (reserved) ended at `at_s`: it waits with its prompt
    computed and its first token (`first_token`, sampled at `first_token_s`) known."""
    if request not in scheduler.in_transfer or scheduler.kv.num_held[request] == 0:
        raise ValueError(f"deliver: request {request} has no reserved transfer here")
    table = scheduler.table
    scheduler.in_transfer = _frozen(scheduler.in_transfer[scheduler.in_transfer != request])
    table.state[request] = RequestState.WAITING
    table.num_computed[request] = table.prompt_len[request]
    table.num_generated[request] = 1
    table.last_token[request] = first_token
    table.first_token_s[request] = table.last_token_s[request] = first_token_s
    if scheduler._generated is not None:
        scheduler._generated[request] = [int(first_token)]
    # Arrival order: a FCFS policy reads the queue as it is.
    scheduler.waiting = _frozen(np.sort(np.append(scheduler.waiting, request)))
    scheduler._num_done -= 1  # withheld counted as done
    scheduler.now_s = max(scheduler.now_s, at_s)


def release(scheduler: Scheduler, ids: NDArray[np.int64], at_s: float) -> None:  # [n]
    """The transfers of these finished requests ended at `at_s`: their pages go back."""
    ids = np.asarray(ids, dtype=np.int64)
    missing = ids[~np.isin(ids, scheduler.in_transfer)]
    if missing.size:
        raise ValueError(f"release: request {int(missing[0])} holds no pages for a transfer here")
    scheduler.kv.free(ids)
    scheduler.in_transfer = _frozen(scheduler.in_transfer[~np.isin(scheduler.in_transfer, ids)])
    scheduler.now_s = max(scheduler.now_s, at_s)


def _frozen(array: NDArray[np.int64]) -> NDArray[np.int64]:
    array.setflags(write=False)
    return array
