"""Plugin policies that fail, for tests/test_cli_errors.py: one in its own code at its third
plan (the CLI shows a traceback of this file's frames only, ending at the line that raised),
one whose plan breaks a rule (one line)."""

import dataclasses

import numpy as np

from orca_jax import Policy, SchedulerView, StepPlan, plan_in_order


@dataclasses.dataclass(kw_only=True)
class RaisesAtStep(Policy):
    """Plans like orca until step `fail_at`, then fails in its own helper."""

    fail_at: int = 3
    kv_reservation: str = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        if view.step_index >= self.fail_at:
            self._broken_rule(view)
        return plan_in_order(view, np.concatenate([view.running, view.waiting]))

    def _broken_rule(self, view: SchedulerView) -> None:
        raise RuntimeError(f"planted failure at step {view.step_index}")  # RAISES HERE


@dataclasses.dataclass(kw_only=True)
class UnknownRequest(Policy):
    """Plans a request id the run does not have: a plan error, not a plugin crash."""

    kv_reservation: str = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        return StepPlan([999], [1])
