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

import numpy as np

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order, register
from policies._common import candidates


@register("priority")
@dataclasses.dataclass(kw_only=True)
class Priority(Policy):
    """Preemptive strict priority (no knobs: the ranking is the requests' own)."""

    def schedule(self, view: SchedulerView) -> StepPlan:
        requests = view.requests
        ids = candidates(view)
        order = ids[np.lexsort((ids, requests.arrival_s[ids], requests.priority[ids]))]
        return plan_in_order(view, order, preempt_over_cap=True)
