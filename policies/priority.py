"""Strict priority with preemption: the most urgent requests always hold the batch.

Requests are ranked by (priority, arrival); a smaller priority value is more
urgent (`orca_jax.core.requests.request.Request.priority`). The best `max_num_seqs` run.
A more urgent waiting request takes the place of a less urgent running one when
the batch cap is reached: the displaced request is preempted by recompute
(its KV freed, back to waiting), so the running set never exceeds the cap,
which is what engines that only preempt on KV exhaustion cannot offer. When KV
pages run out, the least urgent running requests are preempted by recompute
until the more urgent request fits. Pages are allocated on demand. A running
request that only misses this step's token budget is paused, not preempted.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, RequestState, SchedulerView, StepPlan, plan_in_order, register
from policies._common import STEADY, admits_nobody, candidates


@register("priority")
@dataclasses.dataclass(kw_only=True)
class Priority(Policy):
    """Preemptive strict priority (no knobs: the ranking is the requests' own)."""

    def order(self, view: SchedulerView) -> NDArray[np.int64]:
        """`[k]` the running and waiting requests by (priority, arrival, index)."""
        requests = view.requests
        ids = candidates(view)
        return ids[np.lexsort((ids, requests.arrival_s[ids], requests.priority[ids]))]

    def schedule(self, view: SchedulerView) -> StepPlan:
        return plan_in_order(view, self.order(view), preempt_over_cap=True)

    stable_through_finishes: ClassVar[bool] = True  # see stable_steps

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while every running request ranks above every waiting one and nobody
        waiting could be admitted (`admits_nobody`). The ranking is the requests' own
        (priority, arrival), which no step moves, so the running keep their order and
        no waiting request rises above one (none preempts, none takes a seat over the
        cap); the free pages only fall, which admits fewer. No bookkeeping, no clock.
        Through finishes (`stable_through_finishes`): the rest keep their ranks and so
        their order, and the question is asked again of the state after them. Not
        after prefills (`stable_after_prefills`): its plan runs in rank order, not
        `view.running`'s."""
        order = self.order(view)
        num_running = view.running.size
        if not (view.requests.state[order[:num_running]] == RequestState.RUNNING).all():
            return None
        return STEADY if admits_nobody(view) else None
