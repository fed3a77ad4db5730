"""Ending requests from outside the plan: a client gone, an answer cut short.

A server ends requests no policy decided to end: a client that disconnects
(`cancel`: the request leaves, rejected with the reason given) and an answer
that hit a stop string or the end-of-sequence token (`stop`: the request
finishes now with the tokens it has, its output cut to them). Either way its
KV pages are freed at once and it leaves the queues, and the policy is told:
it is in `view.last_finished` at the next `schedule()` (its state says which:
FINISHED or REJECTED).

Both run between iterations, on the thread that steps the scheduler: the
steps in flight are landed first (`Executor.drain`), so no step still holds
a request that leaves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.loop.scheduler_loop import frozen
from orca_jax.core.requests.request import RequestState

# A `Scheduler` (which imports this module: it is not named here, to keep imports acyclic).
Scheduler = Any

_PENDING, _WAITING, _RUNNING, _FINISHED, _REJECTED = (
    int(RequestState.PENDING), int(RequestState.WAITING), int(RequestState.RUNNING),
    int(RequestState.FINISHED), int(RequestState.REJECTED))


def _live(scheduler: Scheduler, ids: NDArray[np.int64]) -> NDArray[np.int64]:
    """`[k]` of `ids`, those this scheduler holds and has not finished: pending (a
    submission not yet arrived), waiting or running. Others are left alone (a request
    that finished as its client left)."""
    table = scheduler.table
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    state = table.state[ids]
    return ids[((state == _PENDING) | (state == _WAITING) | (state == _RUNNING))
               & table.held_here(ids)]


def _leave_queues(scheduler: Scheduler, gone: NDArray[np.int64]) -> None:
    """Takes `gone` (already in a terminal state) out of the queues and frees their KV."""
    scheduler.kv_memory.free(gone)
    hits = scheduler.kv_memory.hits
    if hits is not None:
        hits.forget(gone)
    state = scheduler.table.state
    scheduler.running = frozen(scheduler.running[state[scheduler.running] == _RUNNING])
    scheduler.waiting = frozen(scheduler.waiting[state[scheduler.waiting] == _WAITING])
    scheduler.last_finished = frozen(np.union1d(scheduler.last_finished, gone))
    programs = scheduler.table.programs
    if programs is not None:  # a call's children go on without it (docs/programs.md)
        programs.done(gone, scheduler.now_s)


def cancel(scheduler: Scheduler, ids: NDArray[np.int64], reason: str) -> int:
    """Ends `ids` as REJECTED with `reason` (their rows keep the tokens they generated).

    Returns:
      How many of them were live here and so were cancelled.
    """
    scheduler.executor.drain()
    gone = _live(scheduler, ids)
    if gone.size == 0:
        return 0
    table = scheduler.table
    table.state[gone] = _REJECTED
    for request in gone.tolist():
        table.reject_reason[request] = reason
    _leave_queues(scheduler, gone)
    scheduler._num_done += int(gone.size)
    return int(gone.size)


def stop(scheduler: Scheduler, ids: NDArray[np.int64]) -> int:
    """Finishes `ids` now, each with the tokens it has generated (its `output_len` cut to
    them); one that has generated none yet is cancelled instead (`cancel`).

    Returns:
      How many of them were live here and so were stopped or cancelled.
    """
    scheduler.executor.drain()
    live = _live(scheduler, ids)
    table = scheduler.table
    started = live[table.num_generated[live] > 0]
    if started.size:
        table.end_output(started)
        table.state[started] = _FINISHED
        table.finish_s[started] = scheduler.now_s
        _leave_queues(scheduler, started)
        scheduler._num_done += int(started.size)
    unstarted = live[table.num_generated[live] == 0]
    cancelled = cancel(scheduler, unstarted, "stopped before its first token") if (
        unstarted.size) else 0
    return int(started.size) + cancelled
