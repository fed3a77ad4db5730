"""Plugins whose schedule() builds a StepPlan its fields cannot make (issue 25's soak).

Each must end the run with one line naming the policy and rule `not_a_plan`, not the
framework's traceback: the plan is the plugin's error.
"""

import math

from orca_jax import Policy, SchedulerView, StepPlan


class LengthsDiffer(Policy):
    """One token count for no request."""

    kv_reservation = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        return StepPlan([], [1])  # BUILT HERE


class NaNTokens(Policy):
    """A NaN token count for the first waiting request."""

    kv_reservation = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        return StepPlan(view.waiting[:1], [math.nan] * min(view.waiting.size, 1))


class TextIds(Policy):
    """Request ids as text."""

    kv_reservation = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        return StepPlan([str(i) for i in view.waiting[:1]], [1] * min(view.waiting.size, 1))
