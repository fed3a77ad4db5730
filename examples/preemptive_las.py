"""Least attained service that preempts: the requests that have generated the fewest tokens
run first, and a running request that falls behind in rank gives up its pages."""

import dataclasses

import numpy as np

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order, register


@register("preemptive_las")
@dataclasses.dataclass(kw_only=True)
class PreemptiveLAS(Policy):
    """Ranks every request by tokens generated (then arrival); `plan_in_order` plans it.

    Attributes:
      admission_preempts: whether a waiting request may preempt running ones ranked
        below it. A request's rank falls as it generates, so with True every arrival
        preempts the running requests it outranks, which are readmitted later to
        recompute what they had: the plugin thrashes (docs/writing_a_policy.md).
    """

    admission_preempts: bool = False

    def schedule(self, view: SchedulerView) -> StepPlan:
        requests = view.requests
        ids = np.concatenate([view.running, view.waiting])  # [k] every running one
        # One numpy expression over the view's arrays: no Python loop over requests.
        order = ids[np.lexsort((requests.arrival_s[ids], requests.num_generated[ids]))]
        return plan_in_order(view, order, admission_preempts=self.admission_preempts)
