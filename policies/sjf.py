"""Shortest job first: admit the waiting request with the least predicted total work.

A request's work is `prompt_token_weight * prompt_len + predicted output_len`,
with the output length from a pluggable predictor (`oracle`: the trace's true
length; learned predictors register in `orca_jax.learned.length_predictor`). SJF is
non-preemptive: running requests always run first, in admission order; the
free places of the batch go to the waiting requests with the least work.
Pages are allocated on demand; when they run out, the most recently admitted
running request is preempted by recompute (the policy's own order: running
requests before the queue). A waiting request older than `starvation_s` is
promoted ahead of the shortest ones (oldest first), so long jobs cannot starve.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np

from orca_jax import SchedulerView, StepPlan, plan_in_order, register
from policies._common import STEADY, LengthRanked, admits_nobody


@register("sjf")
@dataclasses.dataclass(kw_only=True)
class SJF(LengthRanked):
    """Non-preemptive shortest job first.

    Attributes:
      predictor: name of the output-length predictor (`oracle`, or a registered one).
      prompt_token_weight: work of one prompt token relative to one output token
        (1: the issue's "prompt + predicted output"; lower it to weigh that a
        prompt token is computed in a batch and costs less time than a decode).
      starvation_s: a request waiting this long since its arrival is promoted to
        the front of the queue (inf: never).
    """

    stable_through_finishes: ClassVar[bool] = True  # see stable_steps
    stable_after_prefills: ClassVar[bool] = True

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while nobody waiting could be admitted (`admits_nobody`): running
        requests always come first, in admission order, so the plan is all of them,
        one token each. The starvation clock only reorders the queue, and the
        predictions are cached once per request: no bookkeeping a skipped call misses.
        Through finishes and after prefills that ended (`stable_through_finishes`,
        `stable_after_prefills`) the same question is asked of the state `schedule()`
        would see; the running then decode in `view.running`'s order."""
        return STEADY if admits_nobody(view) else None

    def schedule(self, view: SchedulerView) -> StepPlan:
        waiting, requests = view.waiting, view.requests
        work = (self.prompt_token_weight * requests.prompt_len[waiting]
                + self._lengths.output_len(view, waiting))
        arrival = requests.arrival_s[waiting]
        overdue = view.now_s - arrival >= self.starvation_s
        queue = waiting[np.lexsort((waiting, np.where(overdue, arrival, work), ~overdue))]
        return plan_in_order(view, np.concatenate([view.running, queue]))
