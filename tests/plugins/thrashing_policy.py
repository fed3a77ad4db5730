"""A plugin that thrashes: its ranking flips every step, and admissions preempt.

Built as a careless plugin would be, on `plan_in_order` with its default
`admission_preempts=True`: each step the requests ranked last the step before
come first, so on a tight KV pool the waiting ones preempt the running ones
(recompute), which preempt them back the next step. Every admission still
samples a token, so the run ends; it just throws most of its work away.
"""

import dataclasses

import numpy as np

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order, register


@register("test_thrash")
@dataclasses.dataclass(kw_only=True)
class FlipFlop(Policy):
    """Ranks every request by index, ascending on even steps and descending on odd ones."""

    admission_preempts: bool = True  # False: the same ranking pauses instead of thrashing
    _calls: int = dataclasses.field(default=0, init=False, repr=False)

    def schedule(self, view: SchedulerView) -> StepPlan:
        self._calls += 1
        order = np.sort(np.concatenate([view.running, view.waiting]))  # [k] by index
        if self._calls % 2:
            order = order[::-1]
        return plan_in_order(view, order, admission_preempts=self.admission_preempts)
