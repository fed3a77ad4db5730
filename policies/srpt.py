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
import math
from typing import ClassVar, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import RequestState, SchedulerView, StepPlan, plan_in_order, register
from policies._common import LastScheduled, LengthRanked, admits_nobody, candidates


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
    # [n] the requests of the last plan `schedule()` returned, in its (rank) order.
    _planned: NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False)

    def remaining_work(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        """`[n]` predicted remaining work of `ids`, in output-token units."""
        requests = view.requests
        prefill_left = np.where(requests.prefill_done(ids), 0, requests.num_uncomputed(ids))
        output_left = np.maximum(self._lengths.output_len(view, ids)
                                 - requests.num_generated[ids], 1)
        return self.prompt_token_weight * prefill_left + output_left

    stable_through_finishes: ClassVar[bool] = True  # see stable_steps

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady, without a starvation clock (`starvation_s` inf), while every running
        request ranks above every waiting one and nobody waiting could be admitted
        (`admits_nobody`). Each decode lowers every running request's remaining work by
        one and leaves the queue's, so the running keep their order and their lead, as
        long as no prediction is overrun (the remaining output is clamped at 1 there,
        where ties could reorder them): the bound is the fewest predicted tokens left.
        Through finishes (`stable_through_finishes`): the rest keep their order (each
        one's work fell alike), the question is asked again of the state after them,
        and the starvation clock a skipped `schedule()` does not mark is read only
        with a finite `starvation_s`, which promises nothing. Not after prefills
        (`stable_after_prefills`): its plan runs in rank order, not `view.running`'s.

        The plan repeated is the last one run, in its order, so the running must rank in
        that order now: the step before may have computed a prompt's last token, whose
        request's work then fell by its prompt token and its first output token, past a
        neighbour's (one whose work tied with it, ranked before it by index)."""
        if math.isfinite(self.starvation_s) or self._promoted_s is None:
            return None
        running = view.running
        ids = candidates(view)
        order = ids[np.lexsort((ids, self.remaining_work(view, ids), self._promoted_s[ids]))]
        if not (view.requests.state[order[:running.size]] == RequestState.RUNNING).all():
            return None
        # The last plan less the requests finished since (a leap runs it so).
        planned = self._planned[np.isin(self._planned, running)]
        if not np.array_equal(order[:running.size], planned):
            return None
        left = int((self._lengths.output_len(view, running)
                    - view.requests.num_generated[running]).min())
        return left if left >= 1 and admits_nobody(view) else None

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
        self._planned = plan.request_ids
        return plan
