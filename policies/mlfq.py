"""FastServe's skip-join multi-level feedback queue (Wu et al., 2023).

Queues 0..num_queues-1 have quanta `base_quantum * quantum_growth**k`. Quanta
are in *work units*: a decode step of a request costs 1 (one output token), a
prefill token costs `prompt_token_weight` (a prompt is computed in one batched
pass, so per token it takes far less time than a decode step; FastServe
measures both in time, and these units are that time over one decode
iteration). A new request *skip-joins*: it enters the highest queue whose
quantum covers its prefill work (`prompt_token_weight * prompt_len`), so a long
prompt does not hold up the short jobs of the top queues. A request that has
used its queue's quantum is demoted to the next queue (its use starts again
from 0 there). Each step, requests run in queue order, first come first served
within a queue (in the order they entered it), up to the batch cap; the others
are paused and keep their KV (FastServe keeps the KV of preempted jobs;
this core keeps it on the device). When a running request needs a page and none
is free, the lowest-ranked running requests are preempted by recompute; a
waiting request waits for free pages instead of evicting (ranks move both ways
as jobs are demoted, and evicting for admissions would thrash). A request not scheduled for
`starvation_s` seconds goes back to the top queue.

A waiting request is admitted only when the free pages cover what it needs to
reach its next token (its whole prompt, chunked or not) on top of what every
running request still needs to reach its own. Admitting on the first chunk's
pages alone let the admitted jobs' prefills outgrow the pool together: the
lowest-ranked were preempted to feed the others, promoted again once starved,
readmitted, and preempted again, and with a short `starvation_s` no job ever
finished (a livelock the scheduler's `no_progress` watchdog now also catches).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, RequestState, SchedulerView, StepPlan, plan_in_order, register
from policies._common import LastScheduled, candidates


@register("mlfq")
@dataclasses.dataclass(kw_only=True)
class MLFQ(Policy):
    """Skip-join MLFQ.

    Attributes:
      num_queues: number of priority queues.
      base_quantum: quantum of the top queue, in work units (decode tokens).
      quantum_growth: ratio between the quanta of consecutive queues.
      prompt_token_weight: work units of one prefill token.
      skip_join: join the queue that fits the prefill work (False: always the top one).
      starvation_s: a request not scheduled for this long returns to the top
        queue (inf: never).
    """

    num_queues: int = 8
    base_quantum: float = 16.0
    quantum_growth: float = 2.0
    prompt_token_weight: float = 0.125
    skip_join: bool = True
    starvation_s: float = math.inf
    _level: Optional[NDArray[np.int64]] = dataclasses.field(  # [N] queue, -1: not yet joined
        default=None, init=False, repr=False)
    _used: Optional[NDArray[np.float64]] = dataclasses.field(  # [N] work used in its queue
        default=None, init=False, repr=False)
    _ticket: Optional[NDArray[np.int64]] = dataclasses.field(  # [N] order it joined its queue
        default=None, init=False, repr=False)
    _next_ticket: int = dataclasses.field(default=0, init=False, repr=False)
    _last: LastScheduled = dataclasses.field(default_factory=LastScheduled, init=False,
                                             repr=False)

    def __post_init__(self) -> None:
        if self.num_queues < 1:
            raise ValueError(f"num_queues must be >= 1, got {self.num_queues}")
        if not self.base_quantum > 0 or not self.quantum_growth >= 1:
            raise ValueError(f"base_quantum must be > 0 and quantum_growth >= 1, got "
                             f"{self.base_quantum} and {self.quantum_growth}")
        if not self.prompt_token_weight >= 0:
            raise ValueError(f"prompt_token_weight must be >= 0, got {self.prompt_token_weight}")
        if not self.starvation_s > 0:
            raise ValueError(f"starvation_s must be > 0, got {self.starvation_s}")

    @property
    def quanta(self) -> NDArray[np.float64]:
        """`[num_queues]` the quantum of each queue (the last one never demotes further)."""
        return self.base_quantum * self.quantum_growth ** np.arange(self.num_queues)

    def levels(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:
        """`[n]` the queue each request is in (-1: not seen by the policy yet)."""
        if self._level is None:
            return np.full(len(ids), -1, dtype=np.int64)
        return self._level[np.asarray(ids, dtype=np.int64)].copy()

    def _join(self, view: SchedulerView, ids: NDArray[np.int64]) -> None:
        assert self._level is not None and self._used is not None
        new = np.sort(ids[self._level[ids] < 0])  # arrival order
        if new.size == 0:
            return
        if self.skip_join:
            prefill = self.prompt_token_weight * view.requests.prompt_len[new]
            level = np.minimum(np.searchsorted(self.quanta, prefill, side="left"),
                               self.num_queues - 1)
        else:
            level = np.zeros(new.size, dtype=np.int64)
        self._level[new] = level
        self._used[new] = 0.0
        self._enqueue(new)

    def _enqueue(self, ids: NDArray[np.int64]) -> None:
        """Puts `ids` (in this order) at the tails of their queues."""
        assert self._ticket is not None
        self._ticket[ids] = self._next_ticket + np.arange(ids.size)
        self._next_ticket += int(ids.size)

    def schedule(self, view: SchedulerView) -> StepPlan:
        if self._level is None:
            n = len(view.requests)
            self._level = np.full(n, -1, dtype=np.int64)
            self._used = np.zeros(n)
            self._ticket = np.zeros(n, dtype=np.int64)
        level, used, ticket = self._level, self._used, self._ticket
        assert used is not None
        ids = candidates(view)
        self._join(view, ids)
        starved = ids[(self._last.idle_s(view, ids) >= self.starvation_s) & (level[ids] > 0)]
        level[starved], used[starved] = 0, 0.0
        self._enqueue(np.sort(starved))
        order = _admissible(view, ids[np.lexsort((ticket[ids], level[ids]))])
        plan = plan_in_order(view, order, admission_preempts=False)
        self._last.mark(view, plan)
        self._charge(view, plan)
        return plan

    def _charge(self, view: SchedulerView, plan: StepPlan) -> None:
        """Charges the plan's work to its requests' quanta and demotes those that used theirs."""
        assert self._level is not None and self._used is not None
        ids = plan.request_ids
        if ids.size == 0:
            return
        decoding = view.requests.prefill_done(ids)
        work = np.where(decoding, 1.0, self.prompt_token_weight * plan.num_tokens)
        self._used[ids] += work
        spent = ids[(self._used[ids] >= self.quanta[self._level[ids]])
                    & (self._level[ids] < self.num_queues - 1)]
        self._level[spent] += 1
        self._used[spent] = 0.0
        self._enqueue(spent)  # a demoted job joins the tail of its new queue


def _admissible(view: SchedulerView, order: NDArray[np.int64]) -> NDArray[np.int64]:
    """`order` (ranked, `[k]`) less the waiting requests whose admission would leave the
    pool unable to take every admitted request to its next token: from the first
    waiting one that does not fit on, so a large job is not overtaken forever."""
    requests = view.requests
    running = requests.state[order] == RequestState.RUNNING  # [k]
    owed = int(view.pages_needed(order[running], requests.num_uncomputed(order[running])).sum())
    waiting = order[~running]
    if waiting.size == 0:
        return order
    left = requests.num_uncomputed(waiting)
    if view.prefix_caching:
        left = left - view.cached_tokens(waiting)
    need = np.cumsum(view.pages_needed(waiting, left))  # [w]
    room = view.kv_room() - owed
    fits = need <= room
    if fits.all():
        return order
    return order[running | np.isin(order, waiting[:int(np.argmin(fits))])]  # ranks kept
