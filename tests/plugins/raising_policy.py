"""A plugin that raises at a chosen step: what a run that fails mid-way leaves behind."""

import dataclasses

from orca_jax import Policy, SchedulerView, StepPlan
from policies.orca import Orca


@dataclasses.dataclass(kw_only=True)
class RaisesAtStep(Orca):
    """Orca, until step `fail_at_step`, where schedule() raises (or, with `interrupt`,
    is interrupted as Ctrl-C would)."""

    fail_at_step: int = 5
    interrupt: bool = False

    def schedule(self, view: SchedulerView) -> StepPlan:
        if view.step_index >= self.fail_at_step and self.interrupt:
            raise KeyboardInterrupt
        if view.step_index >= self.fail_at_step:
            raise RuntimeError(f"planted failure at step {view.step_index}")  # RAISES HERE
        return super().schedule(view)


@dataclasses.dataclass(kw_only=True)
class UnknownRequest(Policy):
    """Plans a request id the run does not have: a plan error (one line from the CLI), not a
    plugin crash (a traceback of this file's frames, ending at the line that raised)."""

    kv_reservation: str = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        return StepPlan([999], [1])
