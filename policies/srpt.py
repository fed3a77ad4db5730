"""Shortest remaining processing time: re-rank every request every step; pause the rest.

Every step, running and waiting requests are ranked by their predicted remaining
work, `prompt_token_weight * (prompt tokens still to compute) + (predicted
output tokens still to generate)` (at least 1 output token: a learned predictor
may undershoot), and the best `max_num_seqs` run. A running request that
falls out of the top is *paused*: it keeps its KV pages and resumes where it
stopped, so preemption costs nothing but waiting (SRPT's cheap preemption).
When pages run out, the lowest-ranked running requests are preempted by
recompute. A request not scheduled for `starvation_s` seconds is promoted, for
good, ahead of every unpromoted one (earliest promotion first), so long
requests finish even under a stream of short ones.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import SchedulerView, StepPlan, plan_in_order, register
from policies._common import LastScheduled, LengthRanked, candidates


@register("srpt")
@dataclasses.dataclass(kw_only=True)
class SRPT(LengthRanked):
    """Preemptive (by pausing) shortest remaining predicted processing time.

    Attributes:
      predictor: name of the output-length predictor (`oracle`, or a registered one).
      prompt_token_weight: work of one prompt token relative to one output token.
      starvation_s: a request not scheduled for this long is promoted (inf: never).
    """

    _last: LastScheduled = dataclasses.field(default_factory=LastScheduled, init=False,
                                             repr=False)
    _promoted_s: Optional[NDArray[np.float64]] = dataclasses.field(  # [N] inf: not promoted
        default=None, init=False, repr=False)

    def remaining_work(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        """`[n]` predicted remaining work of `ids`, in output-token units."""
        requests = view.requests
        prefill_left = np.where(requests.prefill_done(ids), 0, requests.num_uncomputed(ids))
        output_left = np.maximum(self._lengths.output_len(view, ids)
                                 - requests.num_generated[ids], 1)
        return self.prompt_token_weight * prefill_left + output_left

    def schedule(self, view: SchedulerView) -> StepPlan:
        if self._promoted_s is None:
            self._promoted_s = np.full(len(view.requests), np.inf)
        ids = candidates(view)
        promoted = self._promoted_s
        overdue = (self._last.idle_s(view, ids) >= self.starvation_s) & np.isinf(promoted[ids])
        promoted[ids[overdue]] = view.now_s
        order = ids[np.lexsort((ids, self.remaining_work(view, ids), promoted[ids]))]
        plan = plan_in_order(view, order)
        self._last.mark(view, plan)
        return plan
