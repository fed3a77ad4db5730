"""A test wrapper that records every plan a policy makes (shared by the policy tests)."""

import dataclasses

from orca_jax import Policy


@dataclasses.dataclass
class Step:
    """One recorded decision, with the running (and decoding) requests when it was made."""

    tokens: dict  # request index -> tokens
    preempt: list
    running: list = dataclasses.field(default_factory=list, compare=False)
    decoding: list = dataclasses.field(default_factory=list, compare=False)


class Recorder(Policy):
    """Delegates to a policy and keeps every plan that runs or preempts something."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.kv_reservation = inner.kv_reservation
        self.steps: list[Step] = []

    def check_limits(self, limits):
        self.inner.check_limits(limits)

    def schedule(self, view):
        running = view.running
        decoding = running[view.requests.prefill_done(running)].tolist()
        plan = self.inner.schedule(view)
        if plan.request_ids.size or plan.preempt.size:
            self.steps.append(Step(plan.as_dict(), plan.preempt.tolist(), running.tolist(),
                                   decoding))
        return plan
